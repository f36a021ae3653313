#!/usr/bin/env python3
"""Run the numerics tests (`pytest -m numerics`) with the CPU math libraries held to each instruction set this
machine can run, so that a numerical claim true on one kind of CPU and false on another fails on every machine.

Which kernel a CPU GEMM runs depends on the ISA the library picks and on the shapes: MKL runs its AVX-512
kernels on Intel CPUs and its generic ones on AMD CPUs whatever they support, oneDNN and ATen's vectorised
paths go as far as the CPU goes. A claim "bit for bit" holds only where both sides run the same kernel on the
same shapes, so the suite's claims are checked under every profile below that this CPU can run:

    as-is                    the libraries as they choose on this machine (`make test`'s main run)
    mkl-avx512               MKL's AVX-512 kernels, an Intel machine's path (avx512f)
    mkl-avx2+onednn-bf16     MKL's AVX2 kernels with oneDNN up to AVX512_CORE_BF16 (avx2)
    avx2-only                MKL, oneDNN and ATen held to AVX2: an AVX2-only machine's paths (avx2)

On a CPU that is not Intel, the MKL profiles preload `scripts/mkl_intel_path.c` (built here with `cc`) so MKL
takes the paths it takes on Intel; where no C compiler exists those profiles fail with that reason (an AMD
machine could not otherwise reproduce an Intel machine's results). Each run prints the ISA each library used.

A profile whose libraries run exactly as an earlier one's (the same ISA reported by MKL, oneDNN and ATen, and the
same MKL vendor path) is not run again: it would run the same kernels. On an AVX2-only CPU the two AVX2 profiles
are one; with `--after-as-is` (`make test`, right after its main run) a profile that equals the libraries as they
are is not run either.

Usage: numerics_under_isas.py [--profiles a,b] [--after-as-is] [--list] [-- PYTEST_ARGS...]; exit 0 when every
profile passed, 1 when one failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbridge_epoverlap.machine import cpu_flags, cpu_model, cpu_vendor, reported_flags  # noqa: E402

SHIM_SOURCE = ROOT / "scripts" / "mkl_intel_path.c"
PROFILE_TIMEOUT_S = 900
PROBE = """
import torch
a = torch.randn(96, 96)
a @ a
(a.bfloat16() @ a.bfloat16())
# A convolution large enough that ATen hands it to oneDNN, which then says which ISA it dispatches to.
torch.nn.functional.conv2d(torch.randn(4, 64, 32, 32), torch.randn(64, 64, 3, 3))
print("ATen:", torch.backends.cpu.get_cpu_capability())
"""


@dataclass(frozen=True)
class Profile:
    """One setting of the CPU math libraries' instruction sets.

    Attributes:
        name: the profile's name on the command line and in the summary.
        env: the variables that hold the libraries to it.
        needs: the CPU flag without which the profile cannot run here.
        mkl_intel_path: MKL must take its Intel paths (a preload on a CPU of another vendor).
    """

    name: str
    env: dict[str, str]
    needs: str | None
    mkl_intel_path: bool


PROFILES = (
    Profile("as-is", {}, None, False),
    Profile("mkl-avx512", {"MKL_ENABLE_INSTRUCTIONS": "AVX512"}, "avx512f", True),
    Profile("mkl-avx2+onednn-bf16", {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
            "avx2", True),
    Profile("avx2-only", {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                          "ATEN_CPU_CAPABILITY": "avx2"}, "avx2", True),
)
DEFAULT_PROFILES = tuple(p.name for p in PROFILES if p.name != "as-is")


class UsageError(Exception):
    """A command-line mistake (exit 2)."""


def build_mkl_intel_path(directory: Path) -> Path:
    """Compile `mkl_intel_path.c` into `directory`; raises RuntimeError naming what is missing."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) to build scripts/mkl_intel_path.c; install gcc "
                           "(`apt-get install gcc`) to run MKL's Intel paths on this CPU")
    library = directory / "libmkl_intel_path.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(SHIM_SOURCE)], check=True,
                   timeout=120)
    return library


def profile_env(profile: Profile, shim: Path | None) -> dict[str, str]:
    env = {**os.environ, **profile.env}
    if profile.mkl_intel_path and shim is not None:
        env["LD_PRELOAD"] = " ".join(filter(None, [str(shim), env.get("LD_PRELOAD", "")]))
    return env


