"""The sbatch script of an experiment: one allocation, every run launched with srun, interleaved.

Layout of the job directory (on a filesystem the compute nodes share)::

    job.sbatch  plan.json  configs/<case>.yaml  runs/<case>_r<k>.{json,log}  traces/<case>/  slurm-<id>.out

The script exports each case's launch environment before its runs (those variables must exist when
the ranks start), takes MASTER_ADDR from the first node of the allocation and a fresh port per run,
and ends by building the results on the cluster (`mbridge_epoverlap.harness.collect`).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import EXIT_NO_BRIDGE
from mbridge_epoverlap.harness.cases import Case
from mbridge_epoverlap.harness.collect import run_file, trace_dir
from mbridge_epoverlap.harness.experiment import Experiment
from mbridge_epoverlap.harness.flags import TimeLimit

MARKER = "[mbridge-epoverlap]"
# Each job's ports (its runs' rendezvous, one per run) come from a block of its own: 20000 + (id % 200) * 50, so
# the next job on a node does not bind a port the previous one left in TIME_WAIT (consecutive ids once shared
# all but one port). Below 30000, where the online server's HTTP port lies (`slurm_serve.HTTP_PORT_BASE`).
PORTS_PER_JOB = 50
PORT_BASE_LINE = f"PORT_BASE=$(( 20000 + SLURM_JOB_ID % 200 * {PORTS_PER_JOB} ))"
PYTHON_VAR = "MBRIDGE_EPOVERLAP_PYTHON"


@dataclass(frozen=True)
class JobShape:
    """Resources of the allocation."""

    num_tasks: int
    tasks_per_node: int
    gpus: bool

    @property
    def nodes(self) -> int:
        return math.ceil(self.num_tasks / self.tasks_per_node)


@dataclass(frozen=True)
class ScriptOptions:
    """What the script needs besides the experiment.

    Attributes:
        job_dir: absolute job directory.
        repo_root: directory that holds the `mbridge_epoverlap` package (put on PYTHONPATH).
        python: default interpreter on the nodes (`$MBRIDGE_EPOVERLAP_PYTHON` overrides it at run time).
        time_limit, account, partition: sbatch settings.
        mixed_precision, tokenizer_type: passed to Megatron-Bridge (GPU jobs).
        job_args: more arguments of the Megatron-Bridge job (recipe choice, pass-through settings).
        sbatch_lines, srun_args, setup_lines: pass-through run_script.py flags for the script (#SBATCH
            lines, srun arguments, exports and commands before the runs).
        notes: comment lines (the chosen recipe, where each pass-through flag went).
        profile_window: START:END iterations the profiler records (default: the stable window).
        nsys_args: the user's options of the profiled runs' `nsys profile` (--nsys_extra_args, --nsys_trace); one
            that names an option the harness sets replaces it (`nsys_options`).
    """

    job_dir: Path
    repo_root: Path
    python: str
    time_limit: TimeLimit
    account: str | None = None
    partition: str | None = None
    mixed_precision: str | None = None
    tokenizer_type: str | None = None
    job_args: tuple[str, ...] = ()
    sbatch_lines: tuple[str, ...] = ()
    srun_args: tuple[str, ...] = ()
    setup_lines: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    profile_window: str | None = None
    nsys_args: tuple[str, ...] = ()


# The harness's `nsys profile` options for a profiled GPU run (the report path comes last, always the harness's).
NSYS_DEFAULTS = ("--trace=cuda,nvtx", "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
                 "--force-overwrite=true")


def _option_name(token: str) -> str | None:
    """`--cuda-graph-trace` for `--cuda-graph-trace=node`; None for a value (not an option)."""
    return token.split("=", 1)[0] if token.startswith("-") else None


def nsys_options(user: Sequence[str]) -> list[str]:
    """The user's nsys options, then each default whose option the user does not give.

    nsys refuses an option given twice, so a user's `--trace=cuda,nvtx,osrt` replaces the default `--trace`
    instead of repeating it (what Megatron-Bridge main's perf plugin does since #4669; 0.6.x repeats it).
    """
    named = {name for name in map(_option_name, user) if name is not None}
    return [*user, *(option for option in NSYS_DEFAULTS if _option_name(option) not in named)]


def _q(value: object) -> str:
    return shlex.quote(str(value))


def sbatch_header(exp: Experiment, shape: JobShape, opts: ScriptOptions) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={_q('epoverlap-' + exp.recipe)}",
        f"#SBATCH --nodes={shape.nodes}",
        f"#SBATCH --ntasks={shape.num_tasks}",
        f"#SBATCH --ntasks-per-node={shape.tasks_per_node}",
    ]
    if shape.gpus:
        lines.append(f"#SBATCH --gpus-per-node={shape.tasks_per_node}")
        lines.append("#SBATCH --exclusive")  # no neighbours on the nodes while timing
    lines.append(f"#SBATCH --time={opts.time_limit.text}")
    if opts.account:
        lines.append(f"#SBATCH --account={_q(opts.account)}")
    if opts.partition:
        lines.append(f"#SBATCH --partition={_q(opts.partition)}")
    lines.append(f"#SBATCH --output={_q(opts.job_dir / 'slurm-%j.out')}")
    lines += list(opts.sbatch_lines)
    return lines


def _run_command(exp: Experiment, case: Case, opts: ScriptOptions, out: Path, profile: bool) -> list[str]:
    config = opts.job_dir / "configs" / f"{case.name}.yaml"
    if exp.gpu == "cpu":
        cmd = ['"$PYTHON"', "-m", "mbridge_epoverlap.runtime.worker", "--config", _q(config),
               "--max-steps", str(exp.max_steps), "--results", _q(out)]
        if profile:
            cmd += ["--profile-dir", _q(trace_dir(opts.job_dir, case.name))]
        return cmd
    cmd = ['"$PYTHON"', "-m", "mbridge_epoverlap.harness.mbridge_job", "--config", _q(config),
           "--changes", _q(opts.job_dir / "configs" / f"{case.name}.changes.json"), "--max-steps", str(exp.max_steps)]
    if opts.mixed_precision:
        cmd += ["--mixed-precision", _q(opts.mixed_precision)]
    if opts.tokenizer_type:
        cmd += ["--tokenizer-type", _q(opts.tokenizer_type)]
    cmd += [_q(arg) for arg in opts.job_args]
    if profile:
        window = opts.profile_window or f"{exp.window.start}:{exp.window.end}"
        cmd = ['${PROFILER[@]+"${PROFILER[@]}"}', *cmd, "--profile-window", window]
    return cmd


def job_change_lines(cases: list[Case], max_steps: int) -> list[str]:
    """Comment lines: every setting the Megatron-Bridge job changes on the recipe it builds, case by case."""
    from mbridge_epoverlap.harness.mbridge_job import JOB_FIXED, LAUNCH_KEYS

    fixed = [f"train.train_iters={max_steps}"] + [f"{section}.{name}={value!r} ({why})"
                                                   for section, name, value, why in JOB_FIXED]
    lines = ["# the job builds that recipe and changes on it only these settings (every other one is the recipe's):",
             f"#   every case: {', '.join(fixed)}"]
    for case in cases:
        written = [f"{key}={value!r}" + _was(case, key, value) for key, value in case.changes.items()
                   if key not in LAUNCH_KEYS and not key.startswith("env_vars.")]
        lines.append(f"#   case {case.name}: {', '.join(written) or 'nothing else'}")
    return lines


def _was(case: Case, key: str, value: Any) -> str:
    """` (recipe: X)` where the recipe's value is known and differs."""
    if key in case.recipe_values and case.recipe_values[key] != value:
        return f" (recipe: {case.recipe_values[key]!r})"
    return ""


def render_script(exp: Experiment, cases: list[Case], shape: JobShape, opts: ScriptOptions) -> str:
    """The complete sbatch script."""
    gpu_job = exp.gpu != "cpu"
    env_keys = sorted({key for case in cases for key in case.launch_env})
    lines = sbatch_header(exp, shape, opts)
    lines += [
        "#",
        f"# mbridge-epoverlap: {exp.ab or 'single run'} of {exp.recipe} ({exp.task}) on {exp.gpu} x "
        f"{shape.num_tasks}; {len(cases)} case(s) x {exp.repeats} repeat(s), interleaved; {exp.max_steps} steps each",
        *(f"# {note}" for note in opts.notes),
        *(job_change_lines(cases, exp.max_steps) if gpu_job else []),
        "set -euo pipefail",
        "",
        f"JOB_DIR={_q(opts.job_dir)}",
        f'PYTHON="${{{PYTHON_VAR}:-{opts.python}}}"',
        f'export PYTHONPATH={_q(opts.repo_root)}"${{PYTHONPATH:+:$PYTHONPATH}}"',
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export MASTER_ADDR",
        PORT_BASE_LINE,
        f'log() {{ echo "{MARKER} $*"; }}',
        *opts.setup_lines,
        "",
    ]
    if gpu_job:
        lines += [
            "# GPU runs train with Megatron-Bridge: fail early, and clearly, where it is missing.",
            'if ! "$PYTHON" -c "import megatron.bridge" >/dev/null 2>&1; then',
            f'  echo "error: Megatron-Bridge is not importable with $PYTHON on $(hostname); run the job in a '
            f'NeMo/Megatron-Bridge container or set {PYTHON_VAR} to a Python that has it" >&2',
            f"  exit {EXIT_NO_BRIDGE}",
            "fi",
            "",
        ]
    if gpu_job and exp.profile:
        lines += [
            "HAVE_NSYS=0",
            "if command -v nsys >/dev/null 2>&1; then HAVE_NSYS=1; else",
            '  log "warning: nsys not found; the profiled runs run without a profiler"',
            "fi",
            "",
        ]
    lines += [
        "# run_case NAME REPEAT INDEX LOG COMMAND...: one process per GPU (per CPU rank on -g cpu)",
        "run_case() {",
        '  local name=$1 repeat=$2 index=$3 logfile=$4; shift 4',
        "  export MASTER_PORT=$(( PORT_BASE + index ))",
        '  log "case $name repeat $repeat: start (port $MASTER_PORT)"',
        f"  srun --ntasks={shape.num_tasks} --ntasks-per-node={shape.tasks_per_node} --kill-on-bad-exit=1 "
        + "".join(f"{_q(arg)} " for arg in opts.srun_args) + "\\",
        "    bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS; exec \"$@\"' "
        'rank "$@" 2>&1 | tee "$logfile"',
        '  log "case $name repeat $repeat: done"',
        "}",
        "",
        'mkdir -p "$JOB_DIR/runs"',
    ]
    by_name = {case.name: case for case in cases}
    planned = [(name, repeat, False) for name, repeat in exp.run_order()]
    if exp.profile:
        planned += [(case.name, "profile", True) for case in cases]
    for index, (name, repeat, profile) in enumerate(planned):
        case = by_name[name]
        suffix = ".json" if exp.gpu == "cpu" else ".log"
        out = run_file(opts.job_dir, name, repeat, suffix)
        lines.append("")
        lines.append(f"# {name}, repeat {repeat}" + (" (profiled, not timed)" if profile else ""))
        for key in env_keys:
            if key in case.launch_env:
                lines.append(f"export {key}={_q(case.launch_env[key])}")
            else:
                lines.append(f"unset {key}")
        if profile:
            traces = trace_dir(opts.job_dir, name)
            lines.append(f"mkdir -p {_q(traces)}")
            if gpu_job:
                # nsys expands %q{SLURM_PROCID} in each rank: one report per rank.
                options = " ".join(_q(option) for option in nsys_options(opts.nsys_args))
                lines.append(f'if [ "$HAVE_NSYS" = 1 ]; then PROFILER=(nsys profile {options} '
                             f"-o {_q(str(traces / 'rank%q{SLURM_PROCID}'))}); else PROFILER=(); fi")
        log_path = run_file(opts.job_dir, name, repeat, ".log")
        command = " ".join(_run_command(exp, case, opts, out, profile))
        lines.append(f"run_case {_q(name)} {_q(repeat)} {index} {_q(log_path)} {command}")
    lines += [
        "",
        'log "collecting results"',
        '"$PYTHON" -m mbridge_epoverlap.harness.collect --plan "$JOB_DIR/plan.json"',
        f"log {_q('results written to ' + exp.results_json)}",
        "",
    ]
    return "\n".join(lines)
