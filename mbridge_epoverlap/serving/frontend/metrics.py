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
- `mbe_expert_load_imbalance`: max/mean of the tokens routed to each expert over the last reported window.
- `mbe_elastic_workers_lost_total`, `mbe_elastic_workers_rejoined_total`, `mbe_elastic_rebalances_total`:
  counters of elastic events (a worker process seen dead; a replacement admitted; a re-placement that moved
  expert weights).
- `mbe_requests_moved_total`: requests moved off a lost attention worker to a survivor (elastic mode).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
OUTCOMES = ("finished", "aborted", "failed", "rejected")


class ServerMetrics:
    """The server's Prometheus metrics (see the module docstring)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        self.imbalance = Gauge("mbe_expert_load_imbalance", "Max/mean tokens per expert, last window",
                               registry=registry)
        self.lost = Counter("mbe_elastic_workers_lost", "Worker processes lost", registry=registry)
        self.rejoined = Counter("mbe_elastic_workers_rejoined", "Replacement expert workers admitted",
                                registry=registry)
        self.moved_requests = Counter("mbe_requests_moved", "Requests moved off a lost attention worker",
                                      registry=registry)
        self.rebalances = Counter("mbe_elastic_rebalances", "Re-placements that moved expert weights",
                                  registry=registry)

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
        load = latest.expert_load
        if load and sum(load):
            self.imbalance.set(max(load) / (sum(load) / len(load)))
        for event in latest.events:
            if event == "rejoined":
                self.rejoined.inc()
            elif event == "moved":
                self.rebalances.inc()

    def moved(self) -> None:
        self.moved_requests.inc()

    def worker_lost(self) -> None:
        self.lost.inc()

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of `/metrics`."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
