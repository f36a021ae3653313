"""The `torch` and `gloo` backends: torch.distributed point-to-point on a process group made once.

A message is packed (header, then payload, the shared wire format) into one of `slots` staging buffers per
peer and sent as a single tensor; the receiver posts a receive into a staging buffer of the full slot size
(gloo accepts a shorter message) and unpacks it into tensors the caller owns.

- `torch`: the process group's own `send`/`recv`, posted at once (a gloo group built for the communicator,
  not the default group, so it coexists with whatever else the ranks run).
- `gloo`: the baseline every comparison uses, written the way M2N is usually done on torch.distributed:
  operations are collected and issued together with `torch.distributed.batch_isend_irecv` on the default
  group when a handle is first polled or waited on.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mbridge_epoverlap.comm.m2n import wire
from mbridge_epoverlap.comm.m2n.base import M2NCommunicator, PeerError, Work
from mbridge_epoverlap.comm.m2n.shm import slot_stride


class _Staging:
    """A ring of staging buffers for one direction to one peer, each reusable once its operation completed."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.buffers = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(count)]
        self.views = [memoryview(b.numpy()) for b in self.buffers]
        self.busy: list[Any] = [None] * count  # the in-flight handle per buffer


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass
class _Receive:
    """One posted receive: its header receive until that completes, then its payload receive (if any)."""

    header: list[Any] | None
    payload: list[Any] | None = None
    view: memoryview | None = None
    buf: torch.Tensor | None = None


