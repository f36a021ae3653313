"""`EngineClient`: the front end's side of the online engine, requests out to the attention workers, tokens back.

It binds the ZeroMQ sockets (loopback only, before any worker starts; `serving.workers.online` is the
workers' side), starts the engine (`serving.engine.run.run_engine`) on a thread, and follows every request:

- `submit` sends a request to the least-loaded attention worker (fewest requests outstanding), or refuses it
  (`Unavailable`, a 503) while the engine is not serving or when it would wait behind more than
  `max_waiting` others;
- colocated processes that each hold every expert (`--replicate-experts`) are engines of their own: one without
  requests blocks on its socket, and its cores are lent to those with requests (`online.Cores`) until a request
  comes to it;
- a task on the event loop reads the workers' messages and puts each request's tokens on its
  `RequestStream`; the workers' `Stats` feed the gauges;
- `abort` tells the worker to drop a request (its KV rows are freed at its next step boundary);
- `drain` stops taking requests, lets the running ones finish for up to a time limit, fails the rest,
  and tells the workers to leave; the engine thread then returns;
- when the engine fails (a worker died, without elastic mode), every request in flight ends with the
  engine's reason, which names the worker;
- when a worker cannot serve one request (`online.Failed`), that request alone ends, naming the worker and
  why; the worker and every other request go on;
- a drain that saw every request finish is a clean stop, whatever the server survived before it (a worker
  lost in elastic mode, a worker that did not leave cleanly after the drain): that is logged as a warning
  and counted in the metrics, and `on_end` gets None (exit 0). The engine failed only when requests were lost
  to it;
- in elastic mode, when an attention worker dies, its requests move to the survivors (`_move_off`); any of
  them when this process holds the workers' rendezvous (`EnginePlan.store_hosted`), else one after the
  first: each is sent again as its prompt and the tokens generated so far, and its stream goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from mbridge_epoverlap.launch.signals import pid_alive
from mbridge_epoverlap.memory import KV_CACHE, process_memory, total
from mbridge_epoverlap.serving.decoding.options import DecodeOptions
from mbridge_epoverlap.serving.workers import online

log = logging.getLogger(__name__)

STARTING, READY, DRAINING, STOPPED, FAILED = "starting", "ready", "draining", "stopped", "failed"
# What a job script sends a front end whose workers it started elsewhere once their step has ended
# (`serve --workers-plan`; `harness.executors.slurm_serve`).
WORKERS_ENDED_SIGNAL = signal.SIGUSR1


class Unavailable(Exception):
    """The engine cannot take this request now (starting, draining, failed, or too many waiting)."""


@dataclass(frozen=True)
class Failure:
    """What a request's stream gets when the engine fails under it."""

    reason: str


@dataclass
class RequestStream:
    """One engine request as the front end follows it: its tokens arrive on `queue` as (token, finish reason or
    None, extra: what the request asked to know of the token, `online.Tokens`), or a `Failure`."""

    id: str
    worker: int
    prompt_tokens: int
    submit: online.Submit | None = None  # what was sent (sent again, extended, if its worker dies)
    generated: list[int] = field(default_factory=list)
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    done: bool = False

    @property
    def tokens(self) -> int:
        return len(self.generated)


