"""Every flag of Megatron-Bridge's run_script.py parses here with upstream's names, type and default.

Mirrors the parser of NVIDIA-NeMo/Megatron-Bridge `scripts/performance/argument_parser.py` (the flag
table `harness/upstream_flags.py` holds its facts); the pass-through routing is what `--dryrun` shows.
"""

from __future__ import annotations

import argparse

import pytest

from mbridge_epoverlap.harness.flags import UNSET, TimeLimit, build_parser
from mbridge_epoverlap.harness.upstream_flags import (
    OMITTED,
    UPSTREAM_FLAGS,
    job_settings,
    passthrough_routes,
)

PARSER = build_parser()

# A value upstream accepts for each converter, and what upstream's converter makes of it.
SAMPLES = {
    "str": ("x", "x"), None: ("x", "x"), "lower_str": ("Qwen", "qwen"), "int": ("3", 3), "float": ("0.5", 0.5),
    "bool": ("false", False), "list_of_strings": ("a,b", ["a", "b"]), "list_of_ints": ("0,1", [0, 1]),
    "dict": ("A=1,B=2", {"A": "1", "B": "2"}), "key_value": ("A=1", ("A", "1")),
    "slurm_params": ("nodelist=n1,n2;constraint=gpu", {"nodelist": "n1,n2", "constraint": "gpu"}),
    "none_or_int": ("2", 2), "none_or_str": ("deepep", "deepep"),
    "cuda_graph_impl": ("transformer_engine", "transformer_engine"),
    "cuda_graph_scope": ("attn,moe_router", ["attn", "moe_router"]),
}
# Where this project's flag deliberately differs (documented in the Differences table, or a richer type).
DEFAULT_EXCEPTIONS = {
    "--compute_dtype": "the recipe's precision when absent (GPU recipe lookup uses bf16 as upstream does)",
    "--detach": "false: the harness follows the job to report the A/B (upstream submits and returns)",
}
# Our parsed form of a sample, where the project's type is richer than upstream's string.
OUR_FORM = {"--time_limit": lambda value: value.text}
SAMPLE_OVERRIDE = {"--time_limit": ("01:00:00", "01:00:00"), "--model_family_name": ("Qwen", "qwen"),
                   "--gpu": ("H100", "h100"), "--num_gpus": ("16", 16)}


def _action(option: str) -> argparse.Action:
    for action in PARSER._actions:
        if option in action.option_strings:
            return action
    raise AssertionError(f"run_script.py has no flag {option}")


def test_the_table_holds_every_upstream_flag_once():
    longs = [f.long for f in UPSTREAM_FLAGS]
    assert len(longs) == len(set(longs)) == 134
    assert {f.destination for f in UPSTREAM_FLAGS} == {"harness", "sbatch", "job", "kubeflow", "checks"}


@pytest.mark.parametrize("flag", UPSTREAM_FLAGS, ids=lambda f: f.long)
def test_flag_has_upstream_names_and_default(flag):
    action = _action(flag.long)
    if flag.short:
        assert _action(flag.short) is action, f"{flag.short} is not {flag.long}"
    default = action.default
    if flag.long in DEFAULT_EXCEPTIONS:
        return
    if isinstance(default, TimeLimit):
        assert default.text == flag.default
    elif flag.default in (None, OMITTED):
        assert default is UNSET or default is None, f"{flag.long}: default {default!r}"
    else:
        assert default == flag.default, f"{flag.long}: default {default!r}, upstream {flag.default!r}"
    for choice in (c for c in flag.choices or () if c is not None):  # every upstream choice is accepted here
        assert getattr(PARSER.parse_args([flag.long, choice]), action.dest) == choice, (flag.long, choice)


@pytest.mark.parametrize("flag", UPSTREAM_FLAGS, ids=lambda f: f.long)
def test_flag_parses_upstream_values_to_the_same_value(flag):
    name = flag.short or flag.long
    if flag.kind == "switch":
        assert getattr(PARSER.parse_args([name]), _action(flag.long).dest) is True
        return
    text, expected = SAMPLE_OVERRIDE.get(flag.long, SAMPLES[flag.type])
    if flag.choices:
        text = expected = next(c for c in flag.choices if c is not None)
    value = getattr(PARSER.parse_args([name, text]), _action(flag.long).dest)
    value = OUR_FORM.get(flag.long, lambda v: v)(value)
    if flag.kind == "append":
        expected = [[expected]] if flag.nargs == "*" else [expected]
    elif flag.nargs in ("*", "+"):
        expected = [expected]
    assert value == expected, f"{name} {text!r}: {value!r}, upstream gives {expected!r}"


def test_detach_takes_true_and_false_as_upstream():
    assert PARSER.parse_args(["--detach", "false"]).detach is False
    assert PARSER.parse_args(["--detach", "true"]).detach is True
    assert PARSER.parse_args(["--detach"]).detach is True


def test_bad_values_exit_2_naming_the_flag(capsys):
    with pytest.raises(SystemExit, match="^2$") as info:  # argparse's usage-error exit status
        PARSER.parse_args(["--max_retries", "many"])
    assert info.value.code == 2
    assert "--max_retries" in capsys.readouterr().err


def test_passthrough_routes_say_where_each_flag_went():
    args = PARSER.parse_args(["-i", "nvcr.io/nvidia/nemo:25.09", "--gres", "gpu:8", "--lr", "1e-4", "-wdp", "proj",
                              "--kubeflow_namespace", "ns", "--golden_values_path", "g.json", "--max_retries", "5"])
    routes = {r.flag: (r.destination, r.value) for r in passthrough_routes(args)}
    assert routes == {
        "--container_image": ("sbatch", "nvcr.io/nvidia/nemo:25.09"), "--gres": ("sbatch", "gpu:8"),
        "--lr": ("job", 1e-4), "--wandb_project_name": ("job", "proj"), "--kubeflow_namespace": ("kubeflow", "ns"),
        "--golden_values_path": ("checks", "g.json"), "--max_retries": ("sbatch", 5),
    }
    assert job_settings(passthrough_routes(args)) == {"lr": 1e-4, "wandb_project_name": "proj",
                                                      "golden_values_path": "g.json"}
    assert passthrough_routes(PARSER.parse_args([])) == []


def test_nemo_home_defaults_to_the_environment(monkeypatch):
    """argument_parser.py: DEFAULT_NEMO_HOME = os.getenv("NEMO_HOME", ~/.cache/nemo)."""
    from mbridge_epoverlap.harness.flags import build_parser
    from mbridge_epoverlap.harness.upstream_flags import passthrough_routes

    monkeypatch.setenv("NEMO_HOME", "/lustre/nemo")
    args = build_parser().parse_intermixed_args(["-g", "h100"])
    assert args.nemo_home == "/lustre/nemo"
    assert not [r for r in passthrough_routes(args) if r.flag == "--nemo_home"]  # the default is not a request
    monkeypatch.delenv("NEMO_HOME")
    assert build_parser().parse_intermixed_args(["-g", "h100"]).nemo_home == "~/.cache/nemo"
