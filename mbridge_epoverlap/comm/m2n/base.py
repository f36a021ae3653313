"""The M2N interface every backend implements: non-blocking send and receive of tensor messages between ranks.

A communicator belongs to one rank and talks to a fixed set of peer ranks. Everything (buffers, connections,
process groups) is set up once in the constructor; `isend`/`irecv` only start work and return a `Work` handle,
whose `wait` has a timeout and raises `PeerError` naming the peer when the peer is dead, `PeerTimeout` (a
`PeerError`) when it was too slow.

What a backend can do beyond the interface is a class attribute of its communicator class, so callers ask the
class (`comm.m2n.communicator_class(name)`) rather than keep a list of backend names: `resumable_wait` (a wait
that timed out can be waited on again), `connects_late` (`connect` opens a channel to a process that starts
after set-up).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from mbridge_epoverlap.comm.errors import CommError


class PeerError(CommError):
    """A peer rank is dead, or did not send/receive within the timeout (then the subclass `PeerTimeout`).

    Attributes:
        peer: the peer's rank.
        role: what the peer is to the caller, if known (e.g. "expert worker").
    """

    def __init__(self, peer: int, what: str, role: str | None = None) -> None:
        self.peer = peer
        self.role = role
        name = f"{role} rank {peer}" if role else f"rank {peer}"
        super().__init__(f"M2N peer {name}: {what}")


class PeerTimeout(PeerError):
    """A wait ran out of its time: the peer may still be alive (on a backend with `resumable_wait` the same
    `Work` can be waited on again)."""


class Work:
    """The completion handle of one `isend` or `irecv`.

    The backend supplies `poll` (make progress without blocking; True once complete) and `block` (make
    progress, waiting up to a deadline; True once complete). The result is `None` for a send and the
    received tensors for a receive.
    """

    def __init__(self, peer: int, what: str, poll: Callable[[], bool], block: Callable[[float], bool],
                 result: Callable[[], list[torch.Tensor] | None], default_timeout_s: float,
                 role: str | None = None) -> None:
        self._peer, self._what, self._role = peer, what, role
        self._poll, self._block, self._result = poll, block, result
        self._timeout_s = default_timeout_s
        self._complete = False

    def done(self) -> bool:
        """True once the operation completed (progresses it without blocking)."""
        if not self._complete:
            self._complete = self._poll()
        return self._complete

    def wait(self, timeout_s: float | None = None) -> list[torch.Tensor] | None:
        """Block until complete; return None for a send, the tensors (owned by the caller) for a receive.

        Raises:
            PeerError: the peer died.
            PeerTimeout: the operation did not complete within `timeout_s` (default: the communicator's
                timeout).
        """
        if not self._complete:
            limit = self._timeout_s if timeout_s is None else timeout_s
            if not self._block(time.monotonic() + limit):
                raise PeerTimeout(self._peer, f"{self._what} did not complete within {limit:g} s", self._role)
            self._complete = True
        return self._result()


class M2NCommunicator(abc.ABC):
    """One rank's end of an M2N exchange with a fixed set of peers.

    Attributes:
        backend: the backend's name.
        rank: this rank.
        peers: the ranks it exchanges messages with.
        slot_bytes: the largest message payload it carries.
        timeout_s: the default limit of every wait.

    Class attributes (what the backend can do):
        resumable_wait: a `Work.wait` that raised `PeerTimeout` can be waited on again (sliced waits).
        connects_late: `connect` opens a channel to a process that starts after set-up (a replacement).
    """

    memory_role: ClassVar[str] = "buffers"  # what `mbridge_epoverlap.memory` counts its tensors as

    backend: str = ""
    resumable_wait: bool = False
    connects_late: bool = False

    def __init__(self, *, rank: int, peers: Sequence[int], slot_bytes: int, slots: int, timeout_s: float,
                 roles: dict[int, str] | None = None) -> None:
        self.rank = rank
        self.peers = tuple(sorted(set(peers)))
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.timeout_s = timeout_s
        self.roles = dict(roles or {})
        self._closed = False

    @abc.abstractmethod
    def isend(self, peer: int, tensors: Sequence[torch.Tensor], tag: int = 0) -> Work:
        """Start sending `tensors` to `peer` as one message; they must not change until the send completes.

        Raises:
            UsageError: the message is larger than `slot_bytes` (or has unsupported tensors), or `peer` is
                not one of `peers`.
        """

    @abc.abstractmethod
    def irecv(self, peer: int, tag: int = 0) -> Work:
        """Start receiving the next message with `tag` from `peer`; `wait()` returns its tensors."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every buffer, segment and connection (idempotent)."""

    def connect(self, peer: int, store: Any, key_prefix: str) -> None:
        """Open (or re-open) the channel to `peer`, a process that starts after this communicator: a replacement
        of a lost peer rank, or a rank that was not a peer. It creates its communicator with `key_prefix`, this
        rank among its peers and the same settings; both sides meet in `store`. Call it where no message to or
        from `peer` is in flight (a step boundary); messages pending to the old process are dropped.

        Raises:
            UsageError: the backend cannot open channels after set-up.
            PeerError: `peer` did not join within the timeout.
        """
        from mbridge_epoverlap.errors import UsageError

        raise UsageError(f"the {self.backend} M2N backend cannot open a channel after set-up (a replacement worker "
                         "joining back needs it); use backend shm or mooncake (or m2n)")

    def __enter__(self) -> M2NCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _peer_error(self, peer: int, what: str) -> PeerError:
        return PeerError(peer, what, self.roles.get(peer))

    def _peer_timeout(self, peer: int, what: str) -> PeerTimeout:
        return PeerTimeout(peer, what, self.roles.get(peer))

    def _work(self, peer: int, what: str, poll: Callable[[], bool], block: Callable[[float], bool],
              result: Callable[[], list[torch.Tensor] | None]) -> Work:
        return Work(peer, what, poll, block, result, self.timeout_s, self.roles.get(peer))

    def _check_peer(self, peer: int) -> None:
        from mbridge_epoverlap.errors import UsageError

        if self._closed:
            raise RuntimeError(f"M2N communicator of rank {self.rank} is closed")
        if peer not in self.peers:
            raise UsageError(f"rank {peer} is not a peer of rank {self.rank} (peers: {list(self.peers)}): "
                             "pass it in `peers` when creating the communicator")