class EngineClient:
    """The online engine seen from the front end (see the module docstring).

    Args:
        make_plan: (request endpoints, one per attention worker; events endpoint) -> the `EnginePlan` to run.
        attn_workers: attention workers the plan has.
        max_batch: sequences one attention worker decodes at once (more wait).
        max_waiting: most requests waiting over all workers; one more is refused.
        metrics: the server's metrics (`frontend.metrics.ServerMetrics`).
        on_end: called (on the loop) once the engine ended, with the failure reason or None.
        host: the address the sockets bind: loopback, or the cluster interface when the workers run on other
            nodes (never the HTTP address).
        external: the workers are started by someone else (srun, from the plan file `serve --workers-plan`
            writes); the engine has ended once every attention worker said it is done.
        link: with emulated hosts, the `launch.netns.EmulatedLink` the workers start in (`host` is then its
            gateway address, where the namespaces reach this process).
    """

    def __init__(self, make_plan: Callable[[list[str], str], Any], *, attn_workers: int, max_batch: int,
                 max_waiting: int, metrics: Any, on_end: Callable[[str | None], None] | None = None,
                 host: str = "127.0.0.1", external: bool = False, link: Any = None) -> None:
        import zmq
        import zmq.asyncio

        self.attn_workers, self.max_batch, self.max_waiting = attn_workers, max_batch, max_waiting
        self.metrics, self.on_end = metrics, on_end
        self._context = zmq.Context()
        self._async_context = zmq.asyncio.Context()
        self._outboxes = []
        for _ in range(attn_workers):
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"tcp://{host}:*")
            self._outboxes.append(sock)
        self._inbox = self._async_context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.bind(f"tcp://{host}:*")
        endpoints = [s.getsockopt(zmq.LAST_ENDPOINT).decode() for s in self._outboxes]
        plan = make_plan(endpoints, self._inbox.getsockopt(zmq.LAST_ENDPOINT).decode())
        # Workers started here: this process holds their rendezvous where that lets any of them be lost.
        self.plan = replace(plan, store_hosted=True) if plan.hostable_store and not external else plan
        self.state, self.reason = STARTING, "the workers are starting"
        self.streams: dict[str, RequestStream] = {}
        self.outstanding = [0] * attn_workers
        self.ready_workers: set[int] = set()
        self.pids: list[int] = []
        self.stats: dict[int, online.Stats] = {}
        self.lost_seen: set[int] = set()
        self.lost_attention: set[int] = set()  # attention workers whose requests moved to the others
        self.on_ready: list[Callable[[], None]] = []
        self.external, self.link = external, link
        self._shutdown_sent = False
        self._busy = False  # what the attention workers were last told (`_tell_busy`)
        # Colocated processes that each hold every expert step alone (no exchange between them): one without
        # requests blocks on its socket whatever the others do, and its cores go to those with requests.
        self._independent = self.plan.replicated_experts and attn_workers > 1
        self._own_cores = max(1, self.plan.threads)
        self._cores = [self._own_cores] * attn_workers  # what each attention worker was last told (`_lend_cores`)
        self._drained_every_request = False  # the drain saw every request end before the workers left
        self.ready_pids: dict[int, int] = {}  # attention worker -> its pid (what an external engine tells)
        self.memory: list[dict[str, Any]] = []  # what each worker process held once all had loaded (`Ready`)
        self.done_workers: set[int] = set()
        self.last_heard: dict[int, float] = {}  # attention worker -> when its last message came
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ended = asyncio.Event()
        self._next_id = 0

    # --- the engine's life ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread and the reader task (on the running loop)."""
        self._loop = asyncio.get_running_loop()
        self._ended = asyncio.Event()
        self._reader = asyncio.create_task(self._read())
        self._watcher = asyncio.create_task(self._watch()) if self.plan.elastic and self.attn_workers > 1 else None
        if self.external:
            self._watcher = asyncio.create_task(self._watch_silence())
            # The job script signals the end of the workers' srun step (`harness.executors.slurm_serve`): a
            # step that srun stopped before a worker's last word left is known at once, not after --timeout.
            with contextlib.suppress(NotImplementedError, RuntimeError):  # no signals off the main thread
                self._loop.add_signal_handler(WORKERS_ENDED_SIGNAL, self.workers_ended)
        if self.external:  # srun started the workers: they report their own end (`online.Done`)
            return
        self._thread = threading.Thread(target=self._run_engine, name="engine", daemon=True)
        self._thread.start()

    def _run_engine(self) -> None:
        from mbridge_epoverlap.serving.engine.run import EngineFailed, run_engine

        reason: str | None = None
        try:
            run_engine(self.plan, on_start=self.pids.extend, run_timeout_s=float("inf"), link=self.link)
        except EngineFailed as exc:
            reason = str(exc).splitlines()[0] if str(exc) else "the engine failed"
        except Exception as exc:  # a bug or a start-up error: the server must still answer and exit
            reason = f"the engine failed: {type(exc).__name__}: {exc}"
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed already
                self._loop.call_soon_threadsafe(self._engine_ended, reason)

    def workers_ended(self) -> None:
        """The external workers' step ended (`WORKERS_ENDED_SIGNAL`): after a shutdown this engine sent, the end it
        asked for; else the workers are lost, and the engine with them."""
        if self._shutdown_sent or self._ended.is_set():
            return
        self._engine_ended("every attention worker left unasked (the workers' srun step ended: a worker was lost)"
                           if self.state != STARTING
                           else "the workers' srun step ended before every attention worker was ready")

    def _engine_ended(self, reason: str | None) -> None:
        if self._ended.is_set():  # said already (a worker's own word, then its launcher's)
            return
        if reason is not None and self._drained_every_request:
            # The drain saw every request end: nothing was lost to this, whatever the workers did after it.
            log.warning("after the drain: %s", reason)
            reason = None
        if reason is None and self.streams:  # the workers left before these finished: not a clean stop
            reason = f"the workers left with {len(self.streams)} requests in flight"
        if reason is not None:
            self.state, self.reason = FAILED, reason
            for stream in list(self.streams.values()):
                self._finish(stream, "failed")
                stream.queue.put_nowait(Failure(reason))
        elif self.state != FAILED:
            self.state, self.reason = STOPPED, "the engine stopped"
        self._ended.set()
        if self.on_end is not None:
            self.on_end(reason)

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests, let the running ones finish within `timeout_s`, then end the engine."""
        if self.state in (READY, STARTING):
            self.state, self.reason = DRAINING, "the server is shutting down"
        deadline = time.monotonic() + timeout_s
        while self.streams and time.monotonic() < deadline and not self._ended.is_set():
            await asyncio.sleep(0.05)
        self._drained_every_request = not self.streams and not self._ended.is_set()
        for stream in list(self.streams.values()):
            self.abort(stream, outcome="failed")
            stream.queue.put_nowait(Failure("the server shut down before the request finished"))
        for index in range(self.attn_workers):
            self._send(index, online.Shutdown())
        self._shutdown_sent = True
        await self.wait_ended(timeout_s=10.0 if self.external else max(10.0, self.plan.timeout_s))

    async def wait_ended(self, *, timeout_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ended.wait(), timeout_s)

    def stop_workers(self, join_s: float = 30.0) -> None:
        """End the worker processes if the engine still runs (the launcher then cleans up), and wait for it."""
        if self._thread is None or not self._thread.is_alive():
            return
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        self._thread.join(join_s)

    def cannot_serve(self) -> str | None:
        """Why the engine cannot serve although it runs: without elastic mode, a dead worker ends it."""
        if self.plan.elastic:
            return None
        dead = [w for w in self.workers() if not w["alive"]]
        if dead:
            w = dead[0]
            return f"{w['role']} worker {w['index']} (rank {w['rank']}, pid {w['pid']}) died; the engine is stopping"
        return None

    def close(self) -> None:
        for task in (self._reader, getattr(self, "_watcher", None)):
            if task is not None:
                task.cancel()
        for sock in self._outboxes:
            sock.close(linger=0)
        self._inbox.close(linger=0)
        self._context.term()
        self._async_context.term()

    # --- requests -----------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], *, max_tokens: int, ignore_eos: bool, temperature: float, top_p: float,
               top_k: int, seed: int | None, options: DecodeOptions | None = None) -> RequestStream:
        """Send a request to the least-loaded attention worker (`options`: its decoding options beyond the
        sampling settings, `serving.decoding.options.DecodeOptions`).

        Raises:
            Unavailable: the engine is not serving, or the request would wait behind `max_waiting` others.
        """
        if self.state != READY:
            raise Unavailable(self.reason)
        reason = self.cannot_serve()
        if reason is not None:
            raise Unavailable(reason)
        worker = min(self._live_workers(), key=lambda w: self.outstanding[w])
        waiting = sum(max(0, n - self.max_batch) for n in self.outstanding)
        if self.outstanding[worker] >= self.max_batch and waiting >= self.max_waiting:
            raise Unavailable(f"too many requests waiting ({waiting}, --max-waiting {self.max_waiting}); "
                              "retry later")
        self._next_id += 1
        submit = online.Submit(f"r{self._next_id}", list(prompt_ids), max_tokens, ignore_eos, temperature, top_p,
                               top_k, seed, options.to_wire() if options is not None else None)
        stream = RequestStream(submit.id, worker, len(prompt_ids), submit)
        self.streams[stream.id] = stream
        self.outstanding[worker] += 1
        self._send(worker, submit)
        self._tell_busy()
        return stream

    def _tell_busy(self) -> None:
        """Tell every attention worker when the engine turns busy (a request outstanding) or idle again
        (`online.Busy`): each takes part in every step, and one without requests blocks on its socket (up to
        `online.idle_wait_s`) only while no worker has any."""
        if self._independent:
            self._lend_cores()
            return
        busy = any(self.outstanding[w] for w in self._live_workers())
        if busy == self._busy or self.attn_workers == 1:  # one worker: its own requests wake it
            return
        self._busy = busy
        for worker in self._live_workers():
            self._send(worker, online.Busy(busy))

    def _lend_cores(self) -> None:
        """Independent processes: share every live process's cores among those with requests (`online.Cores`),
        so that a lone request decodes on all of them; one without requests keeps its own. Told on change only,
        and read at each worker's next step boundary."""
        live = self._live_workers()
        busy = [w for w in live if self.outstanding[w]]
        total = self._own_cores * len(live)
        for worker in live:
            share = self._own_cores
            if worker in busy:
                share = total // len(busy) + (busy.index(worker) < total % len(busy))
            if share != self._cores[worker]:
                self._cores[worker] = share
                self._send(worker, online.Cores(share))

    def _live_workers(self) -> list[int]:
        return [w for w in range(self.attn_workers) if w not in self.lost_attention]

    def _move_off(self, worker: int) -> None:
        """Attention worker `worker` died (elastic mode): each of its requests goes to the least-loaded survivor
        as its prompt and the tokens generated so far, for the tokens still to come; its client's stream goes
        on from there."""
        self.lost_attention.add(worker)
        self.outstanding[worker] = 0
        moved = 0
        for stream in list(self.streams.values()):
            if stream.worker != worker or stream.done or stream.submit is None:
                continue
            target = min(self._live_workers(), key=lambda w: self.outstanding[w])
            moved += 1
            first = stream.submit
            options = DecodeOptions.from_wire(first.options).resumed(stream.tokens)
            resumed = online.Submit(first.id, first.prompt_ids + stream.generated, first.max_tokens - stream.tokens,
                                    first.ignore_eos, first.temperature, first.top_p, first.top_k, first.seed,
                                    options.to_wire())
            stream.worker = target
            self.outstanding[target] += 1
            self._send(target, resumed)
            self.metrics.moved()
        self._tell_busy()
        log.warning("attention worker %d (pid %d) was lost: its %d requests in flight go on from attention workers "
                    "%s", worker, self.pids[worker], moved, self._live_workers())

    async def _watch(self) -> None:
        """Elastic mode with several attention workers: move the requests of one that died."""
        while True:
            await asyncio.sleep(0.1)
            if self.state not in (READY, DRAINING) or len(self.pids) < self.attn_workers:
                continue
            if self._shutdown_sent:  # the workers leave as asked: the engine thread tells how they ended
                return
            # Without a hosted store the first worker holds the rendezvous: its loss ends the engine.
            watched = self._live_workers() if self.plan.store_hosted else self._live_workers()[1:]
            for worker in watched:
                if not pid_alive(self.pids[worker]):
                    if len(self._live_workers()) == 1:
                        self._engine_ended(f"every attention worker was lost (the last, {worker}, pid "
                                           f"{self.pids[worker]})")
                        return
                    self._move_off(worker)

    async def _watch_silence(self) -> None:
        """Workers started elsewhere (their processes not seen from here): one that sent nothing for the plan's
        timeout is lost, and the engine with it (an idle worker still reports at each empty step, every
        `online.idle_wait_s(timeout)` at most, so
        silence is a loss even without requests: srun may stop the step before a worker's last word leaves)."""
        while not self._ended.is_set():
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for worker in range(self.attn_workers):
                quiet = now - self.last_heard.get(worker, now)
                if quiet > self.plan.timeout_s and self.state in (READY, DRAINING) and worker not in self.done_workers:
                    busy = (f"with {self.outstanding[worker]} requests in flight" if self.outstanding[worker]
                            else "while idle")
                    self._engine_ended(f"attention worker {worker} sent nothing for {quiet:.0f} s {busy} (--timeout "
                                       f"{self.plan.timeout_s:g}): it left unasked, the workers are lost")
                    return

    def abort(self, stream: RequestStream, *, outcome: str = "aborted") -> None:
        """Drop a request the client no longer wants (or a stop string ended); nothing if it already ended."""
        if stream.done:
            return
        self._finish(stream, outcome)
        self._send(stream.worker, online.Abort(stream.id))

    def _finish(self, stream: RequestStream, outcome: str) -> None:
        stream.done = True
        self.streams.pop(stream.id, None)
        self.outstanding[stream.worker] -= 1
        self.metrics.finished(outcome, stream)
        self._tell_busy()

    def _send(self, worker: int, message: Any) -> None:
        import zmq

        with contextlib.suppress(zmq.ZMQError):  # a worker that is gone takes nothing (the engine says why)
            self._outboxes[worker].send_json(online.encode(message), zmq.NOBLOCK)

    # --- the workers' messages ----------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            message = online.decode(await self._inbox.recv_json())
            self.last_heard[message.worker] = time.monotonic()
            if isinstance(message, online.Tokens):
                self._tokens(message)
            elif isinstance(message, online.Failed):
                self._failed(message)
            elif isinstance(message, online.Stats):
                self.stats[message.worker] = message
                self.metrics.worker_stats(message, self.stats.values())
            elif isinstance(message, online.Done):
                self.done_workers.add(message.worker)
                if message.error is not None and self.external:  # srun's workers: their word is all there is
                    self._engine_ended(f"attention worker {message.worker} failed: {message.error}")
                elif self.external and len(self.done_workers) == self.attn_workers:
                    # Unasked (no drain sent `Shutdown`), the workers left because their srun step ended.
                    self._engine_ended(None if self._shutdown_sent else "every attention worker left unasked (the "
                                       "workers' srun step ended: a worker was lost)")
            elif isinstance(message, online.Ready):
                self.ready_workers.add(message.worker)
                self.ready_pids[message.worker] = message.pid
                if message.memory and not self.memory:
                    self.memory = message.memory
                if len(self.ready_workers) == self.attn_workers and self.state == STARTING:
                    self.state, self.reason = READY, ""
                    for callback in self.on_ready:
                        callback()

    def _failed(self, message: online.Failed) -> None:
        """A worker could not serve one request: that request ends with the worker's reason."""
        stream = self.streams.get(message.id)
        if stream is None:  # aborted meanwhile
            return
        log.warning("attention worker %d could not serve engine request %s: %s", message.worker, message.id,
                    message.error)
        self._finish(stream, "failed")
        stream.queue.put_nowait(Failure(f"attention worker {message.worker} could not serve it: {message.error}"))

    def _tokens(self, message: online.Tokens) -> None:
        now = time.monotonic()
        for rid, token, finish, extra in message.items:
            stream = self.streams.get(rid)
            if stream is None:  # aborted meanwhile
                continue
            if stream.first_token_at is None:
                stream.first_token_at = now
            stream.generated.append(token)
            if finish is not None:
                self._finish(stream, "finished")
            stream.queue.put_nowait((token, finish, extra))

    # --- health ---------------------------------------------------------------------------------------
    def memory_now(self) -> dict[str, Any] | None:
        """What the worker processes hold (`memory.total`): the weights as each reported them once all had loaded,
        the KV caches as the attention workers last reported them, the resident sets of the workers started here
        read now (None before the workers are ready)."""
        if not self.memory:
            return None
        records = []
        for record in self.memory:
            now = dict(record)
            rank = now["rank"]
            if not self.external and rank < len(self.pids):
                now.update(process_memory(self.pids[rank]))  # nothing where it is gone: its last word stands
            role, index = self.plan.role_of(rank)
            if role is None or role.value == "attention":
                stats = self.stats.get(index)
                if stats is not None:
                    now[KV_CACHE] = stats.kv_bytes + stats.prefix_bytes  # its prefix cache's blocks too
            records.append(now)
        return total(records)

    def workers(self) -> list[dict[str, Any]]:
        """Every worker process: role, rank, pid, alive (replacements after the first `world` pids)."""
        if self.external:  # on other nodes: what they said (expert workers are not seen from here)
            return [{"role": "attention", "index": w, "rank": w, "pid": pid, "alive": w not in self.done_workers}
                    for w, pid in sorted(self.ready_pids.items())]
        out = []
        for rank, pid in enumerate(self.pids[:self.plan.world]):
            role, index = self.plan.role_of(rank)
            alive = pid_alive(pid)
            name = "colocated" if role is None else role.value
            if not alive and rank not in self.lost_seen and self.state in (READY, DRAINING):
                self.lost_seen.add(rank)
                self.metrics.worker_lost(name, index)
            out.append({"role": name, "index": index, "rank": rank, "pid": pid, "alive": alive})
        return out


