"""Measure M2N latency: M sender processes, N receiver processes, one backend, several message sizes.

Each iteration, every sender sends one message of the size to every receiver and waits for a small
acknowledgement from each; its latency is that round (what a dispatch costs before the next step can use
the answer). The figures are the median and 99th percentile over all senders' iterations, and the
aggregate rate M x N x size / median. The processes are started and supervised by the process supervisor
(`mbridge_epoverlap.launch`: sessions killed as a group, a timeout, the failed rank named); rank 0 hosts the
rendezvous store.

With `emulate_link_gbps` (`m2n-bench --emulate-hosts 2 --emulate-link-gbps G`) the senders run on one emulated
host and the receivers on another (network namespaces joined by links shaped to G Gbit/s, root only), and
each size also gets the link's own limit, `link_us` = size x 8 / G (what one message takes on the wire).

    python -m mbridge_epoverlap.comm.m2n.bench    # the per-rank entry point (the launcher runs it)
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import RunFailedError, UsageError
from mbridge_epoverlap.machine import machine

ACK_TAG = 1
DATA_TAG = 0
_PREFIX = "MBRIDGE_EPOVERLAP_M2N_BENCH_"


def parse_size(text: str) -> int:
    """'2K' -> 2048, '8M' -> 8388608, '300' -> 300 (K, M, G are powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    raw = text.strip().upper().removesuffix("B") or "?"
    scale = units.get(raw[-1], 1)
    number = raw[:-1] if raw[-1] in units else raw
    try:
        value = float(number) * scale
    except ValueError:
        raise UsageError(f"--sizes: '{text}' is not a size; write bytes with an optional K/M/G suffix, "
                         "e.g. --sizes 2K,256K,8M") from None
    if value < 1 or value != int(value):
        raise UsageError(f"--sizes: '{text}' must be a whole number of bytes >= 1, e.g. --sizes 2K,256K,8M")
    return int(value)


def describe_machine(info: dict[str, Any]) -> str:
    flags = ", ".join(f"{k} {'yes' if info.get(k) else 'no'}" for k in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    return f"{info.get('cpu_model')} x {info.get('cpus')} ({flags}) on {info.get('hostname')}"


def memory_needed(size: int, senders: int, receivers: int) -> int:
    """Bytes a run with `size`-byte messages holds at once, roughly: two ring slots of each direction of every
    sender-receiver pair, and each process's payload and one received copy per peer."""
    world = senders + receivers
    return size * (4 * senders * receivers + world * (1 + max(senders, receivers)))


def check_sizes_fit(sizes: Sequence[int], senders: int, receivers: int, available: int) -> None:
    """Refuse message sizes whose run would not fit in half of `available` bytes (the rest is the system's).

    Raises:
        UsageError: naming the size, what it needs, the limit and the largest size that fits.
    """
    limit = available // 2
    per_byte = memory_needed(1, senders, receivers)
    for size in sizes:
        needed = memory_needed(size, senders, receivers)
        if needed > limit:
            raise UsageError(f"--sizes: a {size:,}-byte message needs about {needed:,} "
                             f"bytes over {senders + receivers} processes, more than the limit of {limit:,} bytes "
                             f"(half the memory available); the largest that fits is {limit // per_byte:,} bytes")


def available_memory() -> int:
    """Bytes free for the run: the smaller of MemAvailable and the free space of /dev/shm (the shm rings)."""
    candidates = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        stat = os.statvfs("/dev/shm")
        candidates.append(stat.f_bavail * stat.f_frsize)
    except OSError:
        pass
    return min(candidates) if candidates else 1 << 62


def run_bench(backend: str, *, senders: int, receivers: int, sizes: Sequence[int], iters: int = 200,
              timeout_s: float = 300.0, progress: Callable[[str], None] | None = None,
              emulate_link_gbps: float | None = None) -> dict[str, Any]:
    """Run the M2N benchmark in `senders + receivers` local processes; return the `m2n-bench --json` document.

    Args:
        emulate_link_gbps: senders and receivers on two emulated hosts joined by a link of this rate (None:
            this host).

    Raises:
        UsageError: bad counts, sizes or backend (also mooncake missing, or shm across emulated hosts).
        RunFailedError: a rank failed or the run timed out (the message names the rank).
    """
    from mbridge_epoverlap.comm.m2n import MOONCAKE_INSTALL, mooncake_available, resolve_backend
    from mbridge_epoverlap.comm.m2n.shm import remove_leftovers
    from mbridge_epoverlap.launch import Ranks, reserved_listener

    concrete = resolve_backend(backend, single_host=emulate_link_gbps is None)
    if concrete == "shm" and emulate_link_gbps is not None:
        raise UsageError(f"--backend {backend} cannot cross hosts: the senders (host 0) and the receivers (host 1) "
                         "share no memory; use --backend mooncake, torch, gloo or m2n")
    if senders < 1:
        raise UsageError(f"--senders {senders}: need at least one sender process")
    if receivers < 1:
        raise UsageError(f"--receivers {receivers}: need at least one receiver process")
    if iters < 1:
        raise UsageError(f"--iters {iters}: need at least one iteration")
    if not sizes:
        raise UsageError("--sizes: give at least one message size, e.g. --sizes 2K,256K,8M")
    check_sizes_fit(sizes, senders, receivers, available_memory())
    if concrete == "mooncake" and not mooncake_available():
        raise UsageError(MOONCAKE_INSTALL)
    world = senders + receivers
    workdir = Path(tempfile.mkdtemp(prefix="mbe-m2n-bench-"))
    pids: list[int] = []
    try:
        env = _rank_env()
        env.update({_PREFIX + "BACKEND": concrete, _PREFIX + "SENDERS": str(senders), _PREFIX + "WORLD": str(world),
                    _PREFIX + "SIZES": ",".join(str(s) for s in sizes), _PREFIX + "ITERS": str(iters),
                    _PREFIX + "DIR": str(workdir), _PREFIX + "TIMEOUT_S": str(min(60.0, timeout_s / 2))})
        with contextlib.ExitStack() as stack:
            link, reserved = None, None
            if emulate_link_gbps is not None:
                from mbridge_epoverlap.launch.netns import IFNAME, EmulatedLink

                link = stack.enter_context(EmulatedLink(world, emulate_link_gbps, [0] * senders + [1] * receivers))
                env.update(MASTER_ADDR=link.address(0), MASTER_PORT="29500", GLOO_SOCKET_IFNAME=IFNAME)
            else:
                reserved = stack.enter_context(reserved_listener())
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(reserved.getsockname()[1]),
                           GLOO_SOCKET_IFNAME="lo")
            ranks = stack.enter_context(Ranks(workdir))
            for rank in range(world):
                prefix, rank_env = [], dict(env, RANK=str(rank))
                if link is not None:
                    prefix = link.command_prefix(rank)
                    rank_env["MBRIDGE_EPOVERLAP_M2N_HOST"] = link.address(rank)
                ranks.start(rank, [*prefix, sys.executable, "-m", "mbridge_epoverlap.comm.m2n.bench"], rank_env,
                            rendezvous=reserved if rank == 0 else None)
                pids.append(ranks.ranks[-1].proc.pid)
            ranks.supervise(timeout_s=timeout_s, progress=progress)
        samples: dict[int, list[float]] = {size: [] for size in sizes}
        for rank in range(senders):
            path = workdir / f"latency.rank{rank}.json"
            if not path.is_file():
                raise RunFailedError(f"sender rank {rank} finished but wrote no results ({path})")
            for size, values in json.loads(path.read_text()).items():
                samples[int(size)] += values
    finally:
        remove_leftovers(pids)
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    results = []
    for size in sizes:
        values = sorted(samples[size])
        median = _quantile(values, 0.5)
        results.append({"size_bytes": size, "median_us": round(median, 2), "p99_us": round(_quantile(values, 0.99), 2),
                        "gbps": round(senders * receivers * size * 8 / (median * 1e3), 4) if median > 0 else 0.0,
                        "samples": len(values)})
        if emulate_link_gbps is not None:
            results[-1]["link_us"] = round(size * 8 / (emulate_link_gbps * 1e3), 2)
    doc = {"backend": concrete, "requested_backend": backend, "senders": senders, "receivers": receivers,
           "iters": iters, "results": results, "machine": machine()}
    if emulate_link_gbps is not None:
        doc.update(emulate_hosts=2, emulate_link_gbps=emulate_link_gbps)
    return doc


def _rank_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parents[3])  # the ranks import this package from where we did
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


