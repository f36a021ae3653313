"""What one gloo all-to-all costs on this machine: wall time, and how much of it is CPU work.

Overlap can only hide the part of a collective during which no core of this machine works on it. On
a GPU that is nearly all of it (copy engines and NICs move the bytes); over gloo on loopback the
sending and receiving threads copy every byte through the kernel, so on a machine whose cores all
compute, that CPU work still has to run somewhere and lengthens the compute it overlaps with. This
measures both figures for one message size, with the process's CPU time split by thread:

    python benchmarks/gloo_alltoall_cost.py                   # 2 ranks, 2048 rows x 256 bf16 (1 MiB)
    python benchmarks/gloo_alltoall_cost.py --rows 8192 --hidden 256 --dtype float32

`runtime_overlap_bench.py` uses `measure()` for its ceiling estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.launch import free_port  # noqa: E402


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) per thread of this process, keyed 'name:tid'."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # the thread ended in between
            continue
        out[f"{name}:{tid}"] = (int(stat[11]) + int(stat[12])) / ticks
    return out


def _rank_main(rows: int, hidden: int, dtype_name: str, iters: int, result: Path | None) -> None:
    import torch
    import torch.distributed as dist

    from mbridge_epoverlap.comm.priority import raise_comm_priority
    from mbridge_epoverlap.runtime.options import RuntimeOptions

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # The same thread priorities as the runtime's ranks (MBRIDGE_EPOVERLAP_COMM_NICE, default -10 as root).
    raise_comm_priority(RuntimeOptions.from_env().comm_nice)
    dtype = getattr(torch, dtype_name)
    x = torch.randn(rows, hidden).to(dtype)
    out = torch.empty_like(x)
    for _ in range(max(5, iters // 10)):  # warm up connections and buffers
        dist.all_to_all_single(out, x)
    dist.barrier()
    threads0, cpu0, wall0 = _thread_cpu_s(), time.process_time(), time.perf_counter()
    for _ in range(iters):
        dist.all_to_all_single(out, x)
    wall, cpu, threads1 = time.perf_counter() - wall0, time.process_time() - cpu0, _thread_cpu_s()
    if result is not None:
        by_thread: dict[str, float] = {}
        for key, seconds in threads1.items():
            name = key.split(":")[0]
            by_thread[name] = by_thread.get(name, 0.0) + (seconds - threads0.get(key, 0.0)) / iters * 1e3
        result.write_text(json.dumps({"wall_ms": wall / iters * 1e3, "cpu_ms": cpu / iters * 1e3,
                                      "cpu_ms_by_thread": {k: round(v, 4) for k, v in by_thread.items() if v > 0}}))
    dist.destroy_process_group()


def measure(rows: int = 2048, hidden: int = 256, dtype: str = "bfloat16", procs: int = 2, iters: int = 300,
            timeout_s: float = 120.0) -> dict[str, object]:
    """Run `procs` gloo ranks on loopback, each sending `rows` x `hidden` (split evenly) per all-to-all.

    Returns rank 0's {"wall_ms", "cpu_ms", "cpu_share", "cpu_ms_by_thread", "bytes"} per all-to-all.
    Raises RuntimeError when a rank fails or the ranks do not finish within `timeout_s`.
    """
    import tempfile

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(procs),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory(prefix="gloo-a2a-") as tmp:
        result = Path(tmp) / "rank0.json"
        ranks = []
        try:
            for rank in range(procs):
                argv = [sys.executable, __file__, "--_rank", "--rows", str(rows), "--hidden", str(hidden),
                        "--dtype", dtype, "--iters", str(iters)]
                if rank == 0:
                    argv += ["--_result", str(result)]
                ranks.append(subprocess.Popen(argv, env=dict(env, RANK=str(rank)), stdout=subprocess.DEVNULL,
                                              stderr=subprocess.PIPE, text=True))
            deadline = time.monotonic() + timeout_s
            for rank, proc in enumerate(ranks):
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"gloo all-to-all probe: rank {rank} did not finish within {timeout_s:g} s"
                                       ) from None
                if proc.returncode:
                    tail = (proc.stderr.read() if proc.stderr else "").strip().splitlines()[-3:]
                    raise RuntimeError(f"gloo all-to-all probe: rank {rank} exited with {proc.returncode}: "
                                       + " | ".join(tail))
        finally:
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if proc.stderr:
                    proc.stderr.close()
        data = json.loads(result.read_text())
    import torch

    data["bytes"] = rows * hidden * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    data["cpu_share"] = data["cpu_ms"] / data["wall_ms"] if data["wall_ms"] else None
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048, help="rows each rank sends per all-to-all (all peers)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="50 all-to-alls (benchmarks/run_all.py)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--_rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.iters = min(args.iters, 50)
    if args._rank:
        _rank_main(args.rows, args.hidden, args.dtype, args.iters, args._result)
        return 0
    if args.rows < args.procs or args.rows % args.procs or args.hidden < 1 or args.iters < 1 or args.procs < 2:
        parser.error("--rows must be a positive multiple of --procs (>= 2); --hidden and --iters positive")
    data = measure(args.rows, args.hidden, args.dtype, args.procs, args.iters)
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    print(f"{args.procs} ranks, {data['bytes'] / 2**20:.2f} MiB per rank per all-to-all ({args.rows} x {args.hidden} "
          f"{args.dtype}), loopback gloo, {args.iters} all-to-alls")
    print(f"wall {data['wall_ms']:.3f} ms, CPU {data['cpu_ms']:.3f} ms ({100 * data['cpu_share']:.0f} % of wall) "
          "per all-to-all on rank 0")
    print("CPU by thread (ms per all-to-all): "
          + ", ".join(f"{k} {v:.3f}" for k, v in sorted(data["cpu_ms_by_thread"].items(), key=lambda kv: -kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
