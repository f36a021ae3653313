"""The docs against the code: rule ids, flags, generated blocks and every command shown.

README.md, the skill card (SKILL.md, card.yaml) and docs/training/communication-overlap.md must name
every validator rule and every run_script.py flag, their generated blocks must be what
`scripts/generate_docs.py` writes today, and every `run_script.py ...` / `mbridge-epoverlap ...`
command in their fenced code blocks must parse with the real parsers, with dotted overrides that are
valid keys of the recipe's config.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


def _load_generator():
    spec = importlib.util.spec_from_file_location("generate_docs", ROOT / "scripts" / "generate_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["generate_docs"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gen = _load_generator()

MARKDOWN_FILES = (gen.README, gen.SKILL_MD, gen.TRAINING_DOC, gen.SERVING_DOC)
CARD_KEYS = ("title", "validated_on", "summary", "validation_status", "enable_when", "avoid_when", "interactions",
             "config_keys", "recommended_path", "expected_metric_change", "minimal_example", "failure_modes",
             "known_constraints", "known_limitations", "evidence")
# Blocks each file must carry (more are allowed).
REQUIRED_BLOCKS = {
    gen.README: {"results", "results_figure", "cli_summary"},
    gen.SKILL_MD: {"diagnosis", "rules", "run_script_flags", "results", "flex_support", "differences",
                   "core_versions"},
    gen.CARD_YAML: {"failure_modes", "results_yaml"},
    gen.TRAINING_DOC: {"diagnosis", "rules", "run_script_flags", "cli", "results", "schedule_sim", "pingpong_sim",
                       "differences", "core_versions"},
    gen.SERVING_DOC: {"stage_table", "serving_modules", "serving_results"},
}
SHELL_FENCES = ("", "bash", "sh", "shell", "console")


def rule_ids() -> list[str]:
    from mbridge_epoverlap.config.rules import all_rules

    return [r.id for r in all_rules()]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ---- Command extraction --------------------------------------------------------------------------------

# Fenced blocks, also indented ones inside list items.
_FENCE = re.compile(r"^[ \t]*```([\w+-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)


def _commands_in_text(text: str) -> list[tuple[str, list[str]]]:
    """(kind, argv after the program) of every run_script.py / mbridge-epoverlap command in shell text."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("$ ")
        for marker, kind in (("run_script.py", "run_script"), ("mbridge-epoverlap", "cli")):
            start = line.find(marker)
            if start < 0 or (kind == "cli" and "run_script.py" in line):
                continue
            # The program may come with a path (.venv/bin/, python scripts/performance/); argv follows it.
            tokens = shlex.split(line[start:], comments=True)
            found.append((kind, tokens[1:]))
            break
    return found


def markdown_commands(path: Path) -> list[tuple[str, list[str]]]:
    commands = []
    for match in _FENCE.finditer(path.read_text(encoding="utf-8")):
        if match.group(1).lower() in SHELL_FENCES:
            commands += _commands_in_text(match.group(2))
    return commands


def card_commands() -> list[tuple[str, list[str]]]:
    card = yaml.safe_load(gen.CARD_YAML.read_text(encoding="utf-8"))
    texts = list(card["recommended_path"]) + [card["minimal_example"]]
    return [c for text in texts for c in _commands_in_text(" ".join(str(text).split()))]


def all_doc_commands() -> list[tuple[str, str, list[str]]]:
    found = [(_rel(path), kind, argv) for path in MARKDOWN_FILES for kind, argv in markdown_commands(path)]
    found += [(_rel(gen.CARD_YAML), kind, argv) for kind, argv in card_commands()]
    return found


DOC_COMMANDS = all_doc_commands()


# ---- Parsing with the real parsers -------------------------------------------------------------------


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args that fails the test (with argparse's message) instead of exiting."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"does not parse (exit {exc.code}): {shlex.join(argv)}\n{err.getvalue()}")


def check_run_script(argv: list[str], workdir: Path) -> None:
    """Parse with the harness parser, then run the harness as a dry run in `workdir`.

    The dry run resolves the recipe, the dotted overrides (unknown keys and bad values are usage
    errors) and the flags, and validates every A/B case for the target: a documented command must get
    through all of it (exit 0). Nothing is launched; what it writes lands in `workdir`.
    """
    from mbridge_epoverlap.harness.main import main

    _parse_intermixed(gen.harness_parser(), argv)
    out, err = io.StringIO(), io.StringIO()
    with _chdir(workdir), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv + ["--dryrun", "--results_json", str(workdir / "ab.json")])
    assert code == 0, f"run_script.py {shlex.join(argv)} --dryrun exited {code}:\n{err.getvalue()[-3000:]}"


