"""The `torch` and `gloo` backends: torch.distributed point-to-point on a process group made once.

A message is packed (header, then payload, the shared wire format) into one of `slots` staging buffers per
peer and sent as a single tensor; the receiver posts a receive into a staging buffer of the full slot size
(gloo accepts a shorter message) and unpacks it into tensors the caller owns.

- `torch`: the process groups' own `send`/`recv`, posted at once, on a two-rank gloo group per peer built for
  the communicator (not the default group, so it coexists with whatever else the ranks run, and one peer's
  channel can be re-made alone: `connect` builds a new pair group with a replacement under its key prefix).
- `gloo`: the baseline every comparison uses, written the way M2N is usually done on torch.distributed:
  operations are collected and issued together with `torch.distributed.batch_isend_irecv` on the default
  group when a handle is first polled or waited on.

Waits that resume (`resumable_wait`, on `torch`): gloo closes the connection to a peer when a wait of its own
times out, and a handle reports completion only once waited on, so neither a short wait nor a poll can be left
to gloo. But gloo writes a message into the posted buffer as it arrives: a sender puts a mark in the header's
last word (`wire.MARK_OFFSET`, which the header never uses), a receiver clears it before posting, so a header
that arrived shows without waiting. A receive's poll, and its wait when the wait is short (a slice) or other
receives from the peer are pending, look for the mark (spinning briefly, then sleeping in short steps; a lone
long wait stays gloo's, which wakes at once) and, once the header is there, wait in gloo for the header and
the payload behind it, which are on their way; a wait that runs out leaves gloo's handles untouched, so it can
be waited on again. While it waits it also posts the payload receives of the peer's other arrived messages: a
gloo send completes only once its receive is posted, and the peer may be waiting for that send before it sends
the message waited for (shared memory and Mooncake have no such dependency: their sends land in slots). A dead
peer shows through its process (a pidfd; pids are exchanged with the pair group). Sends wait in gloo. (A
helper thread per wait would do too, but a thread blocked in gloo when the interpreter exits aborts it.)
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mbridge_epoverlap.comm.m2n import wire
from mbridge_epoverlap.comm.m2n.base import M2NCommunicator, PeerError, Work
from mbridge_epoverlap.comm.m2n.rendezvous import PeerWatch, Rendezvous, this_host
from mbridge_epoverlap.comm.m2n.shm import slot_stride

_MARK = b"M2N-HDR!"  # in a header's last word: the header arrived
_SPIN_S = 30e-6
_SLEEP_MAX_S = 200e-6  # a polled wait looks for the mark at least this often
_LIVENESS_POLL_S = 0.1


class _Staging:
    """A ring of staging buffers for one direction to one peer, each reusable once its operation completed."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.buffers = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(count)]
        self.views = [memoryview(b.numpy()) for b in self.buffers]
        self.busy: list[Any] = [None] * count  # the in-flight handle per buffer


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _Failed:
    """The handle of an operation gloo refused to start (its peer's connection is closed): it fails when polled."""

    def __init__(self, error: RuntimeError) -> None:
        self.error = error

    def is_completed(self) -> bool:
        raise self.error

    def wait(self, timeout: Any = None) -> None:
        raise self.error


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc)
    return "imed out" in text or "imeout" in text


@dataclass
class _Receive:
    """One posted receive: its header receive until that completes, then its payload receive (if any)."""

    header: list[Any] | None
    payload: list[Any] | None = None
    view: memoryview | None = None
    buf: torch.Tensor | None = None


