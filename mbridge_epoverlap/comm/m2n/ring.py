"""What the ring backends (`shm`, `mooncake`) share: per-peer queues of pending sends and receives, and
receives matched to messages by tag.

Each peer's messages arrive in order through a ring of slots; a receive names a tag, so a message whose
receive is not posted yet waits in the peer's stash. The backends differ only in how bytes reach the
peer's slot and how a wait sleeps (`_progress_sends`, `_progress_recvs`, `_poll`, `_block`).
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mbridge_epoverlap.comm.m2n import wire
from mbridge_epoverlap.comm.m2n.base import M2NCommunicator, PeerError, Work


@dataclass
class Pending:
    """A posted send (its tensors until written) or receive (its result once matched)."""

    tag: int
    tensors: Sequence[torch.Tensor] | None = None
    done: bool = False
    result: list[torch.Tensor] | None = None


class RingCommunicator(M2NCommunicator):
    """`isend`/`irecv` over per-peer records with `sends` (a deque of `Pending`), `recvs` (a list) and `stash`
    (tag -> deque of messages), and `capacity` (the peer's slot bytes)."""

    def _peer(self, peer: int) -> Any:
        """The record of a peer `_check_peer` accepted."""
        return self._peers[peer]

    def isend(self, peer: int, tensors: Sequence[torch.Tensor], tag: int = 0) -> Work:
        self._check_peer(peer)
        p = self._peer(peer)
        wire.check_message(tensors, min(self.slot_bytes, p.capacity))
        item = Pending(tag, tuple(tensors))
        p.sends.append(item)
        try:
            self._progress_sends(p)
        except PeerError as exc:  # a dead peer is the wait's error, as on every backend (`isend` only starts)
            error = exc

            def failed(*_: Any) -> bool:
                raise error

            return self._work(peer, f"send (tag {tag}) to rank {peer}", failed, failed, lambda: None)
        return self._work(peer, f"send (tag {tag}) to rank {peer}", lambda: self._poll(p, item),
                          lambda deadline: self._block(p, item, deadline), lambda: None)

    def irecv(self, peer: int, tag: int = 0) -> Work:
        self._check_peer(peer)
        p = self._peer(peer)
        item = Pending(tag)
        p.recvs.append(item)
        return self._work(peer, f"receive (tag {tag}) from rank {peer}", lambda: self._poll(p, item),
                          lambda deadline: self._block(p, item, deadline), lambda: item.result)

    @staticmethod
    def _take_stashed(p: Any) -> None:
        """Complete the posted receives whose message arrived earlier (for another receive) and drop them."""
        for item in p.recvs:
            queue = p.stash.get(item.tag)
            if queue:
                item.result, item.done = queue.popleft(), True
        p.recvs = [r for r in p.recvs if not r.done]

    @staticmethod
    def _deliver(p: Any, tag: int, tensors: list[torch.Tensor]) -> None:
        """A message read from the ring: to the oldest posted receive of its tag, else into the stash."""
        for i, item in enumerate(p.recvs):
            if item.tag == tag:
                item.result, item.done = tensors, True
                del p.recvs[i]
                return
        p.stash.setdefault(tag, collections.deque()).append(tensors)

    @abc.abstractmethod
    def _progress_sends(self, p: Any) -> None:
        """Write queued sends into the peer's free slots."""

    @abc.abstractmethod
    def _poll(self, p: Any, item: Pending) -> bool:
        """Make progress without waiting; whether `item` is done."""

    @abc.abstractmethod
    def _block(self, p: Any, item: Pending, deadline: float) -> bool:
        """Wait until `item` is done or `deadline` (monotonic) passes; whether it is done."""
