"""The process supervisor (`mbridge_epoverlap.launch`) on plain Python processes: expendable ranks, their
replacement, and failure messages that say what the processes were doing."""

from __future__ import annotations

import json
import sys

import pytest

from mbridge_epoverlap.errors import RunFailedError
from mbridge_epoverlap.launch import launch_processes

# A rank that reports its work done in its heartbeat, then rank 1 fails: the failure came "after" the work.
DONE_THEN_RANK_1_FAILS = (
    "import os, sys\n"
    "from mbridge_epoverlap.launch import heartbeat as hb\n"
    "rank = int(os.environ['RANK'])\n"
    "hb.Heartbeat(hb.heartbeat_path(os.environ[hb.DIR_ENV], rank)).beat(1, 0, hb.DONE)\n"
    "sys.exit(1 if rank == 1 else 0)\n"
)


def _done_then_rank_1_fails(rank: int) -> list[str]:
    return [sys.executable, "-c", DONE_THEN_RANK_1_FAILS]


def test_launcher_survives_only_expendable_ranks():
    def command(rank):  # rank 2 fails, the others succeed after it (the launcher's timeout bounds their wait)
        if rank == 2:
            return [sys.executable, "-c", "open('{workdir}/failing', 'w').close(); import sys; sys.exit(1)"]
        return [sys.executable, "-c",
                "import os, time\nwhile not os.path.exists('{workdir}/failing'): time.sleep(0.05)"]

    result = launch_processes(3, command, collect=lambda workdir: {}, expendable=[2], timeout_s=60)
    assert result["lost_ranks"] == [2]
    with pytest.raises(RunFailedError, match="rank 2 failed with exit code 1"):
        launch_processes(3, command, collect=lambda workdir: {}, expendable=[1], timeout_s=60)


def test_launcher_replaces_a_lost_expendable_rank_once(tmp_path):
    gen = str(tmp_path / "gen")

    def command(rank):  # rank 1 fails at first; its replacement writes a file and succeeds
        if rank == 1:
            return [sys.executable, "-c", "import sys; sys.exit(3)"]
        # Rank 0 runs until the replacement wrote its file (the launcher's timeout bounds the wait): rank 1
        # fails while a rank that is not expendable still runs, which is when the launcher replaces it.
        return [sys.executable, "-c", f"import os, time\nwhile not os.path.exists({gen!r}): time.sleep(0.05)"]

    def replacement(rank, generation):
        return [sys.executable, "-c", f"open({gen!r}, 'w').write('{generation}')"]

    started: list[int] = []
    result = launch_processes(2, command, collect=lambda workdir: {}, expendable=[1],
                              respawn=replacement, on_start=started.extend, timeout_s=60)
    assert result["lost_ranks"] == [1]
    assert (tmp_path / "gen").read_text() == "1" and len(started) == 3


@pytest.mark.parametrize("activity", ["serving", "training"])
def test_a_failure_after_the_work_names_what_the_processes_did(activity):
    with pytest.raises(RunFailedError, match=rf"rank 1 failed with exit code 1 \(after {activity}\)"):
        launch_processes(2, _done_then_rank_1_fails, activity=activity, timeout_s=60)


def test_serving_workers_fail_after_serving_not_after_training(monkeypatch):
    # The engine's own launch, with workers that finish their work and then one fails: the message must
    # say what serving workers do.
    import mbridge_epoverlap.launch as launch
    from mbridge_epoverlap.serving.engine.run import EngineFailed, make_plan, run_engine
    from mbridge_epoverlap.serving.model.checkpoint import load_spec
    from mbridge_epoverlap.serving.workers.requests import Request

    real = launch.launch_processes
    monkeypatch.setattr(launch, "launch_processes",
                        lambda world, command_for, **kwargs: real(world, _done_then_rank_1_fails, **kwargs))
    plan = make_plan(load_spec("qwen3_30b_a3b"), [Request("p0", (1, 2, 3))], max_new_tokens=2, timeout_s=5)
    with pytest.raises(EngineFailed, match=r"\(rank 1\) failed with exit code 1 \(after serving\)") as failure:
        run_engine(plan, run_timeout_s=60)
    assert "after training" not in str(failure.value)


def test_training_ranks_fail_after_training(monkeypatch):
    from mbridge_epoverlap.recipes.cpu_case import cpu_overlap_case
    from mbridge_epoverlap.runtime import launch as training_launch

    real = training_launch.launch_processes
    monkeypatch.setattr(training_launch, "launch_processes",
                        lambda world, command_for, **kwargs: real(world, _done_then_rank_1_fails, **kwargs))
    cfg = cpu_overlap_case("qwen3_30b_a3b", 2, overlap=False, delay_wgrad=False)
    with pytest.raises(RunFailedError, match=r"rank 1 failed with exit code 1 \(after training\)"):
        training_launch.launch_ranks(cfg, timeout_s=60)


# Rank 0 checks the rendezvous socket it inherited: bound to MASTER_PORT and listening, while nobody else may bind
# that port; rank 1 has none.
RENDEZVOUS_CHECK = """
import json, os, socket, sys
fd = os.environ.get("MBRIDGE_EPOVERLAP_STORE_FD")
seen = {"rank": os.environ["RANK"], "fd": fd}
if fd is not None:
    sock = socket.socket(fileno=int(fd))
    seen["port_is_master_port"] = sock.getsockname()[1] == int(os.environ["MASTER_PORT"])
    seen["listening"] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    other = socket.socket()
    try:
        other.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        seen["port_free"] = True
    except OSError:
        seen["port_free"] = False
open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w").write(json.dumps(seen))
"""


def test_rank_0_inherits_the_rendezvous_port_bound_from_its_pick(tmp_path):
    """A port picked free and closed again could be taken by another run's rank 0 before this one's binds it (two
    runs at once then meet in one store): the launcher keeps it bound and hands the socket to rank 0."""
    launch_processes(2, lambda rank: [sys.executable, "-c", RENDEZVOUS_CHECK, str(tmp_path)],
                     collect=lambda workdir: {}, timeout_s=60)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank0["port_is_master_port"] and rank0["listening"] and rank0["port_free"] is False
    assert rank1["fd"] is None
