"""The machine a measurement ran on: CPU model and count, the CPU flags that decide GEMM speed, host, Python.

Every result that carries figures carries `machine()` beside them (the perf harness's `environment.machine`,
`serve-bench`, `elastic-bench`, `m2n-bench`), so ratios from different machines are not compared by mistake.

The CPU's flags come from /proc/cpuinfo; `MBRIDGE_EPOVERLAP_CPU_FLAGS` (space- or comma-separated flags)
replaces them, so tests and users can try either branch of the CPU dtype choice (`config.cpu_precision`) on
any machine. `cache_dir` is where what is measured or built for this machine is kept. Torch-free.
"""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

CPU_FLAGS_ENV = "MBRIDGE_EPOVERLAP_CPU_FLAGS"
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# The flags that decide CPU GEMM speed, recorded next to every CPU measurement.
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cache_dir() -> Path:
    """The project's cache on this machine: `$XDG_CACHE_HOME/mbridge-epoverlap`, or `~/.cache/mbridge-epoverlap`
    (the online server's measured layouts, the compiled kernels)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mbridge-epoverlap"


def cpu_flags(env: Mapping[str, str] | None = None, cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags: `MBRIDGE_EPOVERLAP_CPU_FLAGS` if set, else the first `flags` line of `cpuinfo`.

    Returns an empty set where neither exists (not Linux).
    """
    env = os.environ if env is None else env
    override = env.get(CPU_FLAGS_ENV)
    if override is not None:
        return frozenset(override.replace(",", " ").split())
    try:
        with open(cpuinfo) as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def reported_flags(flags: Iterable[str]) -> list[str]:
    """The GEMM-relevant flags among `flags`, in a fixed order (what results and docs print)."""
    present = set(flags)
    return [flag for flag in REPORTED_FLAGS if flag in present]


def has_native_bf16(flags: Iterable[str]) -> bool:
    """Whether `flags` include a native bf16 matrix instruction set (`avx512_bf16` or `amx_bf16`)."""
    present = set(flags)
    return any(flag in present for flag in NATIVE_BF16_FLAGS)


def _cpuinfo_field(field: str, fallback: str) -> str:
    """The first `field` line's value in /proc/cpuinfo, or `fallback` where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return fallback


def cpu_model(fallback: str = "unknown") -> str:
    """The CPU's model name from /proc/cpuinfo, or `fallback` where there is none (not Linux)."""
    return _cpuinfo_field("model name", fallback)


def cpu_vendor(fallback: str = "unknown") -> str:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD"): MKL picks its kernels by vendor as well as ISA."""
    return _cpuinfo_field("vendor_id", fallback)


def machine() -> dict[str, Any]:
    """The machine a measurement ran on (reports carry it next to the ratios).

    Keys: `hostname`; `cpu` and `cpu_model` (the same model name: the harness and the serving commands
    read `cpu`, `m2n-bench` reads `cpu_model`); `cpus` and `cores` (the same count, likewise);
    `cpu_flags`, the GEMM-relevant flags present (`avx2`, `avx512f`, `avx512_bf16`, `amx_bf16`), and one
    boolean per such flag; `native_bf16` (whether the CPU has native bf16, which changes CPU step times
    several-fold); `platform`; `python`.
    """
    flags = cpu_flags()
    model = cpu_model()
    count = os.cpu_count()
    return {
        "hostname": socket.gethostname(),
        "cpu": model,
        "cpu_model": model,
        "cpus": count,
        "cores": count,
        "cpu_flags": reported_flags(flags),
        "native_bf16": has_native_bf16(flags),
        **{flag: flag in flags for flag in REPORTED_FLAGS},
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
    }
