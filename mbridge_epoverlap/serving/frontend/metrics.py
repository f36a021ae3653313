"""`ServerMetrics`: what `/metrics` shows, in Prometheus' text format (`prometheus_client`, a registry per server).

Names (all prefixed `mbe_`):

- `mbe_requests_total{outcome}`: requests by outcome, `finished` (a finish reason: stop or length), `aborted`
  (the client went away), `failed` (the engine failed under it, or the server shut down first), `rejected`
  (refused at once: 503 while starting, draining, failed or with too many waiting).
- `mbe_time_to_first_token_seconds`, `mbe_time_per_output_token_seconds`, `mbe_e2e_request_latency_seconds`:
  histograms, from the front end's view (submission to first token; between tokens after the first;
  submission to the last token).
- `mbe_requests_running`, `mbe_requests_waiting`: gauges, summed over the attention workers' last reports.
- `mbe_kv_cache_tokens`: tokens held in the attention workers' KV caches (freed rows leave it).
- `mbe_state_cache_bytes_per_sequence`: a hybrid model's (Qwen3-Next, Nemotron-H) states per sequence, whatever
  its length: the convolution windows and the fp32 recurrent states of every DeltaNet or Mamba-2 layer (0: none).
- `mbe_kv_cache_bytes_per_token`: bytes one token takes in the KV cache over all layers, in the compute dtype (a
  latent attention model's latents, another's keys and values): times `mbe_kv_cache_tokens`, the cache in use.
- `mbe_expert_load_imbalance`: max/mean of the (token, choice) pairs routed to each expert, summed over the MoE
  layers (what the elastic re-solve balances: every expert worker holds the same experts in every layer), over the
  last `LOAD_WINDOW_S` seconds of reports that carried load.
- `mbe_expert_layer_load_imbalance{layer}`: the same max/mean for each MoE layer (`layer`: the model's layer id).
  Both are over the window, not since start: they show the skew the re-solve would act on now, and a shift of the
  load shows within `LOAD_WINDOW_S` instead of being diluted by everything served before.
- `mbe_expert_layer_tokens_total{layer}`: (token, choice) pairs routed in each MoE layer since the server started.
- `mbe_expert_hot_tokens{layer,rank}`, `mbe_expert_hot_expert{layer,rank}`: the `HOT_EXPERTS` experts of each MoE
  layer with the most (token, choice) pairs since the start (`rank` 0 the hottest; ties to the lower expert id),
  their counts and their expert ids. The expert id is a value, not a label, so the series count stays
  2 x layers x `HOT_EXPERTS` however the ranking changes (a label would add a series per expert ever ranked).
  Since start rather than over the window: the ranking is stable between scrapes and the counts add up with
  `mbe_expert_layer_tokens_total`.
- `mbe_expert_tokens_total{layer,expert}`: (token, choice) pairs routed to each expert of each MoE layer since the
  server started; only with `serve --http --expert-metrics full` (one series per layer and expert: 58 x 256 =
  14,848 on DeepSeek-V3, too many for most Prometheus set-ups to keep by default).
- `mbe_elastic_workers_lost_total`: worker processes lost, each counted once: an expert worker (or one of its
  replacements) when an attention worker reports it detected the loss, any worker when the front end sees its
  process gone (whichever comes first).
- `mbe_elastic_workers_rejoined_total`: replacement expert workers admitted; `mbe_elastic_rebalances_total`: layout
  epochs entered to balance the load; `mbe_elastic_expert_copies_moved_total`: expert copies that changed owner at
  those epochs and at rejoins. Each layout epoch is counted once, from the first report of it (every attention
  worker enters the same ones, and any of them may be lost).
- `mbe_requests_moved_total`: requests moved off a lost attention worker to a survivor (elastic mode).
- `mbe_engine_steps{worker}`, `mbe_engine_idle_steps{worker}`: engine steps each attention worker ran, and of
  those the empty ones (no request: what an idle server costs, one every `online.idle_wait_s` at most), as of its
  last report.
- `mbe_engine_step_seconds{worker}`, `mbe_iteration_tokens{worker}`: histograms of each attention worker's steps
  that fed tokens: the step's time, and the token rows it fed (prompt chunks and decoding tokens, as vLLM's
  `vllm:iteration_tokens_total`). A step that feeds a large prefill beside decoding sequences is the inter-token
  latency those sequences see: the two histograms side by side show what `--max-prefill-tokens` costs them.

The load and the elastic events come from the attention workers' `online.Stats` (what their routers chose and
what they saw); nothing here is estimated by the front end.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

log = logging.getLogger(__name__)

_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
OUTCOMES = ("finished", "aborted", "failed", "rejected")
LOAD_WINDOW_S = 10.0  # the expert-load imbalance gauges cover the reports of the last this many seconds
HOT_EXPERTS = 4  # experts per MoE layer in the default (`top`) view of the expert load
EXPERT_METRICS = ("top", "full")  # `serve --http --expert-metrics`: the hottest experts per layer, or every expert


def max_over_mean(counts: Sequence[int]) -> float | None:
    """max/mean of per-expert counts (1.0: every expert got as much); None when nothing was counted."""
    total = sum(counts)
    return max(counts) / (total / len(counts)) if counts and total else None


class ServerMetrics:
    """The server's Prometheus metrics (see the module docstring)."""

    def __init__(self, moe_layers: Sequence[int] = (), expert_metrics: str = "top",
                 kv_bytes_per_token: int | None = None, state_bytes_per_sequence: int = 0) -> None:
        """Args:
            moe_layers: the model's MoE layer ids, ascending (the rows of every report's expert load).
            expert_metrics: `top` (the `HOT_EXPERTS` hottest experts per layer) or `full` (also a counter per
                layer and expert, `mbe_expert_tokens_total`).
            kv_bytes_per_token: the KV cache's bytes per token (`kv_cache.kv_cache_bytes_per_token`), if known.
            state_bytes_per_sequence: a hybrid model's DeltaNet or Mamba-2 states per sequence
                (`linear.state_cache.state_bytes_per_sequence`; 0 for a model without them).
        """
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        if expert_metrics not in EXPERT_METRICS:
            raise ValueError(f"expert_metrics {expert_metrics!r} is not one of {EXPERT_METRICS}")
        self.moe_layers = list(moe_layers)
        self.expert_metrics = expert_metrics
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("mbe_requests", "Requests by outcome", ["outcome"], registry=registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.ttft = Histogram("mbe_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS,
                              registry=registry)
        self.tpot = Histogram("mbe_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("mbe_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=registry)
        self.running = Gauge("mbe_requests_running", "Requests decoding", registry=registry)
        self.waiting = Gauge("mbe_requests_waiting", "Requests waiting for a slot", registry=registry)
        self.kv_tokens = Gauge("mbe_kv_cache_tokens", "Tokens held in the KV caches", registry=registry)
        self.prefix_queries = Counter("mbe_prefix_cache_queries", "Prompt tokens looked up in the prefix caches",
                                      registry=registry)
        self.prefix_hits = Counter("mbe_prefix_cache_hits", "Prompt tokens found in the prefix caches (not "
                                   "prefilled)", registry=registry)
        self.prefix_bytes = Gauge("mbe_prefix_cache_bytes", "Bytes the prefix caches hold", registry=registry)
        self._prefix_seen: dict[int, tuple[int, int]] = {}  # worker -> (queries, hits) at its last report
        self.kv_bytes = Gauge("mbe_kv_cache_bytes_per_token", "Bytes one token takes in the KV cache, all layers",
                              registry=registry)
        if kv_bytes_per_token is not None:
            self.kv_bytes.set(kv_bytes_per_token)
        self.state_bytes = Gauge("mbe_state_cache_bytes_per_sequence",
                                 "Bytes one sequence's DeltaNet or Mamba-2 states take, all layers (0: none)",
                                 registry=registry)
        self.state_bytes.set(state_bytes_per_sequence)
        self.imbalance = Gauge("mbe_expert_load_imbalance",
                               "Max/mean tokens per expert over all MoE layers, last window", registry=registry)
        self.layer_imbalance = Gauge("mbe_expert_layer_load_imbalance", "Max/mean tokens per expert, last window",
                                     ["layer"], registry=registry)
        self.layer_tokens = Counter("mbe_expert_layer_tokens", "(token, choice) pairs routed in each MoE layer",
                                    ["layer"], registry=registry)
        self.hot_tokens = Gauge("mbe_expert_hot_tokens", "(token, choice) pairs since start of the rank-th hottest "
                                "expert of each MoE layer", ["layer", "rank"], registry=registry)
        self.hot_expert = Gauge("mbe_expert_hot_expert", "Expert id of the rank-th hottest expert of each MoE layer",
                                ["layer", "rank"], registry=registry)
        self.expert_tokens = Counter("mbe_expert_tokens", "(token, choice) pairs routed to each expert",
                                     ["layer", "expert"], registry=registry) if expert_metrics == "full" else None
        self._tokens: list[list[int]] = [[] for _ in self.moe_layers]  # per layer, per expert, since start
        self.lost = Counter("mbe_elastic_workers_lost", "Worker processes lost", registry=registry)
        self.rejoined = Counter("mbe_elastic_workers_rejoined", "Replacement expert workers admitted",
                                registry=registry)
        self.moved_requests = Counter("mbe_requests_moved", "Requests moved off a lost attention worker",
                                      registry=registry)
        self.rebalances = Counter("mbe_elastic_rebalances", "Layout epochs entered to balance the expert load",
                                  registry=registry)
        self.moved_copies = Counter("mbe_elastic_expert_copies_moved", "Expert copies that changed owner",
                                    registry=registry)
        self.steps = Gauge("mbe_engine_steps", "Engine steps an attention worker ran, as of its last report",
                           ["worker"], registry=registry)
        self.idle_steps = Gauge("mbe_engine_idle_steps", "Engine steps an attention worker ran with no request",
                                ["worker"], registry=registry)
        self.step_seconds = Histogram("mbe_engine_step_seconds", "Time of an engine step that fed tokens",
                                      ["worker"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.step_tokens = Histogram("mbe_iteration_tokens", "Token rows an engine step fed (prompt and decoding)",
                                     ["worker"], buckets=_STEP_TOKEN_BUCKETS, registry=registry)
        self._window: deque[tuple[float, list[list[int]]]] = deque()  # (arrival, load) of the last window
        self._lost: set[tuple[str, int, int]] = set()  # (role, index, replacement generation) counted lost
        self._generation: Tally[tuple[int, int]] = Tally()  # (attention worker, expert worker) -> rejoins seen
        self._epochs: set[Any] = set()  # layout epochs counted

    def rejected(self) -> None:
        self.requests.labels("rejected").inc()

    def finished(self, outcome: str, stream: Any) -> None:
        """A request ended (`RequestStream`): count it; a finished one also feeds the latency histograms."""
        self.requests.labels(outcome).inc()
        if outcome != "finished" or stream.first_token_at is None:
            return
        now = time.monotonic()
        self.ttft.observe(stream.first_token_at - stream.submitted_at)
        self.e2e.observe(now - stream.submitted_at)
        if stream.tokens > 1:
            self.tpot.observe((now - stream.first_token_at) / (stream.tokens - 1))

    def worker_stats(self, latest: Any, every: Iterable[Any]) -> None:
        """A worker's `online.Stats` arrived; `every` holds each worker's latest."""
        every = list(every)
        self.running.set(sum(s.running for s in every))
        self.waiting.set(sum(s.waiting for s in every))
        self.kv_tokens.set(sum(s.kv_tokens for s in every))
        queries, hits = self._prefix_seen.get(latest.worker, (0, 0))
        self.prefix_queries.inc(max(0, latest.prefix_query_tokens - queries))
        self.prefix_hits.inc(max(0, latest.prefix_hit_tokens - hits))
        self._prefix_seen[latest.worker] = (latest.prefix_query_tokens, latest.prefix_hit_tokens)
        self.prefix_bytes.set(sum(s.prefix_bytes for s in every))
        self.steps.labels(str(latest.worker)).set(latest.steps)
        self.idle_steps.labels(str(latest.worker)).set(latest.idle_steps)
        seconds, tokens = self.step_seconds.labels(str(latest.worker)), self.step_tokens.labels(str(latest.worker))
        for step_s, rows in zip(latest.step_seconds, latest.step_tokens, strict=False):
            seconds.observe(step_s)
            tokens.observe(rows)
        self._load(latest.expert_load)
        for event in latest.events:
            self._event(latest.worker, event)

    def _load(self, load: list[list[int]]) -> None:
        """Count a report's per-layer expert load and recompute the imbalance over the window."""
        if not any(any(row) for row in load):
            return
        for index, (layer, row) in enumerate(zip(self.moe_layers, load, strict=False)):
            if not any(row):
                continue
            totals = self._tokens[index]
            totals.extend([0] * (len(row) - len(totals)))
            for expert, count in enumerate(row):
                totals[expert] += count
                if count and self.expert_tokens is not None:
                    self.expert_tokens.labels(str(layer), str(expert)).inc(count)
            self.layer_tokens.labels(str(layer)).inc(sum(row))
            hottest = heapq.nsmallest(HOT_EXPERTS, range(len(totals)), key=lambda e: (-totals[e], e))
            for rank, expert in enumerate(hottest):
                self.hot_tokens.labels(str(layer), str(rank)).set(totals[expert])
                self.hot_expert.labels(str(layer), str(rank)).set(expert)
        now = time.monotonic()
        self._window.append((now, load))
        while self._window and self._window[0][0] < now - LOAD_WINDOW_S:
            self._window.popleft()
        summed = [[sum(col) for col in zip(*rows, strict=True)]
                  for rows in zip(*(entry for _, entry in self._window), strict=True)]
        for layer, row in zip(self.moe_layers, summed, strict=False):
            value = max_over_mean(row)
            if value is not None:
                self.layer_imbalance.labels(str(layer)).set(value)
        value = max_over_mean([sum(col) for col in zip(*summed, strict=True)])
        if value is not None:
            self.imbalance.set(value)

    def _event(self, attention: int, event: dict[str, Any]) -> None:
        """One elastic event an attention worker reported (`online.EVENT_FIELDS`)."""
        name = event.get("event")
        if name == "detected":  # every attention worker detects each loss (some twice): count each process once
            for worker in event.get("workers", []):
                self.worker_lost("expert", worker, self._generation[(attention, worker)])
        elif name in ("rebalanced", "rejoined"):
            for worker in event.get("joined", []):
                self._generation[(attention, worker)] += 1
            epoch = event.get("epoch")
            if epoch in self._epochs:  # every attention worker enters the same epochs: count each once
                return
            self._epochs.add(epoch)
            self.moved_copies.inc(event.get("moved", 0))
            if name == "rejoined":
                self.rejoined.inc(len(event.get("joined", [])))
            else:
                self.rebalances.inc()

    def moved(self) -> None:
        self.moved_requests.inc()

    def worker_lost(self, role: str, index: int, generation: int = 0) -> None:
        """A worker process is gone (generation: its replacements before it); counted once however it was seen."""
        key = (role, index, generation)
        if key not in self._lost:
            self._lost.add(key)
            self.lost.inc()
            log.warning("%s worker %d%s was lost (mbe_elastic_workers_lost_total)", role, index,
                        f" (replacement {generation})" if generation else "")

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of `/metrics`."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
