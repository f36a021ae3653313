"""The zygote (`mbridge_epoverlap.launch.zygote`): a rank forked from it runs as a new interpreter would, computes
the same bits, ends with the same exit codes, and leaves no process behind when its launcher is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mbridge_epoverlap.errors import RunFailedError
from mbridge_epoverlap.launch import launch_processes
from mbridge_epoverlap.launch import zygote as zygote_module
from mbridge_epoverlap.launch.zygote import (
    ZYGOTE_DIR_ENV,
    ZYGOTE_ENV,
    Zygote,
    ZygoteProcess,
    ended,
    share,
    stop_shared,
    zygote_for,
)

REPO = Path(__file__).resolve().parents[3]
RANK_MODULE = "tests.unit_tests.launch.zygote_rank"


@pytest.fixture(autouse=True)
def _zygotes_on(monkeypatch):
    """These tests are about the zygote: on even where the suite runs with `MBRIDGE_EPOVERLAP_ZYGOTE=0`."""
    monkeypatch.delenv(ZYGOTE_ENV, raising=False)


def _rank(*args: str) -> list[str]:
    return [sys.executable, "-m", RANK_MODULE, *args]


def _reports(tmp_path: Path, env_vars: dict[str, str] | None = None) -> list[dict]:
    """Two ranks' reports, and the process ids the launcher started."""
    pids: list[int] = []
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    launch_processes(2, lambda r: _rank("report", str(outs[r])),
                     env_vars={"ZYGOTE_TEST_MARKER": "m", **(env_vars or {})}, collect=lambda workdir: {},
                     on_start=pids.extend, timeout_s=120)
    reports = [json.loads(out.read_text()) for out in outs]
    for report, pid in zip(reports, pids, strict=True):
        report["pid"] = pid
    return reports


@pytest.mark.numerics
def test_a_forked_rank_sees_and_computes_what_a_new_interpreter_does(tmp_path, monkeypatch):
    forked = _reports(tmp_path)
    monkeypatch.setenv(ZYGOTE_ENV, "0")
    fresh = _reports(tmp_path)
    for a, b in zip(forked, fresh, strict=True):
        # `ps` shows the rank's own command line either way (argv's separators aside)
        assert a.pop("title") == b.pop("title").replace("\0", " ")
        a.pop("pid"), b.pop("pid")
        assert a == b
    assert forked[0]["name"] == "__main__" and forked[0]["argv0"].endswith("zygote_rank.py")
    assert forked[0]["threads"] == 1 and forked[0]["marker"] == "m" and forked[0]["path0"] == os.getcwd()


def test_ranks_are_the_zygotes_children_and_the_zygote_is_kept_for_the_next_run(tmp_path):
    first = _reports(tmp_path)
    zygote = zygote_for(_rank("report"), _launch_env())
    assert zygote is not None and zygote.alive
    parents = {int(Path(f"/proc/{r['pid']}/stat").read_text().split(")")[1].split()[1])
               for r in first if Path(f"/proc/{r['pid']}").exists()}
    assert parents <= {zygote.proc.pid}  # ended ranks are gone; a live one's parent would be the zygote
    again = _reports(tmp_path)
    assert zygote_for(_rank("report"), _launch_env()) is zygote and again[0]["product"] == first[0]["product"]


def _launch_env(**extra: str) -> dict[str, str]:
    from mbridge_epoverlap.launch.processes import base_env

    env = base_env({"ZYGOTE_TEST_MARKER": "m", **extra}, Path("/nonexistent"), 120)
    return env