@contextlib.contextmanager
def _chdir(path: Path):
    """contextlib.chdir, which Python 3.10 lacks."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def _parse_intermixed(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """As run_script.py parses (options and KEY=VALUE items in any order)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_intermixed_args(argv)
    except SystemExit as exc:
        pytest.fail(f"does not parse (exit {exc.code}): run_script.py {shlex.join(argv)}\n{err.getvalue()}")


def check_cli(argv: list[str]) -> None:
    """Parse with the real parser, then run the real handler where it needs no input files.

    `validate`, `simulate` (without writing its picture) and `plan` run as a user would run them: a
    usage error (unknown key, bad value, unknown model or GPU) fails the test, and so does a `validate`
    example that finds errors (exit 1): examples in code blocks show configs that work. `profile`
    needs traces and `serve`/`serve-bench`/`elastic-bench` start worker processes (their runs are the serving
    tests'), so only their options are checked.
    """
    from mbridge_epoverlap.errors import UsageError

    args = _parse(gen.cli_parser(), argv)
    assert getattr(args, "handler", None) is not None, f"no subcommand in: mbridge-epoverlap {shlex.join(argv)}"
    try:
        if args.command == "profile":
            from mbridge_epoverlap.profiling.window import parse_window

            parse_window(args.window)
            return
        if args.command in ("serve", "serve-bench", "elastic-bench"):
            return
        if args.command == "simulate":
            args.png = None  # the docs' pictures are drawn by `generate_docs.py --images`, not by tests
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = args.handler(args)
    except UsageError as exc:
        pytest.fail(f"mbridge-epoverlap {shlex.join(argv)}: {exc}")
    assert code == 0, f"mbridge-epoverlap {shlex.join(argv)} exited {code}"


# ---- Tests ---------------------------------------------------------------------------------------------


def test_card_yaml_loads_with_every_key():
    card = yaml.safe_load(gen.CARD_YAML.read_text(encoding="utf-8"))
    missing = [key for key in CARD_KEYS if key not in card]
    assert not missing, f"card.yaml lacks {missing}"
    empty = [key for key in CARD_KEYS if card[key] in (None, "", [], {})]
    assert not empty, f"card.yaml has empty {empty}"
    assert {row["id"] for row in card["failure_modes"]} >= set(rule_ids())


def test_card_config_keys_are_valid_override_keys():
    from mbridge_epoverlap.config.overrides import valid_keys
    from mbridge_epoverlap.recipes import DEFAULT_RECIPE
    from mbridge_epoverlap.recipes.loader import load_recipe

    cfg = load_recipe(DEFAULT_RECIPE)
    keys = set(valid_keys(cfg))
    card = yaml.safe_load(gen.CARD_YAML.read_text(encoding="utf-8"))
    # env_vars is a mapping: any variable name under it is a valid key.
    bad = [k for k in card["config_keys"] if k not in keys and not k.startswith("env_vars.")]
    assert not bad, f"card.yaml config_keys that no override accepts: {bad}"


@pytest.mark.parametrize("path", [gen.SKILL_MD, gen.TRAINING_DOC], ids=_rel)
def test_every_rule_id_has_a_diagnosis_row(path):
    text = path.read_text(encoding="utf-8")
    missing = [rule for rule in rule_ids() if not re.search(rf"^\| `{re.escape(rule)}` \|", text, re.MULTILINE)]
    assert not missing, f"{_rel(path)} has no table row for rule(s) {missing}; run `make docs`"


WARNING_ONLY_RULES = {"model_switch_overwritten", "packing_clears_overlap", "ncclep_zero_copy_overlap"}
# Rules that cannot fire alone, with the rules that always come along: delayed wgrad needs EP overlap, which needs
# a MoE model with EP > 1, and Megatron-Bridge main refuses both under Megatron-FSDP v2 before Megatron-Core would.
COMPANIONS = {"fsdp_v2_delay_wgrad": {"fsdp_v2_dp_only", "fsdp_v2_moe"}}


def test_diagnosis_reproducers_trip_exactly_their_rule_through_the_cli():
    from mbridge_epoverlap.cli import main
    from mbridge_epoverlap.config.rules import all_rules

    for rule in all_rules():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(gen.rule_command(rule) + ["--json"])
        report = json.loads(out.getvalue())
        rules = [v["rule"] for v in report["violations"]]
        if rule.id in COMPANIONS:
            assert rule.id in rules and set(rules) - {rule.id} <= COMPANIONS[rule.id], rules
            assert code == 1
            continue
        assert rules == [rule.id], f"{rule.id}: the reproducer reports {rules}"
        if rule.id in WARNING_ONLY_RULES:  # a warning by design: the job runs, differently from what was asked
            assert (code, report["violations"][0]["severity"]) == (0, "warning"), rule.id
            continue
        assert code == 1, f"{rule.id}: expected an error (exit 1), got exit {code}"


