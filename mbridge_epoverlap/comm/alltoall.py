"""All-to-all with uneven splits: an asynchronous issue/wait pair, a synchronous count exchange, and an
autograd function whose backward is the inverse all-to-all.

On CPU (gloo) a rank's collectives run on one background communication thread, in issue order, while
the caller computes; `wait` blocks with a timeout. The thread lets a dispatch exchange its token counts
and then move its tokens without stopping the caller for the count round trip. On CUDA (NCCL) the
collective is issued on a side stream that first waits for the compute stream (an event), and `wait`
makes the compute stream wait for the side stream (another event): the host never blocks, and compute
kernels queued in between overlap with the transfer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mbridge_epoverlap.comm.errors import CommError


@dataclass
class CommContext:
    """How this rank runs collectives.

    Attributes:
        timeout_s: the longest a wait may block before the peer is declared lost.
        stream: the CUDA side stream for communication, or None on CPU.
        thread: the CPU communication thread (collectives run there in issue order), or None to issue
            them from the caller (gloo still runs them on its own worker threads).
        thread_native_id: the kernel thread id of `thread`.
    """

    timeout_s: float = 60.0
    stream: Any = None
    thread: ThreadPoolExecutor | None = None
    thread_native_id: int | None = None

    @classmethod
    def for_device(cls, device: torch.device, timeout_s: float, *, comm_thread: bool = True) -> CommContext:
        """A side stream on CUDA; on CPU a started communication thread (unless `comm_thread` is False)."""
        if device.type == "cuda":
            return cls(timeout_s=timeout_s, stream=torch.cuda.Stream(device=device))
        if not comm_thread:
            return cls(timeout_s=timeout_s)
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ep-comm")
        # Start it now and learn its kernel thread id, so its priority can be raised with gloo's threads.
        native_id = thread.submit(threading.get_native_id).result()
        return cls(timeout_s=timeout_s, thread=thread, thread_native_id=native_id)

    def submit(self, job: Callable[[], torch.Tensor]) -> Future[torch.Tensor]:
        """Run `job` on the communication thread (after everything submitted before it).

        The future carries `span`: [start, end] of the job on the thread (`time.perf_counter`), filled in as
        it runs, so callers can time each collective apart from the wait for it.
        """
        if self.thread is None:
            raise RuntimeError("this context has no communication thread")
        span: list[float] = []

        def timed() -> torch.Tensor:
            span.append(time.perf_counter())
            try:
                return job()
            finally:
                span.append(time.perf_counter())

        future = self.thread.submit(timed)
        future.span = span  # type: ignore[attr-defined]
        return future

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)


def group_size(group: Any) -> int:
    """Ranks in `group` (1 for None: no process group, EP = 1)."""
    return dist.get_world_size(group) if group is not None else 1


class PendingAllToAll:
    """An issued all-to-all; `wait()` returns the received tensor."""

    def __init__(self, output: torch.Tensor | None = None, *, work: Any = None, done: Any = None,
                 future: Future[torch.Tensor] | None = None, ctx: CommContext | None = None,
                 what: str = "all_to_all") -> None:
        self._output = output
        self._work = work
        self._done = done
        self._future = future
        self._span_source = future
        self._ctx = ctx or CommContext()
        self._what = what

    def span(self) -> tuple[float, float] | None:
        """[start, end] (`time.perf_counter`) of the collective on the communication thread once it finished;
        None without a communication thread (GPU streams, gloo issued from the caller, one rank)."""
        span = getattr(self._span_source, "span", None)
        return (span[0], span[1]) if span is not None and len(span) == 2 else None

    def wait(self) -> torch.Tensor:
        """Block (CPU) or make the compute stream wait (CUDA) until the data arrived."""
        if self._future is not None:
            try:
                # The job enforces the timeout on the collective itself; this bound covers the queue.
                self._output = self._future.result(timeout=2 * self._ctx.timeout_s + 5.0)
            except FutureTimeout:
                raise CommError(f"{self._what} did not complete within {2 * self._ctx.timeout_s + 5.0:g} s") \
                    from None
            self._future = None
        elif self._done is not None:
            compute = torch.cuda.current_stream(self._output.device)
            compute.wait_event(self._done)
            # The buffer was written on the side stream: tell the allocator the compute stream uses it now.
            self._output.record_stream(compute)
        elif self._work is not None:
            try:
                self._work.wait(timeout=self._ctx.timeout)
            except Exception as exc:
                raise CommError(f"{self._what} did not complete within {self._ctx.timeout_s:g} s: {exc}") from exc
        self._work = self._done = None
        if self._output is None:
            raise RuntimeError(f"{self._what}: no output")
        return self._output


def all_to_all_async(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Any,
                     ctx: CommContext, *, what: str = "all_to_all") -> PendingAllToAll:
    """Start sending `send_splits[r]` rows of `x` to rank r of `group`; receive `recv_splits[r]` rows from each.

    Args:
        x: rows to send, grouped by destination rank in rank order (contiguous).
        send_splits: rows for each destination rank; sums to `x.shape[0]`.
        recv_splits: rows arriving from each source rank.
        group: the process group (EP group).
        ctx: timeout and CUDA side stream.
        what: a name for error messages.
    """
    x = x.contiguous()
    if group_size(group) == 1:
        return PendingAllToAll(x.clone(), ctx=ctx, what=what)
    if ctx.thread is not None:
        future = ctx.submit(lambda: all_to_all_blocking(x, send_splits, recv_splits, group, ctx, what))
        return PendingAllToAll(future=future, ctx=ctx, what=what)
    output = x.new_empty((sum(recv_splits), *x.shape[1:]))
    try:
        if ctx.stream is None:
            work = dist.all_to_all_single(output, x, recv_splits, send_splits, group=group, async_op=True)
            return PendingAllToAll(output, work=work, ctx=ctx, what=what)
        compute = torch.cuda.current_stream(x.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        with torch.cuda.stream(ctx.stream):
            ctx.stream.wait_event(ready)
            work = dist.all_to_all_single(output, x, recv_splits, send_splits, group=group, async_op=True)
            work.wait()  # on NCCL this only orders the side stream after the collective; the host goes on
            done = torch.cuda.Event()
            done.record(ctx.stream)
        # Both buffers are in use on the side stream until `done`; keep the allocator from reusing them.
        x.record_stream(ctx.stream)
        output.record_stream(ctx.stream)
        return PendingAllToAll(output, done=done, ctx=ctx, what=what)
    except CommError:
        raise
    except Exception as exc:
        raise CommError(f"{what} failed to start: {exc}") from exc


def all_to_all_blocking(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Any, ctx: CommContext,
                        what: str = "all_to_all") -> torch.Tensor:
    """The collective itself, issued from the calling thread and waited for (the communication thread's job)."""
    output = x.new_empty((sum(recv_splits), *x.shape[1:]))
    try:
        work = dist.all_to_all_single(output, x, recv_splits, send_splits, group=group, async_op=True)
        work.wait(timeout=ctx.timeout)
    except Exception as exc:
        raise CommError(f"{what} did not complete within {ctx.timeout_s:g} s: {exc}") from exc
    return output


def all_to_all_sync(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Any, ctx: CommContext,
                    *, what: str = "all_to_all") -> torch.Tensor:
    """`all_to_all_async(...).wait()`."""
    return all_to_all_async(x, send_splits, recv_splits, group, ctx, what=what).wait()


def exchange_counts(counts: torch.Tensor, group: Any, ctx: CommContext) -> torch.Tensor:
    """Send row r of `counts` ([ranks, n] integers) to rank r; return the rows received, one per source rank.

    Synchronous: the token all-to-all that follows needs the counts on the host as split sizes.
    """
    n = group_size(group)
    if counts.shape[0] != n:
        raise ValueError(f"counts has {counts.shape[0]} rows for a group of {n}")
    if n == 1:
        return counts.clone()
    received = torch.empty_like(counts)
    try:
        work = dist.all_to_all_single(received, counts.contiguous(), group=group, async_op=True)
        work.wait(timeout=ctx.timeout)
    except Exception as exc:
        raise CommError(f"token-count exchange did not complete within {ctx.timeout_s:g} s: {exc}") from exc
    return received


def all_reduce(t: torch.Tensor, group: Any, ctx: CommContext, *, op: Any = None, what: str = "all_reduce") -> None:
    """In-place all-reduce (sum unless `op`) with the context's timeout."""
    if group_size(group) == 1:
        return
    try:
        work = dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group, async_op=True)
        work.wait(timeout=ctx.timeout)
    except Exception as exc:
        raise CommError(f"{what} did not complete within {ctx.timeout_s:g} s: {exc}") from exc


class AllToAll(torch.autograd.Function):
    """Synchronous all-to-all whose backward is the inverse all-to-all (splits swapped).

    Dispatch and combine are each other's inverse, so one function serves both: the backward of a
    dispatch is a combine-shaped exchange of gradients and vice versa.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Any,
                comm: CommContext) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.comm = (send_splits, recv_splits), group, comm
        return all_to_all_sync(x, send_splits, recv_splits, group, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        send_splits, recv_splits = ctx.splits
        grad_in = all_to_all_sync(grad, recv_splits, send_splits, ctx.group, ctx.comm, what="all_to_all backward")
        return grad_in, None, None, None, None
