"""Every wrong input a first-time user tried, through the real commands: exit status, no traceback, a fix.

Each row runs one command line in process (`mbridge_epoverlap.cli.main` or `run_script.py`'s `main`)
in a fresh working directory and checks the exit status, that no traceback reached the user, and the
key words of the message (the setting and the fix). A few behaviours only a real process shows (a
reader that closes the pipe, where argparse prints its usage) run as subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mbridge_epoverlap.cli import main as cli_main
from mbridge_epoverlap.harness.main import main as harness_main
from tests.unit_tests.cli_runner import REPO, run_cli

PROFILE_DATA = REPO / "tests" / "unit_tests" / "profiling" / "data"
NSYS_BEFORE = PROFILE_DATA / "nsys" / "nsysai_mfu_2gpu_before.sqlite.gz"
GLOO_TRACES = PROFILE_DATA / "gloo_cpu"
GPU = ("-g", "h100", "--te_version", "2.9", "--torch_version", "2.7")
# A power of two above this machine's core count (so EP 2 divides it).
MORE_PROCESSES_THAN_CORES = 1 << len(os.sched_getaffinity(0)).bit_length()

RECIPES = textwrap.dedent('''
    from mbridge_epoverlap.recipes import qwen3_30b_a3b

    def raises(task):
        raise RuntimeError("no such cluster")

    def no_task():
        return qwen3_30b_a3b()

    def two_args(task, extra):
        return qwen3_30b_a3b(task)

    def returns_dict(task="pretrain"):
        return {"model": {}}

    def zero_layers(task="pretrain"):
        cfg = qwen3_30b_a3b(task)
        cfg.model.num_layers = 0
        return cfg

    def fine(task="pretrain"):
        return qwen3_30b_a3b(task)
''')


def run(front: str, argv: list[str]) -> tuple[int, str, str]:
    """Run one command in process; (exit status, stdout, stderr) with argparse's exits folded in."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    entry = cli_main if front == "cli" else harness_main
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = entry(argv)
        except SystemExit as exc:  # argparse: --help (0) and malformed flags (2)
            rc = exc.code if isinstance(exc.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh working directory holding a user's recipe file and two training logs."""
    (tmp_path / "my_recipes.py").write_text(RECIPES)
    (tmp_path / "off.log").write_text("")
    (tmp_path / "on.log").write_text("")
    (tmp_path / "a_folder").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    return tmp_path


# (id, front end, argv, exit status, words the message must hold)
CASES: list[tuple[str, str, list[str], int, list[str]]] = [
    # validate: sizes given as dotted overrides get their flags' checks
    ("ep-zero", "cli", ["validate", "model.expert_model_parallel_size=0"], 2,
     ["model.expert_model_parallel_size=0", "positive integer", "-ep"]),
    ("ep-negative", "cli", ["validate", "model.expert_model_parallel_size=-2"], 2, ["positive integer"]),
    ("layers-negative", "cli", ["validate", "model.num_layers=-4"], 2, ["model.num_layers=-4", "positive integer"]),
    ("experts-zero", "cli", ["validate", "model.num_moe_experts=0"], 2, ["model.num_moe_experts=0", "or null"]),
    ("global-batch-zero", "cli", ["validate", "train.global_batch_size=0"], 2, ["-gb", "positive integer"]),
    ("layer-freq-zero", "cli", ["validate", "model.moe_layer_freq=0"], 2, ["model.moe_layer_freq=0", "positive"]),
    ("mtp-negative", "cli", ["validate", "model.mtp_num_layers=-1"], 2, ["model.mtp_num_layers=-1", "non-negative"]),
    ("layer-freq-list", "cli", ["validate", "-g", "h100", "model.moe_layer_freq=[1,0]"], 0, ["valid"]),
    ("unknown-key", "cli", ["validate", "model.num_layer=4"], 2, ["unknown config key", "model.num_layers"]),
    ("not-a-bool", "cli", ["validate", "model.bf16=maybe"], 2, ["model.bf16", "true or false"]),
    ("not-key-value", "cli", ["validate", "model.bf16"], 2, ["KEY=VALUE"]),
    ("bad-version", "cli", ["validate", "--te-version", "two"], 2, ["--te-version", "not a version"]),
    ("unknown-gpu", "cli", ["validate", "-g", "h900"], 2, ["h900", "cpu", "h100"]),
    ("unknown-recipe", "cli", ["validate", "-mr", "qwen9"], 2, ["unknown recipe", "qwen3_30b_a3b"]),
    ("missing-recipe-file", "cli", ["validate", "-mr", "/nonexistent/recipe.py"], 2, ["/nonexistent/recipe.py",
                                                                                     "not found"]),
    ("recipe-raises", "cli", ["validate", "-mr", "my_recipes.py:raises"], 2,
     ["my_recipes.py:raises", "RuntimeError", "no such cluster", "line"]),
    ("recipe-no-task", "cli", ["validate", "-mr", "my_recipes.py:no_task"], 2, ["FUNCTION(task", "RunConfig"]),
    ("recipe-two-args", "cli", ["validate", "-mr", "my_recipes.py:two_args"], 2, ["two_args", "FUNCTION(task"]),
    ("recipe-returns-dict", "cli", ["validate", "-mr", "my_recipes.py:returns_dict"], 2, ["returned dict",
                                                                                          "RunConfig"]),
    ("recipe-zero-size", "cli", ["validate", "-mr", "my_recipes.py:zero_layers"], 2, ["model.num_layers=0"]),
    ("recipe-unknown-function", "cli", ["validate", "-mr", "my_recipes.py:nope"], 2, ["no function 'nope'"]),
    ("recipe-ambiguous", "cli", ["validate", "-mr", "my_recipes.py"], 2, ["public functions", "my_recipes.py:"]),
    ("recipe-as-override", "cli", ["validate", "my_recipes.py:fine"], 2, ["recipe file", "-mr my_recipes.py:fine"]),
    ("recipe-fine", "cli", ["validate", "-g", "h100", "-mr", "my_recipes.py:fine"], 0, ["valid"]),
    ("te-underscore", "cli", ["validate", "-g", "h100", "--te_version", "2.9"], 0, ["TE 2.9"]),
    ("te-dash", "cli", ["validate", "-g", "h100", "--te-version", "2.9"], 0, ["TE 2.9"]),
    ("invalid-config", "cli", ["validate", "-g", "h100", "--te-version", "2.9",
                               "comm_overlap.overlap_moe_expert_parallel_comm=true",
                               "model.expert_model_parallel_size=1"], 1, ["ep_size", "-ep"]),
    # run_script.py: the same checks before anything launches
    ("rs-ep-zero", "rs", ["model.expert_model_parallel_size=0", "--dryrun"], 2, ["-ep", "positive integer"]),
    ("rs-global-batch-zero", "rs", ["train.global_batch_size=0", "--dryrun"], 2, ["-gb", "positive integer"]),
    ("rs-flag-zero", "rs", ["-gb", "0"], 2, ["-gb", "positive integer"]),
    ("rs-recipe-raises", "rs", ["-mr", "my_recipes.py:raises", "--dryrun"], 2, ["RuntimeError", "no such cluster"]),
    ("rs-missing-recipe-file", "rs", ["-mr", "/nonexistent/recipe.py"], 2, ["not found"]),
    ("rs-ab-not-a-switch", "rs", ["--ab", "model.num_layers", "--dryrun"], 2, ["model.num_layers", "not a switch"]),
    ("rs-ab-unknown", "rs", ["--ab", "model.nope", "--dryrun"], 2, ["unknown config key"]),
    ("rs-layout-pp", "rs", ["-mr", "mixtral_8x22b", *GPU, "-ng", "16", "-ep", "8", "--dryrun"], 1,
     ["layout_expert_parallel", "-ep 4", "-ng 32"]),
    ("rs-te-dash", "rs", ["-g", "h100", "-ng", "16", "--te-version", "2.9", "--torch-version", "2.7", "--dryrun"], 0,
     ["dry run"]),
    ("rs-oversubscribed", "rs", ["-g", "cpu", "-ng", str(MORE_PROCESSES_THAN_CORES), "-ep", "2", "--dryrun"], 0,
     ["CPU processes on", "core"]),
    ("rs-logs-one-case", "rs", ["--from_logs", "a=off.log", "a=on.log"], 2, ["only case 'a'", "ep_overlap_off="]),
    ("rs-logs-missing", "rs", ["--from_logs", "off=missing.log", "on=on.log"], 2, ["missing.log", "no such file"]),
    ("rs-unknown-flag", "rs", ["--bogus"], 2, ["unrecognized arguments: --bogus"]),
    ("rs-detach-local", "rs", ["--detach"], 2, ["--detach needs --executor slurm"]),
    # profile
    ("profile-missing", "cli", ["profile", "nope.sqlite"], 2, ["nope.sqlite", "no such file"]),
    ("profile-not-a-trace", "cli", ["profile", "my_recipes.py"], 2, ["not a trace"]),
    ("profile-empty-folder", "cli", ["profile", "a_folder"], 2, ["no trace files"]),
    ("profile-compare-one", "cli", ["profile", str(NSYS_BEFORE), "--compare"], 2, ["--compare"]),
    ("profile-bad-window", "cli", ["profile", str(GLOO_TRACES), "--window", "soon"], 2, ["--window", "steps:A:B"]),
    ("profile-sqlite-gz", "cli", ["profile", str(NSYS_BEFORE)], 0, []),
    ("profile-window-past-end", "cli", ["profile", str(GLOO_TRACES), "--window", "1000s:2000s"], 0,
     ["warning", "nothing runs inside --window", "past the end"]),
    # simulate
    ("sim-png-txt", "cli", ["simulate", "--schedule", "1f1b", "--png", "chart.txt"], 2, ["chart.txt", "chart.png"]),
    ("sim-png-folder", "cli", ["simulate", "--schedule", "1f1b", "--png", "a_folder"], 2, ["a_folder", "folder",
                                                                                          ".png"]),
    ("sim-huge", "cli", ["simulate", "--schedule", "1f1b", "--micro-batches", "1000000000"], 2,
     ["--micro-batches", "limit"]),
    ("sim-zero-mb", "cli", ["simulate", "--schedule", "1f1b", "--micro-batches", "0"], 2, ["--micro-batches"]),
    ("sim-backward-negative", "cli", ["simulate", "--schedule", "1f1b", "--backward-factor", "-1"], 2,
     ["--backward-factor", "positive number"]),
    ("sim-negative-time", "cli", ["simulate", "--schedule", "1f1b", "--t-comm", "-1"], 2, ["--t-comm"]),
    ("sim-training-flag-on-serving", "cli", ["simulate", "--schedule", "pingpong", "--delay-wgrad"], 2,
     ["--delay-wgrad", "--schedule 1f1b"]),
    # plan
    ("plan-no-model", "cli", ["plan", "--attn-gpu", "H20"], 2, ["--model is required", "Mixtral-8x22B"]),
    ("plan-unknown-model", "cli", ["plan", "--model", "GPT-5", "--attn-gpu", "H20"], 2, ["GPT-5"]),
    ("plan-link-util", "cli", ["plan", "--model", "Mixtral-8x22B", "--attn-gpu", "H20", "--link-util", "2"], 2,
     ["--link-util", "between 0", "0.7"]),
    ("plan-colocated-expert-gpu", "cli", ["plan", "--model", "Mixtral-8x22B", "--attn-gpu", "H20", "--colocated",
                                          "--expert-gpu", "L40S"], 2, ["--colocated", "--expert-gpu"]),
    ("plan-gpus-without-compare", "cli", ["plan", "--model", "Mixtral-8x22B", "--attn-gpu", "H20", "--gpus",
                                          "H20,L40S"], 2, ["--gpus", "--compare"]),
    ("plan-fixed-axis-compare", "cli", ["plan", "--model", "Mixtral-8x22B", "--compare", "--m", "2"], 2,
     ["--m", "--compare"]),
    ("plan-bad-price", "cli", ["plan", "--model", "Mixtral-8x22B", "--attn-gpu", "H20", "--price", "H20"], 2,
     ["--price", "GPU=PRICE"]),
    ("plan-slo", "cli", ["plan", "--model", "Mixtral-8x22B", "--attn-gpu", "H20", "--tbt-slo-ms", "-1"], 2,
     ["--tbt-slo-ms"]),
    ("no-command", "cli", [], 2, []),
]


@pytest.mark.parametrize(("front", "argv", "status", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_its_exit_status_and_a_fix(workdir, front, argv, status, words):
    rc, out, err = run(front, argv)
    shown = out + err
    assert rc == status, shown
    assert "Traceback" not in shown
    for word in words:
        assert word in shown, f"{word!r} missing from:\n{shown}"
    if status == 2:
        assert err.strip(), "a usage error is explained on stderr"


def test_validate_counts_every_rule_it_lists(workdir):
    _, listed, _ = run("cli", ["validate", "--list-rules"])
    rc, out, _ = run("cli", ["validate", "-g", "h100", "--json"])
    assert rc == 0
    assert json.loads(out)["rules_checked"] == len(listed.strip().splitlines())


def test_simulate_png_names_the_file_it_writes(workdir):
    rc, out, err = run("cli", ["simulate", "--schedule", "1f1b", "--png", "gantt"])
    assert rc == 0 and "gantt.png" in out and (workdir / "gantt.png").is_file()
    assert not (workdir / "gantt").exists()
    rc, out, err = run("cli", ["simulate", "--schedule", "1f1b", "--png", "charts/new/g.png"])
    assert rc == 0 and (workdir / "charts" / "new" / "g.png").is_file()
    assert "creating folder charts/new" in err


def test_save_config_says_when_it_creates_folders(workdir):
    rc, _, err = run("rs", ["--dryrun", "--save_config_filepath", "cfgs/run.yaml"])
    assert rc == 0 and (workdir / "cfgs" / "run.yaml").is_file()
    assert "creating folder cfgs" in err


def test_results_files_follow_the_umask(tmp_path):
    from mbridge_epoverlap.harness.results import atomic_write

    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "r.json", lambda tmp: tmp.write_text("{}"))
    finally:
        os.umask(old)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644


# ---- --help texts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("front", "argv", "words", "absent"), [
    ("cli", ["--help"], ["run_script.py", "validate", "MBRIDGE_EPOVERLAP_PYTHON", "exit status"],
     ["thin subcommands"]),
    ("rs", ["--help"], ["MBRIDGE_EPOVERLAP_COMM_TIMEOUT_S", "--te-version", "exit status"], []),
    ("cli", ["validate", "--help"], ["recipe files", "FUNCTION(task)", "RunConfig", "cpu"], []),
    ("cli", ["profile", "--help"], ["--profile", "run_script.py", "nsys export", ".sqlite.gz"], []),
    ("cli", ["simulate", "--help"], ["(default 1.0)", "(default 0.5)", "(default 2)"], []),
    ("cli", ["plan", "--help"], ["plan --model MODEL --attn-gpu GPU"], ["[--model MODEL]"]),
])
def test_help_says_what_a_user_needs(workdir, front, argv, words, absent):
    rc, out, _ = run(front, argv)
    assert rc == 0
    for word in words:
        assert word in out, f"{word!r} missing from {argv}"
    for word in absent:
        assert word not in out


