"""Regenerate gloo_cpu/rank{0,1}.json.gz: a 2-rank CPU-only torch.profiler trace of a toy MoE step.

Each step: `attention` matmul, `dispatch` (async all_to_all), `experts` matmuls while the dispatch
is in flight, wait, `combine` (blocking all_to_all). Run: python make_gloo_cpu_traces.py OUT_DIR
"""

from __future__ import annotations

import gzip
import os
import shutil
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, record_function


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    x, w = torch.randn(256, 512), torch.randn(512, 512)
    dist.all_to_all_single(torch.empty(4096), torch.randn(4096))  # connect before profiling
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function("attention"):
                y = x @ w
            with record_function("dispatch"):
                received = torch.empty_like(y)
                work = dist.all_to_all_single(received, y, async_op=True)
            with record_function("experts"):
                for _ in range(4):
                    x @ w
            work.wait()
            with record_function("combine"):
                dist.all_to_all_single(torch.empty_like(received), received)
            prof.step()
    raw = os.path.join(out, f"rank{rank}.json")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "gloo_cpu"
    os.makedirs(out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, out), nprocs=2, join=True)


if __name__ == "__main__":
    main()
