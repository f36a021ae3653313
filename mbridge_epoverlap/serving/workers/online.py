"""Online serving on an attention worker: requests that arrive while it decodes, and tokens sent back every step.

The front end (`serving.frontend`) binds ZeroMQ sockets on loopback (or the cluster interface) before the
workers start: one PUSH per attention worker, which carries `Submit`, `Abort` and `Shutdown` to it, and one
PULL, which gathers every attention worker's `Ready`, `Tokens`, `Stats` and, as it leaves, `Done`. A worker
only connects (it listens on nothing).

`OnlineSource` is what the attention side polls at each micro-batch's step boundary
(`AttentionSide.source`):

- at micro-batch 0's boundary it takes every message that arrived: new requests join the waiting queue (and
  so the next micro-batch with room, continuous batching as in the batch command), aborts mark their
  sequences finished (retired, their KV rows freed, at their own micro-batch's boundary), a shutdown ends
  serving. With nothing running and nothing waiting it first blocks on its socket until a message comes, for at
  most `idle_wait_s(timeout)` (`IDLE_STEP_S`, or a quarter of `--timeout` if that is less): an idle engine
  costs no CPU between those rare empty steps, a request wakes it at once, and the empty steps still prove
  every worker alive (a dead peer is found at the next one) and keep every wait between workers well inside
  its timeout. Every attention worker takes part in each step, so the front end tells them all when the engine
  turns busy (a request went to one of them) and idle again (`Busy`): an attention worker without requests
  does not block while another has some, its empty micro-batches paced by the other's steps.
- while it serves the worker counts as active, so the expert workers never answer stop; after `Shutdown`
  the worker is active only while it has requests, and the engine ends as the batch command does.
- after each micro-batch's new tokens (`AttentionSide.on_sampled`) it sends them, with each sequence's
  finish reason ("stop": end of sequence, "length": its token limit).
- a request the worker cannot serve ends alone, with `Failed` naming why: one it refuses as it arrives
  (`refusal`: token ids outside the vocabulary, a length past the context, sampling settings its generator
  does not take; the front end checks all of these first, this keeps one it let through from ending the
  worker), or one whose own sampling failed (`RunningSequence.error`). The worker and its other requests go on.

Messages are typed records; `encode` gives the JSON object sent (its `kind` names the record), `decode`
the record back.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from mbridge_epoverlap.memory import KV_CACHE, resident_bytes

# The longest an idle attention worker blocks on its socket at a step boundary before it runs an empty step.
# Polling every 50 ms instead (an empty step each time, every worker woken) cost an idle server of 1 attention and
# 1 expert worker 0.11-0.12 of a core (2-core AMD EPYC); one empty step every 2 s costs next to nothing, and still
# finds a dead peer within seconds.
IDLE_STEP_S = 2.0
STATS_EVERY_S = 0.25  # how often a busy worker reports its queue and expert load
KEEPALIVE_S = 1.0  # an idle worker reports at each empty step after this long: a front end hears it lives
STEP_LOG_KEPT = 4096  # decode steps of the attention side's step log an online worker keeps
STEP_TIMES_KEPT = 1024  # step times a report carries at most (reports go every STATS_EVERY_S while busy)


def idle_wait_s(timeout_s: float) -> float:
    """How long an idle attention worker blocks for a message: `IDLE_STEP_S`, or a quarter of the workers'
    `timeout_s` where that is less (the expert workers wait for the next step's dispatches up to `timeout_s`,
    the other attention workers at an elastic step boundary too, and a front end that did not start the workers
    names one lost after `timeout_s` without a report)."""
    return min(IDLE_STEP_S, timeout_s / 4)


@dataclass(frozen=True)
class Submit:
    """A new request for one attention worker; temperature 0 is greedy."""

    kind: ClassVar[str] = "submit"
    id: str
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    options: dict[str, Any] | None = None  # `decoding.options.DecodeOptions.to_wire`; None: none


@dataclass(frozen=True)
class Abort:
    """Stop a request (its client went away, or a stop string ended it); its KV rows are freed."""

    kind: ClassVar[str] = "abort"
    id: str


@dataclass(frozen=True)
class Shutdown:
    """Finish what runs, then leave (the engine ends once every attention worker is idle)."""

    kind: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class Busy:
    """Whether any attention worker has requests (the front end says so to every one as it changes): while busy,
    a worker without requests comes to each step at once instead of blocking on its socket for `idle_wait_s`,
    since every attention worker takes part in each step."""

    kind: ClassVar[str] = "busy"
    busy: bool


@dataclass(frozen=True)
class Cores:
    """The cores this attention worker may compute on from its next step (`StepCores.use`). Colocated processes
    that each hold every expert decode their own sequences alone: while some have no request, the front end lends
    their cores to those that have (a lone request decodes on every core, as in one process), and takes them
    back as requests reach the others."""

    kind: ClassVar[str] = "cores"
    cores: int


@dataclass(frozen=True)
class Failed:
    """A request this attention worker could not serve; it alone ends, `error` saying why."""

    kind: ClassVar[str] = "failed"
    worker: int
    id: str
    error: str


@dataclass(frozen=True)
class Ready:
    """An attention worker loaded its weights and polls for requests; `memory`: what every worker process of the
    engine held once all had loaded (`mbridge_epoverlap.memory`, one record per rank)."""

    kind: ClassVar[str] = "ready"
    worker: int
    pid: int
    memory: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Done:
    """An attention worker leaves: after `Shutdown` (`error` None), or because it failed (`error` says why, e.g.
    the expert worker it lost): a front end that did not start the workers learns their end from this."""

    kind: ClassVar[str] = "done"
    worker: int
    error: str | None = None


@dataclass(frozen=True)
class Tokens:
    """One micro-batch's new tokens: `(request id, token, finish reason or None, extra)` each, `extra` None or
    what the request asked to know of the token: `{"logprob": record}` and, with its first token,
    `{"prompt_logprobs": [None, record, ...]}` (`decoding.logprobs`)."""

    kind: ClassVar[str] = "tokens"
    worker: int
    items: list[tuple[str, int, str | None, dict[str, Any] | None]]


# The fields of an elastic event (`ElasticRouter.events`) that travel to the front end: what its counters need.
EVENT_FIELDS = ("event", "workers", "worker", "joined", "moved", "epoch", "step")


@dataclass(frozen=True)
class Stats:
    """An attention worker's queue, KV cache use, the (token, choice) pairs routed to each expert since its last
    report (`[MoE layers][experts]`, ascending layers), and the elastic events it saw since then (each a dict of
    `EVENT_FIELDS`)."""

    kind: ClassVar[str] = "stats"
    worker: int
    running: int
    waiting: int
    kv_tokens: int
    expert_load: list[list[int]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0  # engine steps this worker ran so far, empty ones included
    idle_steps: int = 0  # of those, the steps it ran with no request (what an idle server costs)
    # Each step that fed tokens since the last report: its seconds and the token rows it fed (prompt chunks
    # and decoding tokens), at most `STEP_TIMES_KEPT` of the latest.
    step_seconds: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    kv_bytes: int = 0  # the KV cache's resident bytes now (it grows with the sequences it holds)
    # Automatic prefix caching since the start: prompt tokens looked up, found, and the bytes its blocks hold now.
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_bytes: int = 0


MESSAGES: dict[str, type] = {m.kind: m for m in (Submit, Abort, Shutdown, Busy, Cores, Ready, Done, Tokens, Stats,
                                                 Failed)}


def encode(message: Any) -> dict[str, Any]:
    """The JSON object of a record: its fields as they are (`asdict`'s deep copy of every item cost a worker
    ~1 ms a step for one micro-batch's `Tokens`, on a step of ~45 ms)."""
    return {"kind": message.kind, **{f.name: getattr(message, f.name) for f in fields(message)}}


def decode(payload: dict[str, Any]) -> Any:
    """The record of a received JSON object.

    Raises:
        ValueError: an unknown kind.
    """
    fields = dict(payload)
    kind = fields.pop("kind", None)
    if kind not in MESSAGES:
        raise ValueError(f"unknown online message kind {kind!r}")
    if kind == Tokens.kind:
        fields["items"] = [tuple(item) for item in fields["items"]]
    return MESSAGES[kind](**fields)


class OnlineSource:
    """The attention worker's end of the front end's sockets (see the module docstring).

    Args:
        worker: this attention worker's index.
        requests_addr: the front end's PUSH endpoint for this worker (`tcp://127.0.0.1:PORT`).
        events_addr: the front end's PULL endpoint.
        side: the attention side it feeds (`AttentionSide`); the source attaches itself to it.
        prefill_budget: the prompt tokens one micro-batch boundary may feed, a longer prompt in chunks
            (`RequestQueue.prefill_budget`).
        max_model_len: the longest sequence a request may reach (0: the model's context).
        prefix_cache_bytes: automatic prefix caching within this many bytes (`model.prefix_cache`); 0: off.
        events: the transport's event list (elastic mode), forwarded by name; None: none.
    """

    def __init__(self, worker: int, requests_addr: str, events_addr: str, side: Any, *, prefill_budget: int,
                 max_model_len: int = 0, events: list[dict[str, Any]] | None = None,
                 prefix_cache_bytes: int = 0) -> None:
        import zmq

        self.worker, self.side, self.queue = worker, side, side.queue
        if not max_model_len:
            from mbridge_epoverlap.serving.model.checkpoint import context_length

            max_model_len = context_length(side.spec)
        self.max_model_len = max_model_len
        self.context = zmq.Context()
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.connect(requests_addr)
        self.outbox = self.context.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 2000)  # the last tokens still leave when the worker exits
        self.outbox.connect(events_addr)
        self.serving = True
        self.error: str | None = None  # why this worker fails, when it does (sent with `Done`)
        self.aborts: set[str] = set()
        self.events = events
        self._events_sent = 0
        self._ready = False
        self.memory: list[dict[str, Any]] = []  # every worker's holdings once all loaded (set by the worker's main)
        self.idle_wait_s = idle_wait_s(side.timeout_s)
        self.idle_steps = 0
        self.engine_busy = False  # another attention worker has requests (`Busy`)
        self._steps_unsent: list[tuple[float, int]] = []  # (seconds, rows fed) of the steps since the last report
        self._last_stats: tuple[int, int, int] | None = None
        self._stats_at = 0.0
        self.queue.prefill_budget = prefill_budget
        if prefix_cache_bytes:
            from mbridge_epoverlap.serving.model.prefix_cache import PrefixCache

            side.prefix_cache = PrefixCache(prefix_cache_bytes)
            self.queue.hold = side.waits_for_prefix
            self.queue.cached_tokens = side.cached_prefix_tokens
        side.source = self
        self._load_sent = side.expert_load.clone()  # the side counts from the start; the front end gets the rest
        side.on_sampled.append(self.sampled)
        side.on_step = self.stepped

    def at_boundary(self, side: Any, seqs: Sequence[Any], *, first: bool) -> None:
        """A micro-batch's step boundary: take the messages (at micro-batch 0's), end the aborted of `seqs`."""
        if first:
            if not self._ready:
                self._send(Ready(self.worker, os.getpid(), self.memory))
                self._ready = True
            idle = self.serving and not self.queue.waiting and not self.queue.running
            self._take(self._receive(self.idle_wait_s if idle and not self.engine_busy else 0.0))
            if self.serving and not self.queue.waiting and not self.queue.running:
                self.idle_steps += 1  # this worker's part of the step runs empty
            self.queue.done.clear()  # their tokens went out as they came; nobody reads them later
            if len(side.step_log) > 2 * STEP_LOG_KEPT:  # a server runs for days: keep the recent steps
                del side.step_log[:-STEP_LOG_KEPT]
            self._report()
        if self.aborts:
            for seq in seqs:
                if seq.request.id in self.aborts:
                    seq.finished = seq.aborted = True
                    self.aborts.discard(seq.request.id)

    def stepped(self, seconds: float, rows: int) -> None:
        """A step that fed tokens ended: kept for the next report (`Stats.step_seconds`)."""
        self._steps_unsent.append((seconds, rows))
        if len(self._steps_unsent) > 2 * STEP_TIMES_KEPT:
            del self._steps_unsent[:-STEP_TIMES_KEPT]

    def sampled(self, h: Any) -> None:
        """Send a micro-batch's new tokens (a sequence whose sampling failed: its failure instead)."""
        items = [(s.request.id, s.output_ids[-1], self.queue.stop_reason(s), _extra(s)) for s in h.sampling
                 if not s.aborted and s.error is None]
        if items:
            self._send(Tokens(self.worker, items))
        for seq in h.seqs:
            if seq.error is not None and not seq.aborted:
                self._send(Failed(self.worker, seq.request.id, seq.error))

    def close(self) -> None:
        """After the last step: say so (a front end that did not start the workers learns their end) and close."""
        self._send(Done(self.worker, self.error))
        self.inbox.close(linger=0)
        self.outbox.close()
        self.context.term()

    def _receive(self, wait_s: float) -> list[Any]:
        import zmq

        messages = []
        if wait_s > 0 and not self.inbox.poll(int(wait_s * 1000)):
            return messages
        while True:
            try:
                messages.append(decode(self.inbox.recv_json(zmq.NOBLOCK)))
            except zmq.Again:
                return messages

    def _take(self, messages: list[Any]) -> None:
        from mbridge_epoverlap.serving.decoding.options import DecodeOptions
        from mbridge_epoverlap.serving.decoding.sampling import SamplingParams
        from mbridge_epoverlap.serving.workers.requests import Request

        for message in messages:
            if isinstance(message, Submit):
                refused = self.refusal(message)
                if refused is not None:
                    self._send(Failed(self.worker, message.id, refused))
                    continue
                sampling = (SamplingParams(message.temperature, message.top_p, message.top_k, message.seed)
                            if message.temperature > 0 else None)
                options = DecodeOptions.from_wire(message.options) if message.options else None
                self.queue.waiting.append(Request(message.id, tuple(message.prompt_ids), message.max_tokens,
                                                  message.ignore_eos, sampling, options))
            elif isinstance(message, Abort):
                waiting = [r for r in self.queue.waiting if r.id == message.id]
                if waiting:
                    self.queue.waiting.remove(waiting[0])
                elif any(s.request.id == message.id for s in self.queue.running):
                    self.aborts.add(message.id)
            elif isinstance(message, Shutdown):
                self.serving = False
            elif isinstance(message, Busy):
                self.engine_busy = message.busy
            elif isinstance(message, Cores) and self.side.cores is not None:
                self.side.cores.use(message.cores)

    def refusal(self, message: Submit) -> str | None:
        """Why this worker cannot serve `message`, or None: what would otherwise fail inside a step and take the
        worker, and every request it holds, with it."""
        from mbridge_epoverlap.serving.decoding.sampling import SamplingParams

        vocab = self.side.spec.vocab_size
        ids = message.prompt_ids
        if not ids or not all(_is_int(t) and 0 <= t < vocab for t in ids):
            return f"its prompt is not a non-empty list of token ids in 0..{vocab - 1}"
        if not _is_int(message.max_tokens) or message.max_tokens < 1:
            return f"max_tokens {message.max_tokens!r} is not a positive integer"
        if len(ids) + message.max_tokens > self.max_model_len:
            return (f"{len(ids)} prompt tokens and max_tokens {message.max_tokens} pass the context of "
                    f"{self.max_model_len} tokens")
        if message.temperature > 0:
            numbers = (message.temperature, message.top_p)
            if not all(isinstance(v, int | float) and math.isfinite(v) for v in numbers) or not 0 < message.top_p <= 1:
                return f"temperature {message.temperature!r} and top_p {message.top_p!r} are not finite and in range"
            if not _is_int(message.top_k) or message.top_k < 0:
                return f"top_k {message.top_k!r} is not an integer of at least 0"
            try:  # the request's own generator, as its first sampled token makes it
                SamplingParams(message.temperature, message.top_p, message.top_k, message.seed).generator()
            except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
                return f"its seed {message.seed!r} does not seed the generator ({exc})"
        if message.options:
            return self._options_refusal(message.options, vocab)
        return None

    def _options_refusal(self, wire: dict[str, Any], vocab: int) -> str | None:
        from mbridge_epoverlap.serving.decoding.grammar import GrammarError
        from mbridge_epoverlap.serving.decoding.options import DecodeOptions

        try:
            options = DecodeOptions.from_wire(wire)
        except (TypeError, ValueError) as exc:
            return f"its decoding options {wire!r} are not this version's ({exc})"
        ids = [t for t, _ in options.logit_bias] + list(options.stop_token_ids)
        if not all(0 <= t < vocab for t in ids):
            return f"its logit_bias or stop_token_ids hold token ids outside the vocabulary 0..{vocab - 1}"
        numbers = (options.presence_penalty, options.frequency_penalty, options.repetition_penalty,
                   *(b for _, b in options.logit_bias))
        if not all(math.isfinite(v) for v in numbers) or options.repetition_penalty <= 0:
            return "its penalties or logit biases are not finite (or its repetition_penalty is not above 0)"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(options, name)
            if k is not None and not (_is_int(k) and 0 <= k <= vocab):
                return f"its {name} {k!r} is not an integer in 0..{vocab}"
        if options.grammar is not None:
            try:
                self.side.grammars().check(*options.grammar)
            except (GrammarError, ValueError, OSError) as exc:
                return f"its grammar cannot be made: {exc}"
        return None

    def _report(self) -> None:
        """Send `Stats` when the queue changed (requests running or waiting), every `STATS_EVERY_S` while
        decoding (the KV cache grows every step: reported at that pace, not at every step), with new events,
        and at any boundary `KEEPALIVE_S` after the last report (so an idle worker reports at each empty step)."""
        queue, side = self.queue, self.side
        now = time.monotonic()
        counts = (len(queue.running), len(queue.waiting), sum(s.length for s in queue.running))
        load = side.expert_load - self._load_sent
        new_events = self.events[self._events_sent:] if self.events is not None else []
        queue_changed = self._last_stats is None or counts[:2] != self._last_stats[:2]
        busy = (bool(load.any()) or counts != self._last_stats) and now - self._stats_at >= STATS_EVERY_S
        quiet = now - self._stats_at >= KEEPALIVE_S
        if not queue_changed and not busy and not new_events and not quiet:
            return
        steps = self._steps_unsent[-STEP_TIMES_KEPT:]
        self._send(Stats(self.worker, *counts, expert_load=load.tolist(),
                         events=[{k: e[k] for k in EVENT_FIELDS if k in e} for e in new_events],
                         steps=side.decode_steps, idle_steps=self.idle_steps,
                         step_seconds=[round(s, 6) for s, _ in steps], step_tokens=[r for _, r in steps],
                         kv_bytes=resident_bytes(side.cache)[KV_CACHE], **self._prefix_counts()))
        self._steps_unsent = []
        self._load_sent += load
        self._events_sent += len(new_events)
        self._last_stats, self._stats_at = counts, now

    def _prefix_counts(self) -> dict[str, int]:
        cache = self.side.prefix_cache
        if cache is None:
            return {}
        return {"prefix_query_tokens": cache.query_tokens, "prefix_hit_tokens": cache.hit_tokens,
                "prefix_bytes": cache.bytes}

    def _send(self, message: Any) -> None:
        self.outbox.send_json(encode(message))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _extra(seq: Any) -> dict[str, Any] | None:
    """What a sequence's request asked to know of its newest token (see `Tokens`), or None."""
    extra: dict[str, Any] = {}
    if seq.logprob is not None:
        extra["logprob"] = seq.logprob
    if seq.prompt_logprobs is not None:  # its prompt is all scored once it has a token: sent once, then dropped
        extra["prompt_logprobs"], seq.prompt_logprobs = seq.prompt_logprobs, None
    return extra or None