@pytest.mark.parametrize("path", [gen.SKILL_MD, gen.TRAINING_DOC], ids=_rel)
def test_every_run_script_flag_is_documented(path):
    parser = gen.harness_parser()
    text = path.read_text(encoding="utf-8")
    flags = [s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")]
    missing = [flag for flag in flags if f"`{flag}`" not in text]
    assert not missing, f"{_rel(path)} does not document run_script.py flag(s) {missing}; run `make docs`"


def test_every_cli_subcommand_and_option_is_documented():
    text = gen.TRAINING_DOC.read_text(encoding="utf-8")
    for name, (_, sub) in gen.subcommands(gen.cli_parser()).items():
        assert f"`mbridge-epoverlap {name}`" in text, f"subcommand {name} is not in {_rel(gen.TRAINING_DOC)}"
        options = [s for a in sub._actions for s in a.option_strings if s not in ("-h", "--help")]
        missing = [o for o in options if f"`{o}`" not in text]
        assert not missing, f"`mbridge-epoverlap {name}` option(s) {missing} are not documented; run `make docs`"


@pytest.mark.parametrize("path", list(REQUIRED_BLOCKS), ids=_rel)
def test_generated_blocks_are_present_and_known(path):
    names = gen.generated_blocks(path)
    assert len(names) == len(set(names)), f"{_rel(path)} repeats a block"
    unknown = set(names) - set(gen.RENDERERS)
    assert not unknown, f"{_rel(path)}: unknown generated blocks {unknown}"
    missing = REQUIRED_BLOCKS[path] - set(names)
    assert not missing, f"{_rel(path)} lacks generated blocks {missing}"
    text = path.read_text(encoding="utf-8")
    begins = len(re.findall(r"BEGIN GENERATED:", text))
    ends = len(re.findall(r"END GENERATED:", text))
    assert begins == ends == len(names), f"{_rel(path)} has unbalanced or malformed markers"


def test_check_mode_exits_1_on_a_stale_file(tmp_path, monkeypatch):
    stale_copy = tmp_path / "SKILL.md"
    text = gen.SKILL_MD.read_text(encoding="utf-8")
    stale_copy.write_text(text.replace("<!-- BEGIN GENERATED: rules -->\n",
                                       "<!-- BEGIN GENERATED: rules -->\n| `no_such_rule` |\n"), encoding="utf-8")
    monkeypatch.setattr(gen, "DOC_FILES", (stale_copy,))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert gen.main(["--check"]) == 1
    assert "no_such_rule" in stale_copy.read_text(encoding="utf-8"), "--check must not write"
    with contextlib.redirect_stdout(io.StringIO()):
        assert gen.main([]) == 0
    assert "no_such_rule" not in stale_copy.read_text(encoding="utf-8")
    with contextlib.redirect_stdout(io.StringIO()):
        assert gen.main(["--check"]) == 0


def test_generated_blocks_are_up_to_date_as_the_script_checks_them():
    """`generate_docs.py --check` as CI and a contributor run it: exit 0 on this tree (1 names each stale block with
    its diff, `test_check_mode_exits_1_on_a_stale_file`), so every generated block is current."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, "out of date (run `make docs`):\n" + proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_docs_show_commands_of_every_kind():
    kinds = {(path, kind) for path, kind, _ in DOC_COMMANDS}
    for path in MARKDOWN_FILES:
        for kind in ("run_script", "cli"):
            assert (_rel(path), kind) in kinds, f"no {kind} command found in {_rel(path)}'s code blocks"
    shown = {argv[0] for _, kind, argv in DOC_COMMANDS if kind == "cli" and argv}
    assert {"validate", "profile", "plan", "simulate"} <= shown


@pytest.mark.parametrize(("path", "kind", "argv"), DOC_COMMANDS,
                         ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(DOC_COMMANDS)])
def test_doc_command_parses(path, kind, argv, tmp_path):
    if kind == "run_script":
        check_run_script(argv, tmp_path)
    else:
        check_cli(argv)


def test_a_broken_command_is_caught(tmp_path):
    broken = (AssertionError, pytest.fail.Exception)
    with pytest.raises(broken, match="unrecognized arguments: --no-such-flag"):
        check_cli(["validate", "--no-such-flag"])
    with pytest.raises(broken, match="unknown config key 'model.no_such_key'"):
        check_cli(["validate", "model.no_such_key=1"])
    with pytest.raises(broken, match=r"recompute_granularity=full exited 1\b"):  # parses, but the config breaks a rule
        check_cli(["validate", "-g", "h100", "comm_overlap.overlap_moe_expert_parallel_comm=true",
                   "model.recompute_granularity=full"])
    with pytest.raises(broken, match="argument --moe_a2a_overlap: expected true or false, got 'maybe'"):
        check_run_script(["-g", "h100", "--moe_a2a_overlap", "maybe"], tmp_path)
    with pytest.raises(broken, match=r"exited 2:\s+error: unknown config key 'comm_overlap.no_such_switch'"):
        check_run_script(["-g", "h100", "comm_overlap.no_such_switch=true"], tmp_path)
    # parses, but breaks a rule: the dry run's validation says so
    with pytest.raises(broken, match=r"(?s)exited 1:.*\[recompute_full\] EP overlap does not work with full"):
        check_run_script(["-g", "h100", "-ng", "16", "--moe_a2a_overlap", "true",
                          "model.recompute_granularity=full"], tmp_path)


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=_rel)
def test_images_exist(path):
    text = path.read_text(encoding="utf-8")
    for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (path.parent / target).is_file(), f"{_rel(path)} shows missing image {target}"


def test_results_block_without_and_with_a_results_json(tmp_path, monkeypatch):
    monkeypatch.setattr(gen, "RESULTS_JSON", tmp_path / "cpu_ab.json")
    assert gen.render_results().startswith("Not yet measured")
    assert "not yet measured" in gen.render_results_yaml()
    results = {
        "recipe": "qwen3_30b_a3b", "task": "pretrain", "gpu": "cpu", "num_gpus": 2, "ab": "ep_overlap",
        "executor": "local", "max_steps": 10, "repeats": 2, "stable_window": [3, 8],
        "created_utc": "2025-01-01T00:00:00+00:00",
        "environment": {"machine": {"hostname": "box", "cpus": 2}, "torch_version": "2.13.0"},
        "cases": [
            {"name": "ep_overlap_off", "overrides": [], "stable_mean_s": 0.5, "relative": 1.0,
             "loss_match_baseline": None, "finite_loss": True, "skipped_iters": 0, "nan_iters": 0,
             "peak_mem_bytes": 1 << 30, "tflops_per_gpu": None},
            {"name": "ep_overlap_on", "overrides": ["comm_overlap.overlap_moe_expert_parallel_comm=true"],
             "stable_mean_s": 0.4, "relative": 1.25, "loss_match_baseline": True, "finite_loss": True,
             "skipped_iters": 0, "nan_iters": 0, "peak_mem_bytes": 1 << 30, "tflops_per_gpu": None},
        ],
    }
    (tmp_path / "cpu_ab.json").write_text(json.dumps(results), encoding="utf-8")
    text = gen.render_results()
    assert "ep_overlap_on" in text and "1.250x" in text and "box" in text
    assert "--ab ep_overlap" in text and "--stable_window 3:8" in text
    assert "CPU flags not recorded" in text
    results["environment"]["machine"]["cpu_flags"] = ["avx2"]
    results["environment"]["compute_dtype"] = {"dtype": "fp32", "reason": "fp32 instead of the recipe's bf16"}
    (tmp_path / "cpu_ab.json").write_text(json.dumps(results), encoding="utf-8")
    text = gen.render_results()
    assert "CPU flags avx2 (no native bf16); computed in fp32 instead of the recipe's bf16" in text
    command = text.split("command: `", 1)[1].split("`", 1)[0]
    check_run_script(shlex.split(command)[2:], tmp_path)  # the command the table shows is one that runs
    assert yaml.safe_load("measured:\n" + gen.render_results_yaml())["measured"]["status"] == "measured"


def test_ab_case_names_in_the_docs_are_the_harness_cases():
    from mbridge_epoverlap.harness import cases

    names = [name for name, _, _ in cases.EP_OVERLAP_CASES]
    for path in (gen.SKILL_MD, gen.TRAINING_DOC):
        text = path.read_text(encoding="utf-8")
        shown = set(re.findall(r"`(ep_overlap_\w+)`", text))
        assert shown == set(names), f"{_rel(path)} names A/B cases {sorted(shown)}, the harness has {names}"


def test_gantt_commands_shown_are_the_ones_that_draw_the_pictures():
    text = gen.TRAINING_DOC.read_text(encoding="utf-8")
    for path, args in gen.GANTT_COMMANDS.items():
        shown = f"mbridge-epoverlap {shlex.join(args)}"
        assert shown in text, f"the doc does not show the command drawing {path.name}"
        assert f"img/{path.name}" in text
