"""The exception a failed or timed-out collective turns into.

Workers exit with `EXIT_COMM` on it (one of the exit statuses in `mbridge_epoverlap.errors`), so the
launcher can tell a rank that failed by itself from one that only lost its peer.
"""

from __future__ import annotations

from mbridge_epoverlap.errors import EXIT_COMM

__all__ = ["EXIT_COMM", "CommError"]


class CommError(RuntimeError):
    """A collective failed or timed out (usually because a peer rank died or hung)."""

