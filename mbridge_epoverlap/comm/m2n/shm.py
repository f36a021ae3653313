"""The `shm` backend: ranks on one host exchange messages through shared memory.

Each rank owns one segment holding an inbound channel per peer; a channel is two sequence words (messages
written by the sender, messages consumed by the receiver, on separate cache lines) and a ring of `slots`
slots. A sender writes the header and the tensors' bytes straight into the receiver's next free slot, then
publishes the new write count; the receiver copies the tensors out and publishes its consumed count. No
serialisation, no per-message buffer.

Waiting does not burn a core (all ranks share few cores here): a wait spins for a few tens of microseconds,
then sleeps in `poll` on the rank's doorbell FIFO (a sender writes a byte to it after publishing a message, a
receiver after freeing a slot of a full ring) and on the peer's pidfd, so a dead peer wakes it at once.
Segment and FIFO names are removed from /dev/shm as soon as every peer has opened them, so a rank killed
with SIGKILL later leaves nothing behind; `close()` removes them if set-up did not get that far.

`connect(peer, ...)` opens a channel after set-up (a replacement of a lost peer): this rank makes a new
segment holding the one inbound channel and a new doorbell FIFO for it (the first ones' names are gone, so the
newcomer could not open them), meets the newcomer in the store as at set-up, and drops the names again. The
old process's mapping stays until `close()`.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import mmap
import os
import secrets
import select
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mbridge_epoverlap.comm.m2n import wire
from mbridge_epoverlap.comm.m2n.base import PeerError
from mbridge_epoverlap.comm.m2n.rendezvous import PeerWatch, Rendezvous, this_host
from mbridge_epoverlap.comm.m2n.ring import Pending, RingCommunicator

SHM_DIR = "/dev/shm"
NAME_PREFIX = "mbe-m2n-"
_CTRL_BYTES = 128  # write count at word 0, consumed count at word 8 (a cache line apart)
_SPIN_S = float(os.environ.get("MBRIDGE_EPOVERLAP_M2N_SPIN_US", "30")) * 1e-6
_LIVENESS_POLL_S = 0.1
_CREDIT_POLL_S = 0.001


def slot_stride(slot_bytes: int) -> int:
    return wire.HEADER_BYTES + (slot_bytes + wire.ALIGN - 1) // wire.ALIGN * wire.ALIGN


def remove_leftovers(pids: Iterable[int]) -> list[str]:
    """Remove segments and FIFOs that processes `pids` created (for a launcher, after its ranks exited)."""
    removed = []
    for pid in pids:
        for path in glob.glob(os.path.join(SHM_DIR, f"{NAME_PREFIX}{pid}-*")):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    return removed


@dataclass
class _Channel:
    """One direction between this rank and one peer, mapped from the receiving rank's segment."""

    ctrl: memoryview  # int64 words
    slots: list[tuple[memoryview, torch.Tensor]]  # (bytes, uint8 tensor) per slot
    count: int = 0  # messages this side has written (out) or consumed (in)


@dataclass
class _Peer:
    rank: int
    watch: PeerWatch
    doorbell: int  # write end of the peer's FIFO
    out: _Channel
    inbound: _Channel
    sends: collections.deque[Pending] = field(default_factory=collections.deque)
    recvs: list[Pending] = field(default_factory=list)
    stash: dict[int, collections.deque[list[torch.Tensor]]] = field(default_factory=dict)
    mapping: mmap.mmap | None = None
    capacity: int = 0  # the peer's slot_bytes


