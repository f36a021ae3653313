"""A tiny per-rank status file (memory-mapped) that the launcher reads to tell a hung rank from a waiting one.

Each rank writes, before every schedule step, its iteration, step index, whether it is communicating,
and the time. When a run fails, a rank that was computing (not waiting in a collective) and stopped
advancing is the one that hung; the others were waiting for it.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

DIR_ENV = "MBRIDGE_EPOVERLAP_HEARTBEAT_DIR"  # set by the launcher: where each rank writes its heartbeat file
_FORMAT = "<qqqqd"  # pid, iteration, step, state, unix time
_SIZE = struct.calcsize(_FORMAT)

STARTING, COMPUTE, COMM, OTHER, DONE = range(5)
STATE_NAMES = {STARTING: "starting", COMPUTE: "computing", COMM: "communicating", OTHER: "between steps",
               DONE: "done"}


@dataclass(frozen=True)
class Beat:
    """The last status a rank wrote."""

    pid: int
    iteration: int
    step: int
    state: int
    time: float

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, "unknown")


def heartbeat_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"heartbeat.rank{rank}"


class Heartbeat:
    """Writer side; a no-op when `path` is None."""

    def __init__(self, path: Path | None) -> None:
        self._map: mmap.mmap | None = None
        if path is None:
            return
        with open(path, "wb") as f:
            f.write(b"\0" * _SIZE)
        self._file = open(path, "r+b")  # noqa: SIM115 - kept open for the mapping's lifetime
        self._map = mmap.mmap(self._file.fileno(), _SIZE)
        self.beat(0, 0, STARTING)

    def beat(self, iteration: int, step: int, state: int) -> None:
        if self._map is not None:
            struct.pack_into(_FORMAT, self._map, 0, os.getpid(), iteration, step, state, time.time())

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._file.close()
            self._map = None


def read_beat(path: Path) -> Beat | None:
    """The last beat in `path`, or None if there is none yet."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _SIZE:
        return None
    return Beat(*struct.unpack_from(_FORMAT, data))
