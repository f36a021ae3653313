"""What the backends share for setting up: the one-time exchange through a key-value store, and peer liveness.

Every rank publishes a small JSON record (its pid, host, buffer names or addresses) under its own key, reads
its peers' records, and, once it has attached to them, says so, so that a rank can drop names (shared-memory
segments, FIFOs) that everyone has opened. A store wait that times out names the peer that did not show up.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from mbridge_epoverlap.comm.m2n.base import PeerTimeout


def _wait_key(store: Any, key: str, deadline: float) -> None:
    remaining = max(0.01, deadline - time.monotonic())
    store.wait([key], timedelta(seconds=remaining))


class Rendezvous:
    """Publish and fetch per-rank records under `prefix` in `store`, with a deadline naming the late peer."""

    def __init__(self, store: Any, prefix: str, rank: int, timeout_s: float, roles: dict[int, str]) -> None:
        self.store, self.prefix, self.rank, self.timeout_s, self.roles = store, prefix, rank, timeout_s, roles

    def publish(self, record: dict[str, Any], phase: str = "info") -> None:
        self.store.set(f"{self.prefix}/{phase}/{self.rank}", json.dumps(record))

    def fetch(self, peers: Sequence[int], phase: str = "info") -> dict[int, dict[str, Any]]:
        """Every peer's record of `phase`; PeerTimeout naming the first peer missing at the deadline."""
        deadline = time.monotonic() + self.timeout_s
        out = {}
        for peer in peers:
            key = f"{self.prefix}/{phase}/{peer}"
            try:
                _wait_key(self.store, key, deadline)
            except Exception as exc:  # the store's own timeout type differs between versions
                raise PeerTimeout(peer, f"did not join the M2N set-up within {self.timeout_s:g} s "
                                      f"(waiting for '{key}': {exc})", self.roles.get(peer)) from None
            out[peer] = json.loads(self.store.get(key))
        return out

    def barrier(self, peers: Sequence[int], phase: str) -> None:
        """Say this rank reached `phase`; return once every peer did."""
        self.publish({}, phase)
        self.fetch(peers, phase)


def this_host() -> str:
    return socket.gethostname()


class PeerWatch:
    """Tells whether a peer process on this host is still alive, and gives a file descriptor to poll on.

    Uses a pidfd (readable once the process exits, zombie or not) where the kernel has them; otherwise
    reads /proc. A peer on another host is assumed alive (its death shows up as a timeout or a failed
    transfer).
    """

    def __init__(self, pid: int, host: str) -> None:
        self.pid = pid
        self.local = host == this_host()
        self.fd: int | None = None
        if self.local and hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                self.fd = os.pidfd_open(pid)

    def alive(self) -> bool:
        if not self.local:
            return True
        if self.fd is not None:
            ready, _, _ = select.select([self.fd], [], [], 0)
            return not ready
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False

    def sleep(self, seconds: float) -> bool:
        """Sleep up to `seconds`, waking at once if the peer exits (on its pidfd); whether it is still alive."""
        if self.fd is None:
            time.sleep(seconds)
            return self.alive()
        ready, _, _ = select.select([self.fd], [], [], seconds)
        return not ready

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