class ShmCommunicator(RingCommunicator):
    """Shared-memory M2N between ranks of one host (see the module docstring for the protocol)."""

    backend = "shm"
    resumable_wait = True  # a wait only watches the ring and the peer's process: waiting again is harmless
    connects_late = True

    def __init__(self, *, rank: int, peers: Sequence[int], store: Any, slot_bytes: int, slots: int = 2,
                 timeout_s: float, key_prefix: str = "m2n", roles: dict[int, str] | None = None) -> None:
        super().__init__(rank=rank, peers=peers, slot_bytes=slot_bytes, slots=slots, timeout_s=timeout_s,
                         roles=roles)
        self._paths: list[str] = []
        self._views: list[Any] = []
        self._maps: list[mmap.mmap] = []
        self._fds: list[int] = []
        self._bells: list[int] = []  # read ends of this rank's doorbell FIFOs (one per set-up or connect)
        self._peers: dict[int, _Peer] = {}
        self._stride = slot_stride(slot_bytes)
        try:
            self._setup(store, key_prefix)
        except BaseException:
            self.close()
            raise

    # --- set-up -------------------------------------------------------------------------------------

    def _setup(self, store: Any, key_prefix: str) -> None:
        self._open(store, key_prefix, self.peers)

    def _open(self, store: Any, key_prefix: str, peers: Sequence[int]) -> None:
        """Make a segment with an inbound channel per peer in `peers`, meet them in `store`, map theirs."""
        base = os.path.join(SHM_DIR, f"{NAME_PREFIX}{os.getpid()}-{self.rank}-{secrets.token_hex(4)}")
        channel_bytes = _CTRL_BYTES + self.slots * self._stride
        segment, fifo = base + ".seg", base + ".fifo"
        fd = os.open(segment, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._paths.append(segment)
        try:
            os.ftruncate(fd, max(1, channel_bytes * len(peers)))
            own = mmap.mmap(fd, max(1, channel_bytes * len(peers)),
                            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._maps.append(own)
        os.mkfifo(fifo, 0o600)
        self._paths.append(fifo)
        bell = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # O_RDWR: never blocks, never sees EOF
        self._fds.append(bell)
        self._bells.append(bell)
        offsets = {p: i * channel_bytes for i, p in enumerate(peers)}
        rdv = Rendezvous(store, f"{key_prefix}/shm", self.rank, self.timeout_s, self.roles)
        rdv.publish({"pid": os.getpid(), "host": this_host(), "segment": segment, "fifo": fifo,
                     "slot_bytes": self.slot_bytes, "slots": self.slots, "stride": self._stride,
                     "offsets": {str(p): o for p, o in offsets.items()}})
        records = rdv.fetch(peers)
        for peer, rec in records.items():
            if rec["host"] != this_host():
                raise PeerError(peer, f"runs on host {rec['host']}, not {this_host()}: the shm backend needs "
                                      "every rank on one host (use backend 'mooncake' or 'torch')",
                                self.roles.get(peer))
            if rec["slots"] != self.slots or rec["stride"] != self._stride:
                raise PeerError(peer, f"was created with slots={rec['slots']}, slot_bytes={rec['slot_bytes']}; "
                                      f"this rank has slots={self.slots}, slot_bytes={self.slot_bytes}: create "
                                      "every communicator of a job with the same settings", self.roles.get(peer))
            if str(self.rank) not in rec["offsets"]:
                raise PeerError(peer, f"does not list rank {self.rank} among its peers", self.roles.get(peer))
            fd = os.open(rec["segment"], os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                peer_map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
            self._maps.append(peer_map)
            peer_bell = os.open(rec["fifo"], os.O_WRONLY | os.O_NONBLOCK)
            self._fds.append(peer_bell)
            out = self._channel(peer_map, int(rec["offsets"][str(self.rank)]))
            inbound = self._channel(own, offsets[peer])
            self._peers[peer] = _Peer(peer, PeerWatch(int(rec["pid"]), rec["host"]), peer_bell, out, inbound,
                                      capacity=int(rec["slot_bytes"]))
        # Everyone has opened our segment and FIFO once every peer passed this point: drop the names.
        rdv.barrier(peers, "attached")
        self._unlink()

    def _channel(self, mapping: mmap.mmap, offset: int) -> _Channel:
        whole = memoryview(mapping)
        self._views.append(whole)
        ctrl = whole[offset:offset + _CTRL_BYTES].cast("q")
        data = torch.frombuffer(mapping, dtype=torch.uint8, count=self.slots * self._stride,
                                offset=offset + _CTRL_BYTES)
        slots = []
        for i in range(self.slots):
            start = i * self._stride
            raw = whole[offset + _CTRL_BYTES + start:offset + _CTRL_BYTES + start + self._stride]
            slots.append((raw, data[start:start + self._stride]))
            self._views.append(raw)
        self._views += [ctrl, data]
        return _Channel(ctrl, slots)

    def _unlink(self) -> None:
        for path in self._paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._paths.clear()

    # --- the interface ------------------------------------------------------------------------------

    def connect(self, peer: int, store: Any, key_prefix: str) -> None:
        if self._closed:
            raise RuntimeError(f"M2N communicator of rank {self.rank} is closed")
        if peer == self.rank:
            from mbridge_epoverlap.errors import UsageError

            raise UsageError(f"rank {self.rank} cannot connect to itself")
        old = self._peers.pop(peer, None)
        if old is not None:  # the lost process: forget its channel (its mapping goes at close)
            old.watch.close()
            with contextlib.suppress(OSError):
                os.close(old.doorbell)
            self._fds.remove(old.doorbell)
        self.peers = tuple(sorted(set(self.peers) | {peer}))
        try:
            self._open(store, key_prefix, [peer])
        except BaseException:
            self._unlink()
            raise

    def _peer(self, peer: int) -> _Peer:
        p = self._peers.get(peer)
        if p is None:  # a `connect` to it failed: its old channel is gone and no new one was opened
            raise self._peer_error(peer, "has no open channel (connecting to its replacement failed)")
        return p

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._unlink()
        for p in self._peers.values():
            p.watch.close()
        self._peers.clear()
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._bells.clear()
        for view in reversed(self._views):
            if isinstance(view, memoryview):
                view.release()
        self._views.clear()
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view still alive elsewhere: the GC unmaps it later
                m.close()
        self._maps.clear()

    # --- progress -----------------------------------------------------------------------------------

    def _progress_sends(self, p: _Peer) -> None:
        ch = p.out
        while p.sends and ch.count - ch.ctrl[8] < self.slots:
            item = p.sends.popleft()
            raw, data = ch.slots[ch.count % self.slots]
            wire.write_message(raw, data, item.tensors or (), seq=ch.count, tag=item.tag)
            ch.count += 1
            ch.ctrl[0] = ch.count  # publish after the payload (x86 keeps stores in order)
            item.tensors, item.done = None, True
            self._ring(p)

    def _progress_recvs(self, p: _Peer) -> None:
        self._take_stashed(p)  # messages that arrived earlier for another receive
        ch = p.inbound
        while p.recvs and ch.ctrl[0] > ch.count:
            raw, data = ch.slots[ch.count % self.slots]
            seq, tag, tensors = wire.read_message(raw, data)
            if seq != ch.count:
                raise PeerError(p.rank, f"message {ch.count} arrived with sequence number {seq}: the channel is "
                                        "corrupt", self.roles.get(p.rank))
            full = ch.ctrl[0] - ch.count >= self.slots
            ch.count += 1
            ch.ctrl[8] = ch.count
            if full:  # only a sender that found the ring full can be waiting for this slot
                self._ring(p)
            self._deliver(p, tag, tensors)

    def _ring(self, p: _Peer) -> None:
        # A full pipe means the peer has wake-ups queued already; a closed one means it is gone (the wait
        # notices through its pidfd).
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(p.doorbell, b"\0")

    def _drain_doorbell(self) -> None:
        for bell in self._bells:
            with contextlib.suppress(BlockingIOError):
                while os.read(bell, 4096):
                    pass

    def _poll(self, p: _Peer, item: Pending) -> bool:
        if not item.done and not self._closed:
            # Both directions: a peer blocked on a full slot of ours may be what our message waits for.
            self._progress_sends(p)
            self._progress_recvs(p)
        return item.done

    def _block(self, p: _Peer, item: Pending, deadline: float) -> bool:
        if self._poll(p, item):
            return True
        spin_end = time.monotonic() + _SPIN_S
        while time.monotonic() < spin_end:
            if self._poll(p, item):
                return True
        poller = select.poll()
        for bell in self._bells:
            poller.register(bell, select.POLLIN)
        if p.watch.fd is not None:
            poller.register(p.watch.fd, select.POLLIN)
        while True:
            self._drain_doorbell()
            if self._poll(p, item):
                return True
            if self._closed:
                raise RuntimeError(f"M2N communicator of rank {self.rank} was closed while waiting")
            if not p.watch.alive():
                if self._poll(p, item):  # it may have written before it exited
                    return True
                raise self._peer_error(p.rank, f"process {p.watch.pid} exited")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            # A sender waiting for a free slot re-checks every millisecond: the receiver rings only when it
            # saw the ring full, and without a memory fence it can miss a sender that filled it a moment ago.
            waiting_for_slot = item.tensors is not None
            poller.poll(min(remaining, _CREDIT_POLL_S if waiting_for_slot else _LIVENESS_POLL_S) * 1e3)
