"""Benchmark of the profile analyzer against a straightforward pure-Python sort-and-sweep.

Builds a synthetic Nsight Systems SQLite export shaped like the skill card's rank-0 window (463,348
kernels over 2 GPUs: GEMMs and elementwise kernels on the compute stream, DeepEP dispatch/combine on
a separate communication stream overlapping them, some memcpys) and a Kineto JSON trace holding the
same kernels. Then, alternating A B A B:

* A: `mbridge-epoverlap profile FILE --json` as a subprocess (interpreter start-up included), its
  wall time and peak RSS (from `wait4`);
* B: the straightforward way in this process: read every row into Python tuples, classify, sort,
  sweep; its wall time and peak RSS (VmHWM, reset before each run where Linux allows).

Reports medians, the ratio A/B, whether both give the same figures, and the machine. The Kineto
file is analysed for time and peak RSS; `--kineto-gb 1.0` pads it with CPU-side events to about
1 GB to check the streaming reader stays under 1 GiB.

    python benchmarks/profile_analyzer_bench.py                 # ~1-2 minutes
    python benchmarks/profile_analyzer_bench.py --kineto-gb 1.0 # adds the 1 GB streaming check
    python benchmarks/profile_analyzer_bench.py --quick         # small traces (benchmarks/run_all.py)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.machine import cpu_model  # noqa: E402

COMPUTE_STREAM, COMM_STREAM = 7, 20
COMM_NAMES = [
    "void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*, int const*, int)",
    "void deep_ep::intranode::combine<__nv_bfloat16, 8, 768>(__nv_bfloat16*, float*, int const*, int)",
    "void deep_ep::internode_ll::dispatch<true, 3, 7168>(void*, float*, int*, long*, int)",
    "void deep_ep::internode_ll::combine<false, 3, 7168>(void*, int*, long*, int)",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
]
GEMM_NAMES = [f"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize{64 * (i % 4 + 1)}x128x64_{i}" for i in range(40)]
COMPUTE_NAMES = GEMM_NAMES + [
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int, float*)",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>(float*)",
    "flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>",
    "void transformer_engine::permute_kernel<__nv_bfloat16>(__nv_bfloat16 const*, int*)",
]
COMM_RE = re.compile(r"(?:^|\s|::)(?:nccl|deep_ep|hybrid_ep|dpsk::ep|gloo:)", re.IGNORECASE)


# --------------------------------------------------------------------------------------------------
# Synthetic traces


def synth_kernels(n: int, devices: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Kernel columns: start, end (ns), device, stream, name id (into COMM_NAMES + COMPUTE_NAMES)."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("start", "end", "device", "stream", "name")}
    per_dev = [n // devices + (1 if d < n % devices else 0) for d in range(devices)]
    for dev, count in enumerate(per_dev):
        n_comm = count // 5
        n_comp = count - n_comm
        comp_dur = rng.integers(2_000, 60_000, n_comp)
        comp_start = 1_000_000 + np.cumsum(comp_dur + rng.integers(200, 8_000, n_comp)) - comp_dur
        span = int(comp_start[-1] + comp_dur[-1])
        comm_start = np.sort(rng.integers(1_000_000, span, n_comm))
        comm_dur = rng.integers(5_000, 120_000, n_comm)
        cols["start"] += [comp_start, comm_start]
        cols["end"] += [comp_start + comp_dur, comm_start + comm_dur]
        cols["device"] += [np.full(count, dev)]
        cols["stream"] += [np.full(n_comp, COMPUTE_STREAM), np.full(n_comm, COMM_STREAM)]
        cols["name"] += [
            len(COMM_NAMES) + rng.integers(0, len(COMPUTE_NAMES), n_comp),
            rng.integers(0, len(COMM_NAMES), n_comm),
        ]
    out = {k: np.concatenate(v).astype(np.int64) for k, v in cols.items()}
    order = np.argsort(out["start"], kind="stable")  # exports list kernels roughly in time order
    return {k: v[order] for k, v in out.items()}


def write_sqlite(path: Path, k: dict[str, np.ndarray], pid0: int = 4242) -> None:
    """Nsight-shaped export: StringIds, CUPTI_ACTIVITY_KIND_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, NVTX_EVENTS."""
    path.unlink(missing_ok=True)
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    con.execute(
        "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER, "
        "contextId INTEGER, streamId INTEGER, correlationId INTEGER, globalPid INTEGER, demangledName INTEGER, "
        "shortName INTEGER, gridX INTEGER, blockX INTEGER)"
    )
    con.execute(
        "CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER, "
        "streamId INTEGER, globalPid INTEGER, bytes INTEGER, copyKind INTEGER)"
    )
    con.execute(
        "CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, "
        "text TEXT, globalTid INTEGER, textId INTEGER)"
    )
    names = COMM_NAMES + COMPUTE_NAMES
    short = [re.sub(r"^void\s+", "", n).split("<")[0].split("(")[0].split("::")[-1] for n in names]
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", enumerate(names + short))
    gpid = (pid0 + k["device"]) << 24
    rows = zip(
        k["start"].tolist(),
        k["end"].tolist(),
        k["device"].tolist(),
        [1] * k["start"].size,
        k["stream"].tolist(),
        range(k["start"].size),
        gpid.tolist(),
        k["name"].tolist(),
        (k["name"] + len(names)).tolist(),
        [128] * k["start"].size,
        [256] * k["start"].size,
        strict=True,
    )
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)
    memcpy_at = k["start"][:: max(1, k["start"].size // 2000)]
    con.executemany(
        "INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?,?,?,?,?,?,?)",
        [(int(t) - 1500, int(t) - 500, i % 2, 3, (pid0 + i % 2) << 24, 4096, 1) for i, t in enumerate(memcpy_at)],
    )
    con.commit()
    con.close()


def write_kineto(path: Path, k: dict[str, np.ndarray], target_bytes: int, host_pid: int = 4242) -> int:
    """Kineto JSON with the same kernels (pid = GPU, tid = stream), padded with CPU events to `target_bytes`."""
    names = COMM_NAMES + COMPUTE_NAMES
    quoted = [json.dumps(n) for n in names]
    n = k["start"].size
    with open(path, "w") as fh:
        fh.write('{\n  "schemaVersion": 1,\n  "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 16},\n')
        fh.write('  "traceEvents": [\n')
        written = 0
        block = 50_000
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            parts = []
            for s, e, d, st, nm, corr in zip(
                k["start"][lo:hi].tolist(),
                k["end"][lo:hi].tolist(),
                k["device"][lo:hi].tolist(),
                k["stream"][lo:hi].tolist(),
                k["name"][lo:hi].tolist(),
                range(lo, hi),
                strict=True,
            ):
                dur = e - s
                parts.append(
                    f'  {{"ph": "X", "cat": "kernel", "name": {quoted[nm]}, "pid": {d}, "tid": {st}, '
                    f'"ts": {s // 1000}.{s % 1000:03d}, "dur": {dur // 1000}.{dur % 1000:03d}, "args": {{'
                    f'"External id": {corr}, "queued": 0, "device": {d}, "context": 1, "stream": {st}, '
                    f'"correlation": {corr}, "registers per thread": 128, "shared memory": 0, '
                    f'"grid": [132, 1, 1], "block": [256, 1, 1], "est. achieved occupancy %": 12}}}},\n'
                )
            text = "".join(parts)
            fh.write(text)
            written += len(text)
        # CPU-side padding: launches and ops, the bulk of a real trace.
        i = 0
        t0 = int(k["start"][0])
        pad_names = ["aten::mm", "aten::add_", "aten::empty", "cudaLaunchKernel", "aten::copy_", "aten::view"]
        while written < target_bytes:
            parts = []
            for j in range(i, i + block):
                ts = t0 + j * 900
                cat = "cuda_runtime" if j % 3 == 0 else "cpu_op"
                parts.append(
                    f'  {{"ph": "X", "cat": "{cat}", "name": "{pad_names[j % len(pad_names)]}", "pid": {host_pid}, '
                    f'"tid": {host_pid}, "ts": {ts // 1000}.{ts % 1000:03d}, "dur": 0.700, "args": {{'
                    f'"External id": {j}, "Record function id": 0, "Ev Idx": {j}, '
                    f'"Input Dims": [[4096, 7168], [7168, 2048]], "Input type": ["c10::BFloat16", "c10::BFloat16"], '
                    f'"Concrete Inputs": ["", ""]}}}},\n'
                )
            i += block
            text = "".join(parts)
            fh.write(text)
            written += len(text)
        # Last event without a trailing comma, then the footer.
        fh.write(
            f'  {{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "pid": {host_pid}, '
            f'"tid": {host_pid}, "ts": {t0 // 1000}, "dur": 1.0, "args": {{}}}}\n'
        )
        fh.write('  ],\n  "traceName": "synthetic"\n}\n')
    return path.stat().st_size


# --------------------------------------------------------------------------------------------------
# The straightforward way


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    intervals.sort()
    merged: list[tuple[int, int]] = []
    for s, e in intervals:
        if e <= s:
            continue
        if merged and s <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def straightforward(path: Path) -> dict[tuple[int, int], dict[str, int]]:
    """Read all rows as tuples, classify, sort, sweep; figures per (pid, device)."""
    con = sqlite3.connect(path)
    rows = con.execute(
        "SELECT k.start, k.end, k.deviceId, k.globalPid, s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k "
        "LEFT JOIN StringIds s ON s.id = k.demangledName"
    ).fetchall()
    mem = con.execute("SELECT start, end, deviceId, globalPid FROM CUPTI_ACTIVITY_KIND_MEMCPY").fetchall()
    con.close()
    cache: dict[str, bool] = {}
    lanes: dict[tuple[int, int], dict[str, list[tuple[int, int]]]] = {}
    for s, e, dev, gpid, name in rows:
        lane = lanes.setdefault(((gpid >> 24) & 0xFFFFFF, dev), {"comm": [], "compute": [], "all": []})
        is_comm = cache.get(name)
        if is_comm is None:
            is_comm = cache[name] = bool(COMM_RE.search(name or ""))
        lane["comm" if is_comm else "compute"].append((s, e))
        lane["all"].append((s, e))
    for s, e, dev, gpid in mem:
        lanes.setdefault(((gpid >> 24) & 0xFFFFFF, dev), {"comm": [], "compute": [], "all": []})["all"].append((s, e))
    out = {}
    for key, lane in lanes.items():
        comm, compute, everything = _merge(lane["comm"]), _merge(lane["compute"]), _merge(lane["all"])
        overlap = _overlap(comm, compute)
        out[key] = {
            "kernels": len(lane["comm"]) + len(lane["compute"]),
            "comm_ns": sum(e - s for s, e in comm),
            "compute_ns": sum(e - s for s, e in compute),
            "overlap_ns": overlap,
            "active_ns": sum(e - s for s, e in everything),
        }
    return out


# --------------------------------------------------------------------------------------------------
# Measuring


# Children inherit the peak RSS of the process that forks them (Linux keeps it across exec), so the
# analyzer is started from this small launcher, itself started before the benchmark allocates.
_LAUNCHER = r"""
import json, os, subprocess, sys, time
for line in sys.stdin:
    req = json.loads(line)
    with open(req["out"], "wb") as out, open(req["err"], "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(req["cmd"], stdout=out, stderr=err, cwd=req["cwd"])
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    reply = {"rc": os.waitstatus_to_exitcode(status), "wall": wall, "maxrss_kb": usage.ru_maxrss}
    print(json.dumps(reply), flush=True)
"""


class Launcher:
    """Runs commands from a fresh, small process and reports wall time and peak RSS (`wait4`)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _LAUNCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def run(self, cmd: list[str], out: Path, err: Path) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, "out": str(out), "err": str(err), "cwd": str(REPO)}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def run_cli(launcher: Launcher, trace: Path, work: Path) -> tuple[float, int, dict]:
    """Wall seconds, peak RSS (bytes) and JSON output of the analyzer CLI as a subprocess."""
    cmd = [sys.executable, "-m", "mbridge_epoverlap.cli", "profile", str(trace), "--json"]
    out, err = work / "cli.out", work / "cli.err"
    reply = launcher.run(cmd, out, err)
    if reply["rc"] != 0:
        raise SystemExit(f"analyzer failed ({reply['rc']}): {err.read_text()[-2000:]}")
    return reply["wall"], reply["maxrss_kb"] * 1024, json.loads(out.read_text())


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_straightforward(trace: Path) -> tuple[float, int | None, dict]:
    """Wall seconds, peak RSS (None where it cannot be reset) and figures of the pure-Python sweep."""
    can_reset = _reset_peak_rss()
    t0 = time.perf_counter()
    figures = straightforward(trace)
    wall = time.perf_counter() - t0
    return wall, _peak_rss() if can_reset else None, figures