# --- one rank ---------------------------------------------------------------------------------------------


def _rank_main() -> int:
    from datetime import timedelta

    import torch

    from mbridge_epoverlap.comm.m2n import make_communicator
    from mbridge_epoverlap.comm.m2n.base import PeerError
    from mbridge_epoverlap.comm.store import open_store

    env = os.environ
    rank, world, senders = int(env["RANK"]), int(env[_PREFIX + "WORLD"]), int(env[_PREFIX + "SENDERS"])
    sizes = [int(s) for s in env[_PREFIX + "SIZES"].split(",")]
    iters, timeout_s = int(env[_PREFIX + "ITERS"]), float(env[_PREFIX + "TIMEOUT_S"])
    workdir = Path(env[_PREFIX + "DIR"])
    torch.set_num_threads(1)
    store = open_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world=None, is_server=rank == 0,
                       timeout_s=timeout_s, wait_for_workers=False)
    is_sender = rank < senders
    peers = list(range(senders, world)) if is_sender else list(range(senders))
    roles = {p: ("receiver" if p >= senders else "sender") for p in peers}
    slot_bytes = max(sizes) + 64
    comm = make_communicator(env[_PREFIX + "BACKEND"], rank=rank, peers=peers, store=store, slot_bytes=slot_bytes,
                             timeout_s=timeout_s, roles=roles, world_size=world)
    latencies: dict[str, list[float]] = {}
    try:
        ack = [torch.zeros(1, dtype=torch.int32)]
        for size in sizes:
            payload = [torch.ones(size, dtype=torch.uint8)]
            warmup = max(3, iters // 10)
            times = []
            step = max(1, iters // 10)
            for i in range(warmup + iters):
                start = time.perf_counter()
                if is_sender:
                    works = [comm.isend(p, payload, DATA_TAG) for p in peers]
                    works += [comm.irecv(p, ACK_TAG) for p in peers]
                    for w in works:
                        w.wait()
                else:
                    for w in [comm.irecv(p, DATA_TAG) for p in peers]:
                        w.wait()
                    for w in [comm.isend(p, ack, ACK_TAG) for p in peers]:
                        w.wait()
                if i >= warmup:
                    times.append((time.perf_counter() - start) * 1e6)
                    done = i - warmup + 1
                    if rank == 0 and (done % step == 0 or done == iters):
                        print(f"m2n-bench: {size} bytes, {done}/{iters} iterations", flush=True)
            if is_sender:
                latencies[str(size)] = times
        if is_sender:
            path = workdir / f"latency.rank{rank}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(latencies))
            tmp.replace(path)
        # Nobody closes while a peer may still write to it.
        store.set(f"m2n-bench/done/{rank}", "1")
        store.wait([f"m2n-bench/done/{r}" for r in range(world)], timedelta(seconds=timeout_s))
        if rank == 0:  # rank 0 hosts the store: it leaves last
            store.wait([f"m2n-bench/left/{r}" for r in range(1, world)], timedelta(seconds=timeout_s))
        else:
            store.set(f"m2n-bench/left/{rank}", "1")
    except PeerError as exc:
        print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 3
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
