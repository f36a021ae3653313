"""The M2N communicator with real processes on every backend, its failure modes, and `m2n-bench`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mbridge_epoverlap.comm.m2n import mooncake_available
from mbridge_epoverlap.launch import free_port
from tests.unit_tests.cli_runner import REPO, run_cli
from tests.unit_tests.requirements import require_or_skip

PEER = Path(__file__).with_name("m2n_peer.py")
BACKENDS = ["shm", "torch", "gloo", "mooncake"]


def _need(backend: str) -> None:
    if backend == "mooncake" and not mooncake_available():
        require_or_skip("mooncake", "mooncake.engine does not import (install mooncake-transfer-engine-non-cuda and "
                                    "libibverbs1)")


def _shm_names(pids: list[int]) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"mbe-m2n-{pid}-") for pid in pids)]


def _start(scenario: str, backend: str, world: int, senders: int, out: Path) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return [subprocess.Popen([sys.executable, str(PEER), scenario, backend, str(rank), str(world), str(senders),
                              str(port), str(out)], env=env, start_new_session=True, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for rank in range(world)]


def _wait_for_file(path: Path, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 60) -> None:
    """Return once `proc` has written `path`; fail naming `what` if it exits first or takes past the deadline."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"{what}: the process exited with code {proc.returncode} first"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.05)


def _finish(procs: list[subprocess.Popen[bytes]], timeout: float = 90) -> list[str]:
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            logs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return logs


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_by_two_exchange_is_bit_exact(backend: str, tmp_path: Path) -> None:
    _need(backend)
    procs = _start("exchange", backend, 4, 2, tmp_path)
    logs = _finish(procs)
    pids = [p.pid for p in procs]
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{log[-3000:]}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for sender in results[:2]:
        assert sender["replies_ok"] is True
        assert "slot_bytes=65536" in sender["oversize"]
    for receiver in results[2:]:
        assert receiver["messages_ok"] is True
        assert receiver["timeout_peer"] == 1
        assert "sender rank 1" in receiver["timeout"] and "did not complete" in receiver["timeout"]
    assert _shm_names(pids) == []


@pytest.mark.parametrize("backend", ["shm", "mooncake", "torch"])
def test_killed_peer_is_named_and_leaves_no_segment(backend: str, tmp_path: Path) -> None:
    _need(backend)
    procs = _start("survivor", backend, 2, 1, tmp_path)
    try:
        _wait_for_file(tmp_path / "ready", procs[0], "the victim did not set up")
        _wait_for_file(tmp_path / "receiving", procs[1], "the survivor did not post its receive")
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
    finally:
        logs = _finish(procs)
    assert procs[1].returncode == 0, logs[1][-3000:]
    survivor = json.loads((tmp_path / "rank1.json").read_text())
    assert survivor["peer"] == 0
    assert "victim rank 0" in survivor["error"]
    assert "exited" in survivor["error"] or "failed" in survivor["error"]  # noticed the death, not the timeout
    # shm's sends fill the dead peer's free slots (two) before one must wait for it, and that one fails.
    assert "victim rank 0" in survivor["sends"][-1], survivor["sends"]
    if backend == "mooncake":
        # Known dead from its process: no write reaches the engine, whose reconnect backoff costs ~1 s a write.
        assert all("exited" in e for e in survivor["sends"]), survivor["sends"]
    assert _shm_names([p.pid for p in procs]) == []


@pytest.mark.parametrize("backend", ["shm", "mooncake", "torch", "gloo"])
def test_a_replacement_process_connects_to_a_running_rank(backend: str, tmp_path: Path) -> None:
    _need(backend)
    late = backend != "gloo"
    procs = _start("host", backend, 1, 1, tmp_path)  # rank 0 only; rank 1's processes are started below
    port = procs[0].args[7]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")

    def start(scenario: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, str(PEER), scenario, backend, "1", "2", "1", port, str(tmp_path)],
                                env=env, start_new_session=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)

    victim = start("victim1")
    newcomer = None
    try:
        _wait_for_file(tmp_path / "ready", victim, "the victim did not set up")
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        if late:
            newcomer = start("newcomer")
    finally:
        logs = _finish([procs[0]] + ([newcomer] if newcomer else []))
    assert procs[0].returncode == 0, logs[0][-3000:]
    host = json.loads((tmp_path / "rank0.json").read_text())
    assert "peer rank 1" in host["lost"]
    if late:
        assert host["reply"] == [0, 10, 20, 30, 40]
        assert json.loads((tmp_path / "rank1.json").read_text())["got"] == [0, 1, 2, 3, 4]
    else:
        assert "cannot open a channel after set-up" in host["connect"] and "use backend shm" in host["connect"]
    pids = [p.pid for p in procs] + [victim.pid] + ([newcomer.pid] if newcomer else [])
    assert _shm_names(pids) == []


def test_bench_json_shape() -> None:
    result = run_cli("m2n-bench", "--senders", "1", "--receivers", "2", "--sizes", "2K,3000", "--iters", "3",
                     "--backend", "m2n", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["backend"] == "shm"
    assert [r["size_bytes"] for r in doc["results"]] == [2048, 3000]
    for row in doc["results"]:
        assert set(row) >= {"size_bytes", "median_us", "p99_us", "gbps"}
        assert row["p99_us"] >= row["median_us"] > 0
        assert row["samples"] == 3
    assert doc["machine"]["cpu_model"]
    assert "avx512_bf16" in doc["machine"]


@pytest.mark.parametrize(("args", "named"), [
    (["--sizes", "2Q"], "--sizes"),
    (["--sizes", "0"], "--sizes"),
    (["--senders", "0"], "--senders"),
    (["--receivers", "-1"], "--receivers"),
    (["--iters", "0"], "--iters"),
    (["--backend", "carrier-pigeon"], "--backend"),
])
def test_bench_bad_input_exits_2_naming_the_flag(args: list[str], named: str) -> None:
    base = {"--senders": "1", "--receivers": "1", "--sizes": "2K", "--iters": "2", "--backend": "shm"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = [item for pair in base.items() for item in pair]
    result = run_cli("m2n-bench", *argv)
    assert result.returncode == 2
    assert named in result.stderr and "Traceback" not in result.stderr


@pytest.mark.netns
def test_bench_across_two_emulated_hosts() -> None:
    import shutil as _shutil

    from mbridge_epoverlap.launch.netns import existing_namespaces

    refused = run_cli("m2n-bench", "--senders", "1", "--receivers", "1", "--sizes", "2K", "--backend", "shm",
                      "--emulate-hosts", "2", "--emulate-link-gbps", "10")
    assert refused.returncode == 2 and "cannot cross hosts" in refused.stderr and "(host 1)" in refused.stderr
    if os.geteuid() != 0 or _shutil.which("ip") is None or _shutil.which("tc") is None:
        require_or_skip("netns", "link emulation needs root and iproute2 (ip, tc)")
    before = set(existing_namespaces())
    result = run_cli("m2n-bench", "--senders", "1", "--receivers", "1", "--sizes", "64K", "--iters", "3",
                     "--backend", "torch", "--emulate-hosts", "2", "--emulate-link-gbps", "10", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["emulate_link_gbps"] == 10 and doc["backend"] == "torch"
    assert doc["results"][0]["link_us"] == round(65536 * 8 / 10e3, 2)
    assert set(existing_namespaces()) <= before  # none left (a stale one may be swept meanwhile)
