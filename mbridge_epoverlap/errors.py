"""Exceptions shared by every part of the project.

A user error (bad flag, bad override, unknown name, impossible layout, unreadable file) is a
`UsageError`: command-line front ends print its message without a traceback and exit with 2.
"""

from __future__ import annotations

# Exit statuses of every command and process the project starts; each has one meaning.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_COMM = 3  # a rank stopped because a collective failed or timed out (a peer died), not by itself
EXIT_NO_BRIDGE = 4  # a GPU job found no importable Megatron-Bridge on its node


class UsageError(ValueError):
    """Input a user can fix; the message names the setting and the fix."""


class RunFailedError(RuntimeError):
    """A launched run (local ranks or a cluster job) failed; the message says which part and why."""