def test_every_environment_variable_the_code_reads_is_documented():
    import re

    from mbridge_epoverlap.envvars import ENV_VARS

    listed = {name for name, _ in ENV_VARS}
    used = set()
    for path in (REPO / "mbridge_epoverlap").rglob("*.py"):
        used |= set(re.findall(r"MBRIDGE_EPOVERLAP_[A-Z][A-Z_]*[A-Z]", path.read_text(encoding="utf-8")))
    assert used <= listed, f"undocumented: {sorted(used - listed)}"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert all(name in readme for name in listed)


# ---- Real processes ----------------------------------------------------------------------------------------


def _closed_pipe_run(argv: list[str], program: tuple[str, ...] = ("-m", "mbridge_epoverlap.cli"),
                     cwd: Path = REPO) -> subprocess.CompletedProcess[bytes]:
    """Run a command with stdout a pipe whose reader has already gone (as `| head -n 0` leaves it)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    try:
        return subprocess.run([sys.executable, *program, *argv], stdout=write_end, stderr=subprocess.PIPE, cwd=cwd,
                              env=env, timeout=120)
    finally:
        os.close(write_end)


@pytest.mark.parametrize(("argv", "status"), [
    (["validate", "-g", "h100", "--list-rules"], 0),
    (["validate", "-g", "h100"], 0),
    (["validate", "-g", "h100", "comm_overlap.overlap_moe_expert_parallel_comm=true",
      "model.expert_model_parallel_size=1"], 1),
])
def test_a_reader_that_leaves_does_not_change_the_exit_status(argv, status):
    result = _closed_pipe_run(argv)
    assert result.returncode == status, result.stderr.decode()
    assert b"Traceback" not in result.stderr and b"BrokenPipe" not in result.stderr


@pytest.mark.parametrize("argv", [["validate", "-g", "h100"], ["validate", "model.expert_model_parallel_size=0"],
                                  ["validate", "-g", "cpu", "--list-rules"]])
def test_validate_imports_neither_torch_nor_megatron(argv):
    # A pre-submit check must answer in well under a second; importing torch alone takes seconds.
    code = ("import sys\nfrom mbridge_epoverlap.cli import main\nrc = main(sys.argv[1:])\n"
            "heavy = sorted(m for m in ('torch', 'megatron', 'megatron.core') if m in sys.modules)\n"
            "print('HEAVY', heavy, file=sys.stderr)\nsys.exit(rc)")
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO, env=env,
                            timeout=120)
    if os.path.exists("/proc/driver/nvidia") and "-g" not in argv:
        pytest.skip("with an NVIDIA driver, validate without -g probes the GPU through torch")
    assert "HEAVY []" in result.stderr, result.stderr


def test_run_script_keeps_its_exit_status_when_the_reader_leaves(tmp_path):
    run_script = str(REPO / "scripts" / "performance" / "run_script.py")
    result = _closed_pipe_run(["--dryrun"], program=(run_script,), cwd=tmp_path)
    assert result.returncode == 0, result.stderr.decode()
    assert b"Traceback" not in result.stderr and b"BrokenPipe" not in result.stderr


def test_run_script_usage_errors_go_to_stderr():
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "performance" / "run_script.py"), "-ng", "0"],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert "usage:" in result.stderr and "-ng" in result.stderr


def test_validate_subprocess_error_is_one_line():
    result = run_cli("validate", "model.expert_model_parallel_size=0")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
