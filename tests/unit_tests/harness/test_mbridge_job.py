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


def test_the_job_changes_only_what_the_user_and_the_case_set():
    """Upstream's run_script.py keeps every recipe value the flags do not name; so does the job (issue #23:
    copying the project's own recipe over upstream's turned EP overlap, flex and graphs off)."""
    target = bridge_like()
    target.model.moe_permute_fusion, target.ddp.grad_reduce_in_fp32 = True, False  # the recipe's tuning
    changes = {"model.expert_model_parallel_size": 8, "comm_overlap.overlap_moe_expert_parallel_comm": False,
               "model.seq_length": 2048, "num_gpus": 16, "env_vars.NCCL_DEBUG": "INFO", "model.no_such_field": 1}
    missing = mbridge_job.apply_changes(target, changes, max_steps=8)
    assert target.model.expert_model_parallel_size == 8 and target.dataset.sequence_length == 2048
    assert target.comm_overlap.overlap_moe_expert_parallel_comm is False
    assert target.model.moe_permute_fusion is True and target.ddp.grad_reduce_in_fp32 is False  # untouched
    assert (target.model.num_layers, target.train.global_batch_size) == (1, 1)
    assert target.comm_overlap.overlap_grad_reduce is None and target.model.cuda_graph_scope == "full"
    assert (target.train.train_iters, target.logger.log_interval) == (8, 1)
    assert missing == ["model.no_such_field"]


def test_a_none_backend_asks_for_alltoall():
    target = bridge_like()
    target.model.moe_token_dispatcher_type, target.model.moe_flex_dispatcher_backend = "flex", "deepep"
    mbridge_job.apply_changes(target, {"model.moe_flex_dispatcher_backend": None}, max_steps=1)
    assert (target.model.moe_token_dispatcher_type, target.model.moe_flex_dispatcher_backend) == ("alltoall", None)


@pytest.mark.skipif(importlib.util.find_spec("megatron.bridge") is not None, reason="Megatron-Bridge is installed")
def test_missing_bridge_is_a_clear_error(tmp_path, capsys):
    config = tmp_path / "case.yaml"
    config.write_text(load_recipe("qwen3_30b_a3b").to_yaml())
    assert mbridge_job.main(["--config", str(config), "--max-steps", "3"]) == mbridge_job.EXIT_NO_BRIDGE
    err = capsys.readouterr().err
    assert "Megatron-Bridge is not importable" in err and "MBRIDGE_EPOVERLAP_PYTHON" in err


@pytest.mark.skipif(importlib.util.find_spec("megatron.bridge") is not None, reason="Megatron-Bridge is installed")
def test_an_offline_job_without_the_models_config_is_a_usage_error_not_a_retry_loop(tmp_path, capsys, monkeypatch):
    """Kimi K2's recipe loads moonshotai/Kimi-K2-Instruct's config.json; offline and not cached, the job stops at
    once naming the model and the cache (Megatron-Bridge would retry four times, then fail)."""
    from mbridge_epoverlap.harness.hf_configs import hf_models, write_hf_cache

    config = tmp_path / "case.yaml"
    config.write_text(load_recipe("kimi_k2").to_yaml())
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert mbridge_job.main(["--config", str(config), "--max-steps", "3"]) == 2
    err = capsys.readouterr().err
    cache = tmp_path / "hf" / "hub"
    assert f"moonshotai/Kimi-K2-Instruct, whose config.json is not in the Hugging Face cache {cache}" in err
    assert "Traceback" not in err
    for model_id, cfg, code in hf_models("kimi_k2"):
        write_hf_cache(tmp_path / "hf", model_id, cfg, set(), code)
    assert mbridge_job.main(["--config", str(config), "--max-steps", "3"]) == mbridge_job.EXIT_NO_BRIDGE
    monkeypatch.delenv("HF_HUB_OFFLINE")
    (tmp_path / "hf").rename(tmp_path / "elsewhere")  # online, a missing config is Bridge's to download
    assert mbridge_job.main(["--config", str(config), "--max-steps", "3"]) == mbridge_job.EXIT_NO_BRIDGE