def probe_isas(env: dict[str, str]) -> str:
    """What MKL, oneDNN and ATen report they run under `env` (one line)."""
    result = subprocess.run([sys.executable, "-c", PROBE], env={**env, "MKL_VERBOSE": "1", "ONEDNN_VERBOSE": "1"},
                            capture_output=True, text=True, timeout=120)
    mkl = onednn = aten = "?"
    for line in (result.stdout + result.stderr).splitlines():
        if line.startswith("MKL_VERBOSE oneMKL") and mkl == "?":
            # "... for Intel(R) 64 architecture <the code path>, Lnx ..."
            mkl = line.split(" architecture ", 1)[-1].split(", Lnx", 1)[0]
        elif ",info,cpu,isa:" in line and onednn == "?":
            onednn = line.split("isa:", 1)[1].strip()
        elif line.startswith("ATen:"):
            aten = line.split(":", 1)[1].strip()
    if onednn == "?" and "ONEDNN_MAX_CPU_ISA" in env:
        onednn = f"not used by the probe (capped at {env['ONEDNN_MAX_CPU_ISA']})"
    return f"MKL: {mkl}; oneDNN: {onednn}; ATen: {aten}"


def run_profile(profile: Profile, env: dict[str, str], pytest_args: list[str]) -> tuple[bool, str, float]:
    """(passed, pytest's closing line, seconds) of the numerics tests under `env`."""
    command = [sys.executable, "-m", "pytest", "-q", "-m", "numerics", "-p", "no:cacheprovider", *pytest_args]
    start = time.monotonic()
    try:
        result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                                timeout=PROFILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {PROFILE_TIMEOUT_S} s", time.monotonic() - start
    seconds = time.monotonic() - start
    lines = result.stdout.strip().splitlines()
    closing = lines[-1] if lines else "(no output)"
    if result.returncode != 0:
        print(result.stdout[-6000:], result.stderr[-2000:], sep="\n", flush=True)
    return result.returncode == 0, closing, seconds


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    pytest_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, pytest_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default=",".join(DEFAULT_PROFILES),
                        help=f"comma-separated profiles (default {','.join(DEFAULT_PROFILES)}; known: "
                             f"{', '.join(p.name for p in PROFILES)})")
    parser.add_argument("--after-as-is", action="store_true",
                        help="the suite just ran as-is: skip a profile whose libraries run as they are")
    parser.add_argument("--list", action="store_true", help="print the profiles and which this CPU can run")
    args = parser.parse_args(argv)
    known = {p.name for p in PROFILES}
    unknown = [name for name in args.profiles.split(",") if name not in known]
    if unknown:
        raise UsageError(f"--profiles: unknown profile(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return args, pytest_args


def main(argv: list[str] | None = None) -> int:
    try:
        args, pytest_args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    flags, vendor = cpu_flags(), cpu_vendor()
    print(f"CPU: {cpu_model()} ({vendor}), flags: {' '.join(reported_flags(flags)) or 'none of the reported'}")
    chosen = [p for p in PROFILES if p.name in args.profiles.split(",")]
    if args.list:
        for p in PROFILES:
            can = p.needs is None or p.needs in flags
            print(f"  {p.name:22s} {' '.join(f'{k}={v}' for k, v in p.env.items()) or '(nothing held)'}"
                  f"{'' if can else f'  [not on this CPU: needs {p.needs}]'}")
        return 0
    rows, failed = [], False
    with tempfile.TemporaryDirectory(prefix="numerics-isa-") as tmp:
        shim = None
        if vendor != "GenuineIntel" and any(p.mkl_intel_path for p in chosen):
            try:
                shim = build_mkl_intel_path(Path(tmp))
            except (RuntimeError, subprocess.SubprocessError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
        # (what the libraries report, MKL's vendor path changed) -> the profile that ran them
        ran: dict[tuple[str, bool], str] = {}
        if args.after_as_is:
            ran[(probe_isas(dict(os.environ)), False)] = "as-is (the main run)"
        for profile in chosen:
            if profile.needs is not None and profile.needs not in flags:
                rows.append((profile.name, f"skipped: this CPU has no {profile.needs}", "", 0.0))
                continue
            env = profile_env(profile, shim)
            isas = probe_isas(env)
            key = (isas, profile.mkl_intel_path and shim is not None)
            if key in ran:
                rows.append((profile.name, f"skipped: the same libraries as {ran[key]}", isas, 0.0))
                print(f"== {profile.name}: {isas}\n   skipped: the same kernels as {ran[key]}", flush=True)
                continue
            ran[key] = profile.name
            print(f"== {profile.name}: {isas}", flush=True)
            passed, closing, seconds = run_profile(profile, env, pytest_args)
            failed |= not passed
            rows.append((profile.name, closing, isas, seconds))
            print(f"   {closing} ({seconds:.0f} s)", flush=True)
    print("\n| profile | result | libraries | time |\n|---|---|---|---|")
    for name, closing, isas, seconds in rows:
        print(f"| {name} | {closing} | {isas} | {seconds:.0f} s |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
