"""Compiling a kernel's C source into a shared library at first use, cached per source, compiler and CPU.

The library is built with the system's C compiler (`$CC`, else `cc`), `-O3 -ffp-contract=off` (no fused
multiply-adds: the kernels promise the same bits on every CPU), `-pthread` and `-march=native` where the compiler
takes it, into `$XDG_CACHE_HOME/mbridge-epoverlap/native/<name>-<key>.so`; the key hashes the source, the compiler
and its version, the flags and the CPU's model and flags, so another machine or source never loads a stale build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-pthread")
COMPILE_TIMEOUT_S = 120


class BuildError(Exception):
    """A kernel's library could not be built or loaded here; the message says why."""


def compiler() -> str | None:
    """The C compiler's path: `$CC` where set, else `cc` or `gcc`; None where there is none."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return shutil.which("cc") or shutil.which("gcc")


@functools.cache
def _toolchain(cc: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(flags, the compiler's version line) for `cc`, asked once per process whatever the number of kernels:
    -march=native where the compiler takes it (loops vectorise to this CPU's widest registers)."""
    probe = subprocess.run([cc, "-march=native", "-E", "-x", "c", "-"], input="", capture_output=True, text=True,
                           timeout=COMPILE_TIMEOUT_S)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=COMPILE_TIMEOUT_S).stdout.splitlines()[:1]
    return (*FLAGS, *(["-march=native"] if probe.returncode == 0 else [])), tuple(version)


def shared_library(source: Path) -> ctypes.CDLL:
    """`source` compiled (or found in the cache) and loaded; raises `BuildError` with the reason otherwise."""
    cc = compiler()
    if cc is None:
        named = os.environ.get("CC")
        raise BuildError(f"CC={named} is not a program here" if named else "no C compiler (install gcc, or set CC)")
    try:
        flags, version = _toolchain(cc)
        from mbridge_epoverlap.machine import cache_dir, cpu_flags, cpu_model

        key = hashlib.sha256("\n".join([source.read_text(), cc, *version, *flags, cpu_model(),
                                        " ".join(sorted(cpu_flags()))]).encode()).hexdigest()[:16]
        path = cache_dir() / "native" / f"{source.stem}-{key}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            # Built beside its final name and renamed: processes starting together never load a half-written file.
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                built = Path(tmp) / path.name
                result = subprocess.run([cc, *flags, "-o", str(built), str(source)], capture_output=True, text=True,
                                        timeout=COMPILE_TIMEOUT_S)
                if result.returncode != 0:
                    raise BuildError(f"{cc} failed on {source.name}: {result.stderr.strip()[-400:]}")
                os.replace(built, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"building {source.name}: {exc}") from exc


def load(source: Path, errors: list[str]) -> ctypes.CDLL | None:
    """`shared_library(source)`, or None with the reason appended to `errors` (a kernel module's record of why it
    does not run here)."""
    try:
        return shared_library(source)
    except BuildError as exc:
        errors.append(str(exc))
        return None


def last_error(errors: list[str]) -> str:
    """The latest reason in a kernel module's `errors`, or "not built" before any attempt."""
    return errors[-1] if errors else "not built"
