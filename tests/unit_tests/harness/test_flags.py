"""The command line: Megatron-Bridge-compatible flags, tri-state defaults, value parsing."""

from __future__ import annotations

import argparse

import pytest

from mbridge_epoverlap.arg_types import bool_arg
from mbridge_epoverlap.harness.flags import (
    UNSET,
    build_parser,
    flags_markdown,
    given,
    graph_scopes,
    time_limit,
)

MB_STYLE = [
    "-m", "qwen", "-mr", "qwen3_30b_a3b", "--task", "pretrain", "-g", "h100", "-c", "bf16", "-ng", "16", "-gn", "8",
    "--max_steps", "8", "--cuda_graph_impl", "none", "--moe_flex_dispatcher_backend", "None",
    "--moe_a2a_overlap", "false", "--tokenizer_type", "NullTokenizer",
    "comm_overlap.overlap_moe_expert_parallel_comm=true", "comm_overlap.delay_wgrad_compute=false",
    "model.moe_shared_expert_overlap=false",
]


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_intermixed_args(argv)


def test_skill_card_command_parses():
    args = parse(MB_STYLE)
    assert args.gpu == "h100" and args.num_gpus == 16 and args.gpus_per_node == 8 and args.max_steps == 8
    assert args.moe_flex_dispatcher_backend is None and args.moe_a2a_overlap is False
    assert args.overrides == MB_STYLE[-3:]


def test_absent_flags_are_unset_not_none():
    args = parse([])
    for dest in ("moe_a2a_overlap", "delay_wgrad_compute", "moe_flex_dispatcher_backend", "num_gpus", "compute_dtype",
                 "virtual_pipeline_model_parallel_size", "expert_tensor_parallel_size", "recompute_modules"):
        assert getattr(args, dest) is UNSET
        assert not given(args, dest)


def test_explicit_none_values():
    args = parse(["-vp", "None", "-et", "--recompute_granularity", "None", "--moe_flex_dispatcher_backend", "None"])
    assert args.virtual_pipeline_model_parallel_size is None
    assert args.expert_tensor_parallel_size is None
    assert args.recompute_granularity is None
    assert given(args, "virtual_pipeline_model_parallel_size") and given(args, "expert_tensor_parallel_size")


def test_short_flags():
    args = parse(["-tp", "2", "-pp", "4", "-cp", "2", "-vp", "5", "-ep", "8", "-et", "1", "-gb", "64", "-mb", "2",
                  "-sl", "2048", "-ms", "12", "-rl", "3", "-a", "acct", "-p", "part", "-t", "01:00:00", "-d"])
    sizes = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size)
    assert sizes == (2, 4, 2)
    assert args.virtual_pipeline_model_parallel_size == 5 and args.expert_model_parallel_size == 8
    assert args.global_batch_size == 64 and args.micro_batch_size == 2 and args.seq_length == 2048
    assert args.max_steps == 12 and args.recompute_num_layers == 3 and args.dryrun
    assert args.time_limit.seconds == 3600 and args.account == "acct" and args.partition == "part"


def test_overrides_may_come_between_flags():
    args = parse(["model.bf16=true", "-g", "cpu", "comm_overlap.delay_wgrad_compute=false", "-ng", "2"])
    assert args.overrides == ["model.bf16=true", "comm_overlap.delay_wgrad_compute=false"]


@pytest.mark.parametrize("argv", [["--bogus"], ["--moe_a2a_overlap", "maybe"], ["-g", "tpu"], ["-ng", "0"],
                                  ["--cuda_graph_scope", "attn,everything"], ["-t", "soon"], ["--from_logs", "x"],
                                  ["--moe_flex_dispatcher_backend", "nccl"], ["-c", "int4"]])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit, match="^2$") as exc:  # argparse's usage-error exit status
        parse(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "value"), [("true", True), ("False", False), ("1", True), ("no", False)])
def test_bool_arg(text, value):
    assert bool_arg(text) is value


@pytest.mark.parametrize(("text", "seconds"), [("30", 1800), ("05:30", 330), ("00:30:00", 1800), ("1-02", 93600),
                                               ("1-00:00:10", 86410)])
def test_time_limit_formats(text, seconds):
    assert time_limit(text).seconds == seconds


def test_graph_scopes():
    assert graph_scopes("attn,moe_router") == ["attn", "moe_router"]
    assert graph_scopes("none") == []


def test_markdown_lists_every_flag():
    text = flags_markdown()
    for flag in ("--model_recipe_name", "--moe_a2a_overlap", "--stable_window", "--from_logs", "--executor",
                 "--time_limit", "--emulate_link_gbps", "--te_version", "--save_config_filepath"):
        assert f"`{flag}`" in text
