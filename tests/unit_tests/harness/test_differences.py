"""Each row of the "Differences from Megatron-Bridge" table behaves as the row says (and nothing else differs
by intent: the table is generated from `config/differences.py` into the skill card and the training doc)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mbridge_epoverlap.config import Environment, FlexDispatcherWarning, apply_flex_dispatcher_backend
from mbridge_epoverlap.config.differences import DIFFERENCES
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.harness.flags import build_parser
from mbridge_epoverlap.harness.resolve import resolve
from mbridge_epoverlap.recipes.loader import load_recipe

GPU = ("-g", "h100", "-ng", "16", "--te_version", "2.9")


def resolved(*argv: str):
    args = build_parser().parse_intermixed_args(list(argv))
    args.gpu = args.gpu or "cpu"
    return resolve(args)


def row(start: str):
    return next(d for d in DIFFERENCES if d.topic.startswith(start))


def test_every_row_is_complete_and_generated_into_both_docs():
    from scripts.generate_docs import SKILL_MD, TRAINING_DOC

    for d in DIFFERENCES:
        assert d.upstream and d.ours and d.why
        for path in (SKILL_MD, TRAINING_DOC):
            assert d.topic in path.read_text(encoding="utf-8"), (d.topic, path)


def test_moe_a2a_overlap_false_switches_overlap_off():
    assert row("`--moe_a2a_overlap false`")
    cfg = resolved(*GPU, "--moe_a2a_overlap", "false").cfg
    assert cfg.comm_overlap.overlap_moe_expert_parallel_comm is False


def test_moe_a2a_overlap_true_sets_overlap_only():
    assert row("`--moe_a2a_overlap true`")
    recipe = load_recipe("qwen3_30b_a3b")
    cfg = resolved(*GPU, "--moe_a2a_overlap", "true").cfg
    assert cfg.comm_overlap.overlap_moe_expert_parallel_comm is True
    assert cfg.comm_overlap.delay_wgrad_compute == recipe.comm_overlap.delay_wgrad_compute


def test_flag_and_override_that_disagree_is_an_error():
    assert row("a flag and a dotted override")
    with pytest.raises(UsageError, match="expert_model_parallel_size"):
        resolved(*GPU, "-ep", "4", "model.expert_model_parallel_size=8")


def test_explicit_flex_backend_on_an_unsupported_gpu():
    assert row("an explicit flex backend")
    r = resolved("-g", "gb200", "-ng", "16", "--moe_flex_dispatcher_backend", "deepep")
    assert "flex_backend_gpu" in [v.rule for v in r.cfg.validate(r.target.env) if v.severity == "error"]
    model = SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="alltoall")
    with pytest.warns(FlexDispatcherWarning):  # the library call keeps upstream's fallback
        apply_flex_dispatcher_backend(model, "deepep", env=Environment.for_gpu("gb200"))
    assert (model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend) == ("alltoall", None)


def test_launcher_defaults():
    assert row("the launcher")
    args = build_parser().parse_args([])
    assert args.detach is False and args.container_image == "nvcr.io/nvidia/nemo:dev"


def test_absent_compute_dtype_keeps_the_recipe_precision():
    assert row("`-c/--compute_dtype` absent")
    recipe = load_recipe("qwen3_30b_a3b")
    cfg = resolved(*GPU).cfg
    assert (cfg.model.bf16, cfg.model.fp16) == (recipe.model.bf16, recipe.model.fp16)


def test_validation_reports_every_violation():
    assert row("validation of the overlap settings")
    cfg = load_recipe("qwen3_30b_a3b")
    cfg.comm_overlap.overlap_moe_expert_parallel_comm = True
    cfg.model.expert_model_parallel_size, cfg.model.bf16 = 1, False
    errors = {v.rule for v in cfg.validate(Environment.for_gpu("h100", torch_version="2.8")) if v.severity == "error"}
    assert {"ep_size", "precision"} <= errors
