"""Every exit status the project uses has one meaning, and each producer uses the shared constant."""

from __future__ import annotations

from mbridge_epoverlap import errors
from mbridge_epoverlap.comm import errors as comm_errors
from mbridge_epoverlap.harness import mbridge_job
from mbridge_epoverlap.harness.main import main


def test_exit_statuses_are_distinct() -> None:
    statuses = {name: value for name, value in vars(errors).items() if name.startswith("EXIT_")}
    assert len(set(statuses.values())) == len(statuses), statuses
    assert comm_errors.EXIT_COMM == errors.EXIT_COMM != errors.EXIT_NO_BRIDGE
    assert mbridge_job.EXIT_NO_BRIDGE == errors.EXIT_NO_BRIDGE


def test_slurm_script_exits_with_the_missing_bridge_status(tmp_path, capsys) -> None:
    rc = main(["-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16", "-gn", "8", "--te_version", "2.12",
               "--ab", "ep_overlap", "--dryrun", "--results_json", str(tmp_path / "ab.json")])
    assert rc == 0, capsys.readouterr().err
    script = (tmp_path / "ab.slurm" / "job.sbatch").read_text()
    bridge_check = script[script.index("import megatron.bridge"):]
    assert f"exit {errors.EXIT_NO_BRIDGE}\n" in bridge_check.split("fi\n", 1)[0]
