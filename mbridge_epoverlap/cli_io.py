"""Standard output that survives its reader leaving, so exit codes keep their meaning.

`validate ... | head -n 1` closes the pipe after one line; the command must still finish and exit 0
for a valid config (1 means "invalid", 2 "usage error"). Inside `reader_may_leave()`, a write to a
closed pipe sends the rest of the output to /dev/null instead of raising `BrokenPipeError`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class _PipeGuard:
    """A stdout proxy: writes pass through until the reader is gone, then go nowhere."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._discard_rest()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._discard_rest()

    def _discard_rest(self) -> None:
        self.reader_gone = True
        # Point the descriptor at /dev/null so the interpreter's own flush at exit cannot fail either.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # not a real file (tests capture stdout)
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def reader_may_leave() -> Iterator[_PipeGuard]:
    """Guard `sys.stdout` against a closed pipe for the duration of the block."""
    original = sys.stdout
    guard = _PipeGuard(original)
    sys.stdout = guard  # type: ignore[assignment]
    try:
        yield guard
        guard.flush()
    finally:
        sys.stdout = original
