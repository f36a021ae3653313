"""Exceptions shared by every part of the project.

A user error (bad flag, bad override, unknown name, impossible layout, unreadable file) is a
`UsageError`: command-line front ends print its message without a traceback and exit with 2.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class UsageError(ValueError):
    """Input a user can fix; the message names the setting and the fix."""


class RunFailedError(RuntimeError):
    """A launched run (local ranks or a cluster job) failed; the message says which part and why."""