def test_an_environment_torch_reads_at_import_gets_a_zygote_of_its_own(tmp_path):
    """OMP_NUM_THREADS and MKL_NUM_THREADS are read when torch is imported: a rank asking for 2 threads must not
    inherit a zygote's 1."""
    two = _reports(tmp_path, {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"})
    one = _reports(tmp_path)
    assert [r["threads"] for r in two] == [2, 2] and [r["threads"] for r in one] == [1, 1]


def test_exit_codes_signals_and_errors_are_reported_as_popen_reports_them(tmp_path):
    zygote = Zygote(_launch_env())
    try:
        codes = {}
        for mode, args in (("exit", ["3"]), ("raise", []), ("kill", [])):
            with open(tmp_path / f"{mode}.out", "wb") as out, open(tmp_path / f"{mode}.err", "wb") as err:
                proc = zygote.spawn(_rank(mode, *args), _launch_env(), stdout=out, stderr=err)
                assert isinstance(proc, ZygoteProcess)
                codes[mode] = proc.wait(timeout=60)
        assert codes == {"exit": 3, "raise": 1, "kill": -signal.SIGKILL}
        stderr = (tmp_path / "raise.err").read_text()
        assert "ValueError: the rank's own error" in stderr
        assert "During handling" not in stderr and "_Child" not in stderr  # nothing of the fork shows
    finally:
        zygote.close()


def test_a_failing_forked_rank_fails_the_run_naming_its_exit_code():
    with pytest.raises(RunFailedError, match="rank 1 failed with exit code 5"):
        launch_processes(2, lambda r: _rank("exit", "5" if r else "0"), collect=lambda workdir: {}, timeout_s=60)


LAUNCHER = """
import sys
from mbridge_epoverlap.launch import launch_processes
from mbridge_epoverlap.launch import zygote as zygote_module
launch_processes(1, lambda r: [sys.executable, "-m", RANK_MODULE, "orphan", MARK], collect=lambda w: {},
                 on_start=lambda pids: print(pids[0], flush=True), timeout_s=600)
"""


def test_the_zygote_and_its_ranks_leave_when_the_launcher_is_killed(tmp_path):
    """The rank is the zygote's child, not the launcher's: it watches the launcher itself (a pidfd), and the
    zygote leaves when its control socket closes."""
    mark = tmp_path / "released"
    code = f"RANK_MODULE = {RANK_MODULE!r}\nMARK = {str(mark)!r}\n{LAUNCHER}"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(ZYGOTE_ENV, None)
    env.pop(ZYGOTE_DIR_ENV, None)  # its own zygote, not the suite's shared ones
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        rank = int(launcher.stdout.readline())
        zygote = int(Path(f"/proc/{rank}/stat").read_text().split(")")[1].split()[1])
        assert zygote != launcher.pid and "mbridge_epoverlap.launch.zygote" in _cmdline(zygote)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 60
        while (not ended(rank) or not ended(zygote)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ended(rank) and ended(zygote)
        assert mark.read_text() == "released"
    finally:
        launcher.kill()
        launcher.wait(timeout=30)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_commands_share_a_directory_s_zygote_per_environment_and_it_outlives_them(tmp_path, monkeypatch):
    """`share`: the first launcher that needs a zygote for an environment starts it in the shared directory; the
    next launcher of that environment forks its ranks from the same one, even after the first exited; one of
    another environment (OMP_NUM_THREADS, read at torch's import) gets its own; all end with `stop_shared`."""
    monkeypatch.delenv(ZYGOTE_DIR_ENV, raising=False)
    for key in list(zygote_module._ZYGOTES):  # this process's own zygotes would answer before the directory
        monkeypatch.delitem(zygote_module._ZYGOTES, key)
    directory = tmp_path / "z"
    directory.mkdir()
    share(directory)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(ZYGOTE_ENV, None)
    parents = []
    try:
        for threads in ("1", "1", "2"):
            code = (f"RANK_MODULE = {RANK_MODULE!r}\nMARK = {str(tmp_path / threads)!r}\n"
                    + LAUNCHER.replace("collect=", f"env_vars={{'OMP_NUM_THREADS': '{threads}'}}, collect="))
            launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env,
                                        cwd=REPO)
            try:
                rank = int(launcher.stdout.readline())
                parents.append(int(Path(f"/proc/{rank}/stat").read_text().split(")")[1].split()[1]))
            finally:
                launcher.kill()
                launcher.wait(timeout=30)
        assert parents[0] == parents[1] != parents[2] and not ended(parents[0]) and not ended(parents[2])
        assert len(list(directory.glob("*.sock"))) == 2
    finally:
        stop_shared(directory)
    deadline = time.monotonic() + 30
    while any(not ended(p) for p in parents) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(ended(p) for p in parents) and not list(directory.glob("*.sock"))