class TorchCommunicator(M2NCommunicator):
    """torch.distributed point-to-point M2N (gloo on CPU) on a pair process group per peer, created once."""

    backend = "torch"
    resumable_wait = True  # short waits and polls look for the header's arrival mark (see the module docstring)
    connects_late = True

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
        self._watches: dict[int, PeerWatch] = {}
        self._pg = self._make_group(store, key_prefix)

    def _make_group(self, store: Any, key_prefix: str) -> Any:
        """`{peer: (two-rank group, the peer's rank in it)}`, made in the order of the pairs (lower rank, higher
        rank), the same on every rank, so that no two ranks wait for each other's next pair."""
        return {peer: self._pair(store, key_prefix, peer)
                for peer in sorted(self.peers, key=lambda p: (min(p, self.rank), max(p, self.rank)))}

    def _pair(self, store: Any, key_prefix: str, peer: int) -> tuple[Any, int]:
        low, high = sorted((self.rank, peer))
        if self.resumable_wait:  # a polled wait tells a dead peer by its process (gloo's own wait by its socket)
            rdv = Rendezvous(store, f"{key_prefix}/torch-pid/{low}-{high}", self.rank, self.timeout_s, self.roles)
            rdv.publish({"pid": os.getpid(), "host": this_host()})
            record = rdv.fetch([peer])[peer]
            old = self._watches.pop(peer, None)
            if old is not None:
                old.close()
            self._watches[peer] = PeerWatch(int(record["pid"]), record["host"])
        prefixed = dist.PrefixStore(f"{key_prefix}/torch/{low}-{high}", store)
        try:
            group = dist.ProcessGroupGloo(prefixed, int(self.rank == high), 2, self._group_options())
        except RuntimeError as exc:
            raise self._peer_error(peer, f"did not join the M2N set-up: {_first_line(exc)}") from None
        return group, int(peer == high)

    def _group_options(self) -> Any:
        """One gloo device (its one event loop thread) for all pair groups, and one worker thread each (point to
        point uses none): a group per peer must not cost a set of threads per peer on a few cores."""
        if getattr(self, "_device", None) is None:
            interface = os.environ.get("GLOO_SOCKET_IFNAME")
            self._device = (dist.ProcessGroupGloo.create_device(interface=interface.split(",")[0]) if interface
                            else dist.ProcessGroupGloo.create_default_device())
        options = dist.ProcessGroupGloo._Options()
        options._devices = [self._device]
        options._threads = 1
        options._timeout = timedelta(seconds=self.timeout_s)
        return options

    def connect(self, peer: int, store: Any, key_prefix: str) -> None:
        if self._closed:
            raise RuntimeError(f"M2N communicator of rank {self.rank} is closed")
        if peer == self.rank:
            from mbridge_epoverlap.errors import UsageError

            raise UsageError(f"rank {self.rank} cannot connect to itself")
        # The old process's operations are dropped with its group; the newcomer starts at sequence 0.
        self._pg.pop(peer, None)
        for key in [k for k in self._receives if k[0] == peer]:
            del self._receives[key]
        self.peers = tuple(sorted(set(self.peers) | {peer}))
        self._send[peer] = _Staging(self.slots, self._stride)
        self._recv[peer] = _Staging(self.slots, self._stride)
        self._recv_free[peer] = collections.deque(range(self.slots))
        self._seq[peer] = 0
        self._pg[peer] = self._pair(store, key_prefix, peer)

    # Submitting one operation; returns a one-element list that holds (or will hold) its torch handle (a
    # second element, True, once waited on).
    # `gloo` overrides this and `_flush` to batch them.
    def _submit(self, op: Any, buf: torch.Tensor, peer: int, tag: int) -> list[Any]:
        if peer not in self._pg:  # a `connect` to it failed: its old group is gone and no new one was made
            raise self._peer_error(peer, "has no open channel (connecting to its replacement failed)")
        group, peer_rank = self._pg[peer]
        try:
            if op is dist.isend:
                return [group.send([buf], peer_rank, tag)]
            return [group.recv([buf], peer_rank, tag)]
        except RuntimeError as exc:  # the pair's connection is closed (a dead peer): the wait's error
            return [_Failed(exc)]

    def _flush(self) -> None:
        pass

    def isend(self, peer: int, tensors: Sequence[torch.Tensor], tag: int = 0) -> Work:
        self._check_peer(peer)
        wire.check_message(tensors, self.slot_bytes)
        ring = self._send[peer]
        index = self._free_send_buffer(peer, ring)
        buf = ring.buffers[index]
        size = wire.write_message(ring.views[index], buf, tensors, seq=self._seq[peer], tag=tag)
        ring.views[index][wire.MARK_OFFSET:wire.MARK_OFFSET + len(_MARK)] = _MARK
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
        ring.views[index][wire.MARK_OFFSET:wire.MARK_OFFSET + len(_MARK)] = bytes(len(_MARK))
        state = _Receive(self._submit(dist.irecv, buf[:wire.HEADER_BYTES], peer, 2 * tag))
        queue = self._receives.setdefault((peer, tag), collections.deque())
        queue.append(state)

        def advance() -> None:
            self._advance(peer, tag)

        state.view, state.buf = ring.views[index], buf

        def take_payload() -> bool:
            # The header is here, so the payload is on its way from a live sender: wait for it in gloo.
            if state.payload is not None:
                self._wait_handle(peer, state.payload, self.timeout_s, "receive")
            return True

        def poll() -> bool:
            self._flush()
            advance()
            self._flush()
            if state.header is not None:
                return False
            if state.payload is None or self._completed(peer, state.payload, "receive"):
                return True
            return take_payload() if self.resumable_wait else False

        def block(deadline: float) -> bool:
            # Polled when it may run out before the peer is gone (a slice) or when other messages of the peer may
            # need their payload receives posted meanwhile; otherwise in gloo, which wakes at once.
            if self.resumable_wait and (deadline - time.monotonic() < self.timeout_s / 2 or self._others(peer, tag)):
                return polled(deadline)
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

        def polled(deadline: float) -> bool:
            # Every message of this peer whose header arrived gets its payload receive posted meanwhile: the
            # peer's send of it may be what it waits on before it sends the message this wait is for.
            spin_end = time.monotonic() + _SPIN_S
            sleep_s = 10e-6
            checked = -float("inf")
            while True:
                self._flush()
                self._advance_peer(peer)
                if state.header is None:
                    return take_payload()
                now = time.monotonic()
                if now >= deadline:
                    return False  # gloo's handles untouched: the wait can resume
                if now - checked > _LIVENESS_POLL_S:
                    checked = now
                    watch = self._watches.get(peer)
                    if watch is not None and not watch.alive():
                        raise self._peer_error(peer, f"process {watch.pid} exited")
                if now > spin_end:
                    time.sleep(sleep_s)
                    sleep_s = min(2 * sleep_s, _SLEEP_MAX_S)

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

    def _advance(self, peer: int, tag: int) -> None:
        """Post the payload receives of the queued messages of (peer, tag) whose headers completed (or show
        their mark), in header order."""
        queue = self._receives.get((peer, tag))
        while queue and queue[0].header is not None:
            head = queue[0]
            if not self._completed(peer, head.header, "receive"):
                if not self.resumable_wait or not self._arrived(head):
                    return
                self._wait_handle(peer, head.header, self.timeout_s, "receive")  # it is there: no wait
            size = int(wire.payload_size(head.view))
            head.header = None
            if size:
                head.payload = self._submit(dist.irecv, head.buf[wire.HEADER_BYTES:wire.HEADER_BYTES + size],
                                            peer, 2 * tag + 1)
            queue.popleft()

    def _others(self, peer: int, tag: int) -> bool:
        """Whether receives of another tag from `peer` wait for their headers."""
        return any(queue and queue[0].header is not None for (p, t), queue in self._receives.items()
                   if p == peer and t != tag)

    def _advance_peer(self, peer: int) -> None:
        for key in [k for k in self._receives if k[0] == peer]:
            self._advance(*key)

    @staticmethod
    def _arrived(receive: _Receive) -> bool:
        """Whether a posted header receive's message is in its buffer (its mark; see the module docstring)."""
        return receive.view is not None and receive.view[wire.MARK_OFFSET:wire.MARK_OFFSET + len(_MARK)] == _MARK

    def _completed(self, peer: int, ref: list[Any], what: str) -> bool:
        if len(ref) > 1:  # waited on
            return True
        if ref[0] is None:  # `gloo`: not issued yet
            return False
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
            if _is_timeout(exc):
                raise self._peer_timeout(peer, f"{what} did not complete within {timeout_s:g} s") from None
            raise self._peer_error(peer, f"{what} failed: {_first_line(exc)}") from None
        ref.append(True)
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watch in self._watches.values():
            watch.close()
        self._watches.clear()
        self._send.clear()
        self._recv.clear()
        self._pg = None


class GlooBatchCommunicator(TorchCommunicator):
    """The baseline: `torch.distributed.batch_isend_irecv` over gloo on the default process group."""

    backend = "gloo"
    resumable_wait = False  # the baseline keeps gloo's own waits
    connects_late = False
    connect = M2NCommunicator.connect  # one default group for the job: no channel can be re-made alone

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
