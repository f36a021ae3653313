"""Finding trace files and telling their format from their first bytes (not their names)."""

from __future__ import annotations

import gzip
import os
import re
from typing import BinaryIO

from mbridge_epoverlap.errors import UsageError

TRACE_SUFFIXES = (".sqlite", ".sqlite.gz", ".json", ".json.gz")
_RANK_IN_NAME = re.compile(r"rank[-_.]?(\d+)", re.IGNORECASE)
_GZIP_MAGIC = b"\x1f\x8b"
_SQLITE_MAGIC = b"SQLite format 3\x00"


def rank_from_filename(path: str) -> int | None:
    """Rank from names like `trace_rank-3.json.gz` or `rank3.sqlite`, else None."""
    m = _RANK_IN_NAME.search(os.path.basename(path))
    return int(m.group(1)) if m else None


def expand(path: str) -> list[str]:
    """The trace files a command-line argument names: the file itself, or a folder's traces.

    Raises:
        UsageError: The path does not exist, or a folder holds no trace files.
    """
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file or directory; pass a trace file or a folder of per-rank traces")
    if not os.path.isdir(path):
        return [path]
    found = [
        os.path.join(path, name)
        for name in os.listdir(path)
        if name.lower().endswith(TRACE_SUFFIXES) and os.path.isfile(os.path.join(path, name))
    ]
    if not found:
        raise UsageError(
            f"{path}: folder holds no trace files (*.sqlite, *.sqlite.gz, *.json, *.json.gz); pass the folder the "
            "ranks wrote to"
        )

    def order(p: str) -> tuple[int, str]:
        rank = rank_from_filename(p)
        return (rank if rank is not None else 1 << 30, os.path.basename(p))

    return sorted(found, key=order)


def sniff(path: str) -> str:
    """Format of a trace file from its first bytes: "nsys" (SQLite) or "kineto" (JSON, plain or gzip).

    Raises:
        UsageError: The file is empty, unreadable or neither format.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror}); check the path and its permissions") from None
    if not head:
        raise UsageError(f"{path}: empty file; the profiler did not finish writing it, profile again")
    if head.startswith(_SQLITE_MAGIC):
        return "nsys"
    if head.startswith(_GZIP_MAGIC):
        try:
            with gzip.open(path, "rb") as fh:
                inner = fh.read(len(_SQLITE_MAGIC))
        except (OSError, EOFError) as exc:
            raise UsageError(f"{path}: damaged gzip file ({exc}); compress the trace again") from None
        return "nsys" if inner.startswith(_SQLITE_MAGIC) else "kineto"
    if head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{"):
        return "kineto"
    raise UsageError(
        f"{path}: not a trace (expected an Nsight Systems SQLite export or a PyTorch/Kineto JSON trace, "
        "optionally .gz); convert .nsys-rep files with `nsys export --type sqlite`"
    )


def is_gzip(path: str) -> bool:
    """Whether a file is gzip-compressed (from its first bytes)."""
    with open(path, "rb") as fh:
        return fh.read(2) == _GZIP_MAGIC


def open_binary(path: str) -> BinaryIO:
    """The decompressed byte stream of a plain or gzip file."""
    with open(path, "rb") as fh:
        gz = fh.read(2) == _GZIP_MAGIC
    return gzip.open(path, "rb") if gz else open(path, "rb")  # noqa: SIM115 - caller closes
