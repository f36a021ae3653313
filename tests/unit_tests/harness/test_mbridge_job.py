"""The GPU job entry point: settings copied onto Megatron-Bridge's config, a clear error without it."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from mbridge_epoverlap.harness import mbridge_job
from mbridge_epoverlap.recipes.loader import load_recipe


def bridge_like():
    """An object with the attribute layout of Megatron-Bridge's ConfigContainer (only what is read)."""
    model = SimpleNamespace(num_layers=1, hidden_size=1, expert_model_parallel_size=1,
                            overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False,
                            moe_token_dispatcher_type="alltoall", cuda_graph_scope="full", bf16=False)
    return SimpleNamespace(
        model=model,
        comm_overlap=SimpleNamespace(overlap_moe_expert_parallel_comm=None, delay_wgrad_compute=None,
                                     overlap_grad_reduce=None, tp_comm_overlap=False),
        train=SimpleNamespace(global_batch_size=1, micro_batch_size=1, train_iters=1),
        ddp=SimpleNamespace(overlap_grad_reduce=False, overlap_param_gather=False),
        dataset=SimpleNamespace(sequence_length=1),
        tokenizer=SimpleNamespace(tokenizer_type="HuggingFaceTokenizer", vocab_size=None),
        logger=SimpleNamespace(log_interval=10),
        mixed_precision=None,
    )


def test_apply_run_config_copies_settings_by_name():
    run = load_recipe("qwen3_30b_a3b")
    run.comm_overlap.overlap_moe_expert_parallel_comm = True
    target = bridge_like()
    missing = mbridge_job.apply_run_config(target, run, max_steps=8, mixed_precision="bf16_mixed",
                                           tokenizer_type="NullTokenizer")
    assert target.model.num_layers == 48 and target.model.expert_model_parallel_size == 16
    assert target.model.cuda_graph_scope == "full"  # an empty scope list keeps Megatron-Bridge's default
    assert target.comm_overlap.overlap_moe_expert_parallel_comm is True
    assert target.comm_overlap.overlap_grad_reduce is None  # unset in ours: Megatron-Bridge's default stays
    assert (target.train.train_iters, target.train.global_batch_size) == (8, 1024)
    assert target.ddp.overlap_grad_reduce is True and target.dataset.sequence_length == 4096
    assert target.mixed_precision == "bf16_mixed" and target.tokenizer.tokenizer_type == "NullTokenizer"
    assert target.tokenizer.vocab_size == run.model.vocab_size and target.logger.log_interval == 1
    assert "model.moe_router_topk" in missing


@pytest.mark.skipif(importlib.util.find_spec("megatron.bridge") is not None, reason="Megatron-Bridge is installed")
def test_missing_bridge_is_a_clear_error(tmp_path, capsys):
    config = tmp_path / "case.yaml"
    config.write_text(load_recipe("qwen3_30b_a3b").to_yaml())
    assert mbridge_job.main(["--config", str(config), "--max-steps", "3"]) == mbridge_job.EXIT_NO_BRIDGE
    err = capsys.readouterr().err
    assert "Megatron-Bridge is not importable" in err and "MBRIDGE_EPOVERLAP_PYTHON" in err