def same_figures(cli: dict, ref: dict[tuple[int, int], dict[str, int]]) -> bool:
    devices = cli["traces"][0]["devices"]
    if len(devices) != len(ref):
        return False
    for d in devices:
        want = ref.get((d["pid"], d["device"]))
        if want is None or any(d[k] != v for k, v in want.items()):
            return False
    return True


def machine() -> dict[str, str]:
    model = cpu_model(platform.processor() or "unknown")
    return {
        "nproc": str(os.cpu_count()),
        "cpu": model,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "sqlite": sqlite3.sqlite_version,
    }


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=463_348, help="kernels in the synthetic traces")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per side (medians reported)")
    parser.add_argument(
        "--kineto-gb", type=float, default=0.0, help="pad the Kineto file to this size in GB (0: kernels only)"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where to write the traces (default: temp dir)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--quick", action="store_true", help="50,000 kernels, one run per side (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.kernels, args.runs = min(args.kernels, 50_000), 1
    launcher = Launcher()

    tmp = tempfile.TemporaryDirectory(prefix="profile_bench_") if args.workdir is None else None
    work = Path(tmp.name) if tmp else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        kernels = synth_kernels(args.kernels, args.devices)
        sqlite_path = work / "synthetic_rank0.sqlite"
        write_sqlite(sqlite_path, kernels)
        kineto_path = work / "synthetic_rank0.json"
        kineto_size = write_kineto(kineto_path, kernels, int(args.kineto_gb * 1e9))
        build_s = time.perf_counter() - t0

        cli_t, cli_rss, base_t, base_rss = [], [], [], []
        cli_out = ref = None
        for _ in range(args.runs):
            t, rss, cli_out = run_cli(launcher, sqlite_path, work)
            cli_t.append(t)
            cli_rss.append(rss)
            t, rss, ref = run_straightforward(sqlite_path)
            base_t.append(t)
            base_rss.append(rss)
        kin_t, kin_rss = [], []
        kin_out = None
        for _ in range(max(1, args.runs - 1) if kineto_size > 5e8 else args.runs):
            t, rss, kin_out = run_cli(launcher, kineto_path, work)
            kin_t.append(t)
            kin_rss.append(rss)
    finally:
        launcher.close()
        if tmp:
            tmp.cleanup()

    cli_med, base_med = statistics.median(cli_t), statistics.median(base_t)
    kin_devices = {(d["device"]): d for d in kin_out["traces"][0]["devices"]}
    kineto_matches = all(
        all(kin_devices[d["device"]][k] == d[k] for k in ("kernels", "comm_ns", "compute_ns", "overlap_ns"))
        for d in cli_out["traces"][0]["devices"]
    )
    result = {
        "machine": machine(),
        "kernels": args.kernels,
        "devices": args.devices,
        "runs": args.runs,
        "build_s": round(build_s, 2),
        "sqlite": {
            "analyzer_cli_s": round(cli_med, 3),
            "analyzer_peak_rss_mib": round(max(cli_rss) / 2**20, 1),
            "straightforward_s": round(base_med, 3),
            "straightforward_peak_rss_mib": None
            if any(r is None for r in base_rss)
            else round(max(base_rss) / 2**20, 1),
            "ratio": round(cli_med / base_med, 3),
            "target_ratio_max": 0.5,
            "same_figures": same_figures(cli_out, ref),
            "analyzer_runs_s": [round(t, 3) for t in cli_t],
            "straightforward_runs_s": [round(t, 3) for t in base_t],
        },
        "kineto": {
            "file_mb": round(kineto_size / 1e6, 1),
            "analyzer_cli_s": round(statistics.median(kin_t), 3),
            "analyzer_peak_rss_mib": round(max(kin_rss) / 2**20, 1),
            "rss_limit_mib": 1024,
            "same_figures_as_sqlite": kineto_matches,
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    m = result["machine"]
    s, k = result["sqlite"], result["kineto"]
    print(f"machine: {m['nproc']} CPUs, {m['cpu']}; Python {m['python']}, numpy {m['numpy']}, SQLite {m['sqlite']}")
    print(f"traces: {args.kernels:,} kernels over {args.devices} GPUs (built in {build_s:.1f} s)")
    print(f"medians of {args.runs} alternating runs")
    print("SQLite export:")
    print(f"  analyzer CLI (subprocess, start-up included) {s['analyzer_cli_s']:.3f} s, peak RSS {_mib(max(cli_rss))}")
    base_rss_text = "n/a" if s["straightforward_peak_rss_mib"] is None else _mib(max(base_rss))
    print(f"  straightforward sort-and-sweep (in process)  {s['straightforward_s']:.3f} s, peak RSS {base_rss_text}")
    print(f"  ratio analyzer/straightforward {s['ratio']:.3f} (target <= 0.5); same figures: {s['same_figures']}")
    print(f"Kineto JSON ({k['file_mb']:,.1f} MB):")
    print(f"  analyzer CLI {k['analyzer_cli_s']:.3f} s, peak RSS {_mib(max(kin_rss))} (limit 1024 MiB)")
    print(f"  same figures as the SQLite export: {k['same_figures_as_sqlite']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
