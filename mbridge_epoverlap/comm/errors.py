"""The exception a failed or timed-out collective turns into.

Workers exit with a distinct code on it, so the launcher can tell a rank that failed by itself from
one that only lost its peer.
"""

from __future__ import annotations


class CommError(RuntimeError):
    """A collective failed or timed out (usually because a peer rank died or hung)."""


# Exit code of a rank that stopped because a collective failed (as opposed to failing by itself).
EXIT_COMM = 3