class TorchCommunicator(M2NCommunicator):
    """torch.distributed point-to-point M2N (gloo on CPU) on a process group created once."""

    backend = "torch"

    def __init__(self, *, rank: int, peers: Sequence[int], store: Any, slot_bytes: int, slots: int = 2,
                 timeout_s: float, key_prefix: str = "m2n", world_size: int | None = None,
                 roles: dict[int, str] | None = None) -> None:
        super().__init__(rank=rank, peers=peers, slot_bytes=slot_bytes, slots=slots, timeout_s=timeout_s,
                         roles=roles)
        self.world_size = world_size if world_size is not None else max((rank, *self.peers)) + 1
        self._stride = slot_stride(slot_bytes)
        self._send = {p: _Staging(slots, self._stride) for p in self.peers}
        self._recv_free: dict[int, collections.deque[int]] = {p: collections.deque(range(slots)) for p in self.peers}
        self._recv = {p: _Staging(slots, self._stride) for p in self.peers}
        self._seq = dict.fromkeys(self.peers, 0)
        self._receives: dict[tuple[int, int], collections.deque[_Receive]] = {}
        self._pg = self._make_group(store, key_prefix)

    def _make_group(self, store: Any, key_prefix: str) -> Any:
        prefixed = dist.PrefixStore(f"{key_prefix}/torch", store)
        return dist.ProcessGroupGloo(prefixed, self.rank, self.world_size, timedelta(seconds=self.timeout_s))

    # Submitting one operation; returns a one-element list that holds (or will hold) its torch handle.
    # `gloo` overrides this and `_flush` to batch them.
    def _submit(self, op: Any, buf: torch.Tensor, peer: int, tag: int) -> list[Any]:
        if op is dist.isend:
            return [self._pg.send([buf], peer, tag)]
        return [self._pg.recv([buf], peer, tag)]

    def _flush(self) -> None:
        pass

    def isend(self, peer: int, tensors: Sequence[torch.Tensor], tag: int = 0) -> Work:
        self._check_peer(peer)
        wire.check_message(tensors, self.slot_bytes)
        ring = self._send[peer]
        index = self._free_send_buffer(peer, ring)
        buf = ring.buffers[index]
        size = wire.write_message(ring.views[index], buf, tensors, seq=self._seq[peer], tag=tag)
        self._seq[peer] += 1
        # Header and payload go as two messages of exact sizes (gloo cannot receive a shorter message
        # reliably), on two tags so that receives posted ahead never take one for the other.
        refs = [self._submit(dist.isend, buf[:wire.HEADER_BYTES], peer, 2 * tag)]
        if size > wire.HEADER_BYTES:
            refs.append(self._submit(dist.isend, buf[wire.HEADER_BYTES:size], peer, 2 * tag + 1))
        ring.busy[index] = refs

        def poll() -> bool:
            self._flush()
            return all(self._completed(peer, ref, "send") for ref in refs)

        def block(deadline: float) -> bool:
            for ref in refs:
                self._wait_handle(peer, ref, deadline - time.monotonic(), "send")
            return True

        return self._work(peer, f"send (tag {tag}) to rank {peer}", poll, block, lambda: None)

    def irecv(self, peer: int, tag: int = 0) -> Work:
        self._check_peer(peer)
        ring, free = self._recv[peer], self._recv_free[peer]
        if free:
            index = free.popleft()
        else:  # more receives posted than slots: grow once, reuse afterwards
            ring.buffers.append(torch.zeros(self._stride, dtype=torch.uint8))
            ring.views.append(memoryview(ring.buffers[-1].numpy()))
            ring.busy.append(None)
            index = len(ring.buffers) - 1
        buf = ring.buffers[index]
        state = _Receive(self._submit(dist.irecv, buf[:wire.HEADER_BYTES], peer, 2 * tag))
        queue = self._receives.setdefault((peer, tag), collections.deque())
        queue.append(state)

        def advance() -> None:
            # Payload receives are posted in header order, as headers complete.
            while queue and queue[0].header is not None:
                head = queue[0]
                if not self._completed(peer, head.header, "receive"):
                    return
                size = int(wire.payload_size(head.view))
                head.header = None
                if size:
                    head.payload = self._submit(dist.irecv, head.buf[wire.HEADER_BYTES:wire.HEADER_BYTES + size],
                                                peer, 2 * tag + 1)
                queue.popleft()

        state.view, state.buf = ring.views[index], buf

        def poll() -> bool:
            self._flush()
            advance()
            self._flush()
            return state.header is None and (state.payload is None or self._completed(peer, state.payload,
                                                                                        "receive"))

        def block(deadline: float) -> bool:
            while state.header is not None:
                self._flush()
                for ahead in list(queue):
                    if ahead.header is not None:
                        self._wait_handle(peer, ahead.header, deadline - time.monotonic(), "receive")
                    if ahead is state:
                        break
                advance()
            self._flush()
            if state.payload is not None:
                self._wait_handle(peer, state.payload, deadline - time.monotonic(), "receive")
            return True

        result: list[list[torch.Tensor]] = []

        def unpack() -> list[torch.Tensor]:
            if not result:
                result.append(wire.read_message(ring.views[index], buf)[2])
                free.append(index)
            return result[0]

        return self._work(peer, f"receive (tag {tag}) from rank {peer}", poll, block, unpack)

    def _free_send_buffer(self, peer: int, ring: _Staging) -> int:
        """A staging buffer whose previous send left; a new one when all are in flight.

        Growing (rather than waiting) keeps a sender from blocking on a receiver that is waiting for a later
        message first (tags taken out of order); the ring stops growing once the traffic settles.
        """
        self._flush()
        for index, refs in enumerate(ring.busy):
            if refs is None or all(self._completed(peer, ref, "send") for ref in refs):
                return index
        ring.buffers.append(torch.zeros(self._stride, dtype=torch.uint8))
        ring.views.append(memoryview(ring.buffers[-1].numpy()))
        ring.busy.append(None)
        return len(ring.buffers) - 1

    def _completed(self, peer: int, ref: list[Any], what: str) -> bool:
        try:
            return bool(ref[0].is_completed())
        except RuntimeError as exc:
            raise self._peer_error(peer, f"{what} failed: {_first_line(exc)}") from None

    def _wait_handle(self, peer: int, ref: list[Any], timeout_s: float, what: str) -> bool:
        self._flush()
        if len(ref) > 1:  # waited on before (a gloo handle must not be waited on twice)
            return True
        if timeout_s <= 0 and not ref[0].is_completed():
            raise self._peer_timeout(peer, f"{what} did not complete within the timeout")
        try:
            ref[0].wait(timedelta(seconds=max(timeout_s, 0.001)))
        except RuntimeError as exc:
            text = str(exc)
            if "imed out" in text or "imeout" in text:
                raise self._peer_timeout(peer, f"{what} did not complete within {timeout_s:g} s") from None
            raise self._peer_error(peer, f"{what} failed: {_first_line(exc)}") from None
        ref.append(True)
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._send.clear()
        self._recv.clear()
        self._pg = None


class GlooBatchCommunicator(TorchCommunicator):
    """The baseline: `torch.distributed.batch_isend_irecv` over gloo on the default process group."""

    backend = "gloo"

    def _make_group(self, store: Any, key_prefix: str) -> Any:
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.PrefixStore(f"{key_prefix}/gloo", store), rank=self.rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=self.timeout_s))
            self._owns_default = True
        elif dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            raise PeerError(self.rank, f"the default process group (rank {dist.get_rank()} of "
                                       f"{dist.get_world_size()}) does not match rank {self.rank} of "
                                       f"{self.world_size}: use backend 'torch', which makes its own group")
        self._pending: list[tuple[dist.P2POp, list[Any]]] = []
        return None

    def _submit(self, op: Any, buf: torch.Tensor, peer: int, tag: int) -> list[Any]:
        ref: list[Any] = [None]
        self._pending.append((dist.P2POp(op, buf, peer, tag=tag), ref))
        return ref

    def _flush(self) -> None:
        if not getattr(self, "_pending", None):
            return
        pending, self._pending = self._pending, []
        works = dist.batch_isend_irecv([op for op, _ in pending])
        for (_, ref), work in zip(pending, works, strict=True):
            ref[0] = work

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        if getattr(self, "_owns_default", False) and dist.is_initialized():
            dist.destroy_process_group()
