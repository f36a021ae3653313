"""The `mooncake` backend: one-sided writes with the Mooncake Transfer Engine (TCP here, RDMA on a cluster).

Each rank registers one memory region, once, holding: an inbound channel per peer (a write-count word and a
ring of `slots` slots, as in the `shm` backend), an outbound staging ring per peer, a credit word per peer
(how many of our messages that peer has consumed, written by the peer), and source words for the counters it
writes. Engines find each other with Mooncake's peer-to-peer handshake (no metadata server); addresses are
exchanged once through the store.

Sending a message: pack it into the staging slot, write it into the receiver's slot, then write the new
write count into the receiver's channel word; the second write starts after the first completed, so a
receiver that sees the count sees the whole message. Receiving: copy the tensors out of the local slot and
write the consumed count into the sender's credit word, without waiting for that write (a later count
supersedes an earlier one). Writes are submitted asynchronously and their completion polled, spinning
briefly and then sleeping in short steps: the engine's transfer threads need the same few cores (the
engine's synchronous write spins until done). A write that fails (the peer is gone) is a `PeerError`; a
wait polls its word the same way until its deadline. A peer's death is known before the engine is asked: a
write first looks at the peer's process (a pidfd poll, on this host) and a peer whose write failed once is
dead for good, because the engine retries a refused connection with a backoff of about a second per write
(a dead peer would otherwise cost that second again at every send still queued to it). A wait that runs out
leaves its message queued, so waiting on it again resumes it (`resumable_wait`).

`connect(peer, ...)` re-opens the channel to a replacement of a set-up peer: the peer's areas of the region
(inbound channel, staging ring, credit word) are zeroed and reused, the two ranks exchange records under the
new key prefix as at set-up, and the old process's messages are dropped. A rank that was not a peer at
set-up has no area in the region (registered once), so connecting to it is a usage error.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mbridge_epoverlap.comm.m2n import wire
from mbridge_epoverlap.comm.m2n.base import PeerError
from mbridge_epoverlap.comm.m2n.rendezvous import PeerWatch, Rendezvous, this_host
from mbridge_epoverlap.comm.m2n.ring import Pending, RingCommunicator
from mbridge_epoverlap.comm.m2n.shm import slot_stride

_CTRL_BYTES = 128
_WORD_BYTES = 64  # one counter per cache line
_SPIN_S = 30e-6
_SLEEP_MAX_S = 200e-6


@dataclass
class _Peer:
    rank: int
    segment: str  # "host:rpc_port" of the peer's engine
    watch: PeerWatch
    remote_channel: int  # address of our inbound channel in the peer's region
    remote_credit: int  # address of the peer's credit word for us
    capacity: int
    sent: int = 0
    consumed: int = 0
    sends: collections.deque[Pending] = field(default_factory=collections.deque)
    recvs: list[Pending] = field(default_factory=list)
    stash: dict[int, collections.deque[list[torch.Tensor]]] = field(default_factory=dict)
    credit_writes: list[int] = field(default_factory=list)
    gone: PeerError | None = None  # set by the first write that failed: the peer is dead for good


class MooncakeCommunicator(RingCommunicator):
    """M2N over the Mooncake Transfer Engine (see the module docstring for the protocol)."""

    backend = "mooncake"
    resumable_wait = True  # a wait only polls words of the region and the peer's process
    connects_late = True

    def __init__(self, *, rank: int, peers: Sequence[int], store: Any, slot_bytes: int, slots: int = 2,
                 timeout_s: float, key_prefix: str = "m2n", roles: dict[int, str] | None = None,
                 host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        super().__init__(rank=rank, peers=peers, slot_bytes=slot_bytes, slots=slots, timeout_s=timeout_s,
                         roles=roles)
        from mooncake.engine import TransferEngine

        self._stride = slot_stride(slot_bytes)
        n = len(self.peers)
        self._channel_bytes = _CTRL_BYTES + slots * self._stride
        inbound = n * self._channel_bytes
        staging = n * slots * self._stride
        self._credit_at = inbound + staging
        self._scratch_at = self._credit_at + n * _WORD_BYTES
        total = self._scratch_at + 2 * n * _WORD_BYTES
        self._region = torch.zeros(total, dtype=torch.uint8)
        self._base = self._region.data_ptr()
        self._words = memoryview(self._region.numpy()).cast("q")  # the region as int64 words
        self._bytes = memoryview(self._region.numpy())
        self._index = {p: i for i, p in enumerate(self.peers)}
        self._peers: dict[int, _Peer] = {}
        self._engine = TransferEngine()
        self._host = host
        if self._engine.initialize(self._host, "P2PHANDSHAKE", protocol, "") != 0:
            raise RuntimeError(f"the Mooncake Transfer Engine did not start on {self._host} ({protocol})")
        if self._engine.register_memory(self._base, total) != 0:
            raise RuntimeError(f"the Mooncake Transfer Engine could not register {total} bytes")
        self._registered = True
        self._segment = f"{self._host}:{self._engine.get_rpc_port()}"
        self._meet(store, key_prefix, self.peers)

    def _meet(self, store: Any, key_prefix: str, peers: Sequence[int]) -> None:
        """Publish where `peers`' channels and credit words are in this region, fetch theirs, wait for them all."""
        rdv = Rendezvous(store, f"{key_prefix}/mooncake", self.rank, self.timeout_s, self.roles)
        rdv.publish({"pid": os.getpid(), "host": this_host(), "segment": self._segment, "base": self._base,
                     "slot_bytes": self.slot_bytes, "slots": self.slots, "stride": self._stride,
                     "channels": {str(p): self._base + self._inbound(p) for p in peers},
                     "credits": {str(p): self._base + self._credit(p) for p in peers}})
        for peer, rec in rdv.fetch(peers).items():
            if rec["slots"] != self.slots or rec["stride"] != self._stride:
                raise PeerError(peer, f"was created with slots={rec['slots']}, slot_bytes={rec['slot_bytes']}; "
                                      f"this rank has slots={self.slots}, slot_bytes={self.slot_bytes}: create every "
                                      "communicator of a job with the same settings", self.roles.get(peer))
            if str(self.rank) not in rec["channels"]:
                raise PeerError(peer, f"does not list rank {self.rank} among its peers", self.roles.get(peer))
            self._peers[peer] = _Peer(peer, rec["segment"], PeerWatch(int(rec["pid"]), rec["host"]),
                                      int(rec["channels"][str(self.rank)]), int(rec["credits"][str(self.rank)]),
                                      int(rec["slot_bytes"]))
        rdv.barrier(peers, "attached")

    # --- layout ------------------------------------------------------------------------------------

    def _inbound(self, peer: int) -> int:
        return self._index[peer] * self._channel_bytes

    def _credit(self, peer: int) -> int:
        return self._credit_at + self._index[peer] * _WORD_BYTES

    def _staging(self, peer: int, slot: int) -> int:
        return len(self.peers) * self._channel_bytes + (self._index[peer] * self.slots + slot) * self._stride

    def _slot_views(self, offset: int) -> tuple[memoryview, torch.Tensor]:
        return self._bytes[offset:offset + self._stride], self._region[offset:offset + self._stride]

    # --- the interface ------------------------------------------------------------------------------

    def connect(self, peer: int, store: Any, key_prefix: str) -> None:
        from mbridge_epoverlap.errors import UsageError

        if self._closed:
            raise RuntimeError(f"M2N communicator of rank {self.rank} is closed")
        if peer not in self._index:
            raise UsageError(f"the mooncake M2N backend connects late only to a replacement of a set-up peer; rank "
                             f"{peer} was not a peer of rank {self.rank} at set-up (peers: {list(self.peers)})")
        old = self._peers.pop(peer, None)
        if old is not None:  # the lost process: its pending messages are dropped, its credit writes not waited for
            old.watch.close()
        # The old process's counts and messages must not be taken for the newcomer's.
        for start, size in ((self._inbound(peer), self._channel_bytes),
                            (self._staging(peer, 0), self.slots * self._stride), (self._credit(peer), _WORD_BYTES),
                            (self._scratch_at + 2 * self._index[peer] * _WORD_BYTES, 2 * _WORD_BYTES)):
            self._region[start:start + size].zero_()
        self._meet(store, key_prefix, [peer])

    def _peer(self, peer: int) -> _Peer:
        p = self._peers.get(peer)
        if p is None:  # a `connect` to it failed: its old channel is gone and no new one was opened
            raise self._peer_error(peer, "has no open channel (connecting to its replacement failed)")
        return p

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        end = time.monotonic() + 1.0  # let credit writes in flight finish before the memory goes
        for p in self._peers.values():
            while p.credit_writes and time.monotonic() < end:
                self._reap_credits(p)
                time.sleep(1e-4)
            p.watch.close()
        self._peers.clear()
        if getattr(self, "_registered", False):
            self._engine.unregister_memory(self._base)
            self._registered = False
        self._words.release()
        self._bytes.release()

    # --- progress -----------------------------------------------------------------------------------

    def _write(self, p: _Peer, local_offset: int, remote_addr: int, nbytes: int) -> None:
        """Write and wait for completion, yielding the CPU while waiting (the engine's own threads need it)."""
        self._check_alive(p)
        batch = self._submit(p, local_offset, remote_addr, nbytes)
        spin_end = time.monotonic() + _SPIN_S
        sleep_s = 5e-6
        deadline = time.monotonic() + self.timeout_s
        while True:
            status = self._engine.transfer_check_status(batch)
            if status == 1:
                return
            if status < 0:
                p.gone = self._peer_error(p.rank, f"a write of {nbytes} bytes to {p.segment} failed (the peer is "
                                                  "gone)")
                raise p.gone
            now = time.monotonic()
            if now > deadline:
                raise self._peer_timeout(p.rank, f"a write of {nbytes} bytes to {p.segment} did not complete within "
                                                 f"{self.timeout_s:g} s")
            if now > spin_end:
                time.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, _SLEEP_MAX_S)

    def _check_alive(self, p: _Peer) -> None:
        """PeerError when `p` is known dead: a write failed before, or its process (on this host) exited."""
        if p.gone is None and not p.watch.alive():
            p.gone = self._peer_error(p.rank, f"process {p.watch.pid} exited")
        if p.gone is not None:
            raise p.gone

    def _submit(self, p: _Peer, local_offset: int, remote_addr: int, nbytes: int) -> int:
        batch = self._engine.transfer_submit_write(p.segment, self._base + local_offset, remote_addr, nbytes)
        if batch < 0:
            p.gone = self._peer_error(p.rank, f"a write of {nbytes} bytes to {p.segment} was refused (the peer is "
                                              "gone)")
            raise p.gone
        return batch

    def _submit_credit(self, p: _Peer, scratch: int) -> int:
        # A sender that already left (it sent its last message) cannot take the slot back; that is fine. One
        # known gone is not written to at all (the engine would spend its reconnect backoff on it).
        if p.gone is not None or not p.watch.alive():
            return -1
        return self._engine.transfer_submit_write(p.segment, self._base + scratch, p.remote_credit, 8)

    def _reap_credits(self, p: _Peer) -> None:
        # Credit writes are not waited for (a later value supersedes an earlier one); their handles are
        # checked here so the engine can free them. A failed one means the sender left: nothing to do.
        p.credit_writes = [b for b in p.credit_writes if self._engine.transfer_check_status(b) == 0]

    def _progress_sends(self, p: _Peer) -> None:
        credit_word = self._credit(p.rank) // 8
        while p.sends and p.sent - self._words[credit_word] < self.slots:
            item = p.sends[0]
            slot = p.sent % self.slots
            offset = self._staging(p.rank, slot)
            raw, data = self._slot_views(offset)
            size = wire.write_message(raw, data, item.tensors or (), seq=p.sent, tag=item.tag)
            self._write(p, offset, p.remote_channel + _CTRL_BYTES + slot * self._stride, size)
            p.sent += 1
            scratch = self._scratch_at + 2 * self._index[p.rank] * _WORD_BYTES
            self._words[scratch // 8] = p.sent
            self._write(p, scratch, p.remote_channel, 8)  # publish after the payload landed
            p.sends.popleft()
            item.tensors, item.done = None, True

    def _progress_recvs(self, p: _Peer) -> None:
        self._take_stashed(p)  # messages that arrived earlier for another receive
        channel = self._inbound(p.rank)
        while p.recvs and self._words[channel // 8] > p.consumed:
            raw, data = self._slot_views(channel + _CTRL_BYTES + (p.consumed % self.slots) * self._stride)
            seq, tag, tensors = wire.read_message(raw, data)
            if seq != p.consumed:
                raise self._peer_error(p.rank, f"message {p.consumed} arrived with sequence number {seq}")
            p.consumed += 1
            scratch = self._scratch_at + (2 * self._index[p.rank] + 1) * _WORD_BYTES
            self._words[scratch // 8] = p.consumed
            self._reap_credits(p)
            if len(p.credit_writes) >= 4 * self.slots:  # bound the handles in flight
                self._write(p, scratch, p.remote_credit, 8)
            else:
                batch = self._submit_credit(p, scratch)
                if batch >= 0:
                    p.credit_writes.append(batch)
            self._deliver(p, tag, tensors)

    def _poll(self, p: _Peer, item: Pending) -> bool:
        if not item.done:
            if self._closed:
                raise RuntimeError(f"M2N communicator of rank {self.rank} is closed")
            self._progress_sends(p)
            self._progress_recvs(p)
        return item.done

    def _block(self, p: _Peer, item: Pending, deadline: float) -> bool:
        spin_end = time.monotonic() + _SPIN_S
        sleep_s = 10e-6
        while not self._poll(p, item):
            now = time.monotonic()
            if now > deadline:
                return False
            if now > spin_end:
                # Sleeping on the peer's pidfd: a death wakes the wait at once, short (sliced) waits included.
                if not p.watch.sleep(sleep_s) and not self._poll(p, item):
                    raise self._peer_error(p.rank, f"process {p.watch.pid} exited")
                sleep_s = min(2 * sleep_s, _SLEEP_MAX_S)
        return True
