"""Resolution order and the tri-state switches: recipe -> overrides -> flags -> CPU shrink."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.harness.flags import build_parser
from mbridge_epoverlap.harness.recipe_facts import facts_for
from mbridge_epoverlap.harness.resolve import pick_recipe, resolve
from mbridge_epoverlap.recipes.loader import load_recipe


def resolved(*argv: str):
    args = build_parser().parse_intermixed_args(list(argv))
    args.gpu = args.gpu or "cpu"
    return resolve(args)


def overlap_switches(cfg):
    return cfg.comm_overlap.overlap_moe_expert_parallel_comm, cfg.comm_overlap.delay_wgrad_compute


GPU = ("-g", "h100", "-ng", "16", "--te_version", "2.9")


def upstream_values(function: str = "qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config") -> dict:
    """The released Megatron-Bridge recipe's values (the recipe a GPU job builds)."""
    return facts_for("megatron.bridge.perf_recipes.qwen", function)["values"]


def test_absent_switches_keep_the_recipe():
    """A GPU job builds Megatron-Bridge's recipe: flags that are absent keep its values (EP overlap on, flex)."""
    recipe = upstream_values()
    r = resolved(*GPU)
    assert overlap_switches(r.cfg) == (recipe["comm_overlap.overlap_moe_expert_parallel_comm"],
                                       recipe["comm_overlap.delay_wgrad_compute"]) == (True, False)
    assert r.cfg.model.moe_token_dispatcher_type == recipe["model.moe_token_dispatcher_type"] == "flex"
    cpu = resolved("-g", "cpu")  # the reference runtime runs the project's own recipe
    assert overlap_switches(cpu.cfg) == overlap_switches(load_recipe("qwen3_30b_a3b"))


def test_overlap_false_turns_overlap_off_even_when_the_recipe_has_it_on(tmp_path):
    recipe_file = tmp_path / "on.py"
    recipe_file.write_text(
        "from mbridge_epoverlap.recipes.loader import load_recipe\n"
        "def recipe(task):\n"
        "    cfg = load_recipe('qwen3_30b_a3b', task)\n"
        "    cfg.recipe = 'qwen3_on'\n"  # a name Megatron-Bridge has no recipe for: the file's values are validated
        "    cfg.comm_overlap.overlap_moe_expert_parallel_comm = True\n"
        "    cfg.comm_overlap.delay_wgrad_compute = True\n"
        "    return cfg\n")
    r = resolved(*GPU, "-mr", str(recipe_file), "--moe_a2a_overlap", "false")
    assert overlap_switches(r.cfg) == (False, True)  # delay untouched: exactly one setting changes


def test_overlap_true_does_not_add_delayed_wgrad():
    r = resolved(*GPU, "--moe_a2a_overlap", "true")
    assert overlap_switches(r.cfg) == (True, False)


def test_delay_flag_is_its_own_switch():
    r = resolved(*GPU, "--delay_wgrad_compute", "true")
    assert overlap_switches(r.cfg) == (upstream_values()["comm_overlap.overlap_moe_expert_parallel_comm"], True)
    r = resolved(*GPU, "--moe_a2a_overlap", "false", "--delay_wgrad_compute", "true")
    assert overlap_switches(r.cfg) == (False, True)


def test_flag_and_override_disagreeing_is_a_usage_error():
    with pytest.raises(UsageError, match="give each setting once"):
        resolved(*GPU, "--moe_a2a_overlap", "false", "comm_overlap.overlap_moe_expert_parallel_comm=true")


def test_flag_and_override_agreeing_is_fine():
    r = resolved(*GPU, "--moe_a2a_overlap", "true", "comm_overlap.overlap_moe_expert_parallel_comm=true")
    assert r.cfg.comm_overlap.overlap_moe_expert_parallel_comm is True


def test_overrides_then_flags_reach_the_model():
    r = resolved(*GPU, "-tp", "2", "-ep", "8", "--cuda_graph_impl", "transformer_engine", "--cuda_graph_scope",
                 "attn,moe_router", "--recompute_modules", "core_attn,moe_act", "model.moe_permute_fusion=true")
    m = r.cfg.model
    assert (m.tensor_model_parallel_size, m.expert_model_parallel_size) == (2, 8)
    assert m.cuda_graph_scope == ["attn", "moe_router"] and m.recompute_modules == ["core_attn", "moe_act"]
    assert m.moe_permute_fusion is True
    assert {"model.tensor_model_parallel_size", "model.moe_permute_fusion"} <= r.explicit


def test_max_steps_sets_train_iters():
    assert resolved(*GPU, "--max_steps", "7").cfg.train.train_iters == 7
    assert resolved(*GPU).max_steps == 10
    assert resolved(*GPU, "train.train_iters=4").max_steps == 4


def test_cpu_shrinks_with_ep_equal_to_processes_and_keeps_batch_flags():
    r = resolved("-g", "cpu", "-ng", "2", "-gb", "8", "-mb", "1", "-sl", "64")
    m = r.cfg.model
    assert r.cfg.num_gpus == 2 and m.expert_model_parallel_size == 2
    assert m.hidden_size < 2048 and m.seq_length == 64
    assert (r.cfg.train.global_batch_size, r.cfg.train.micro_batch_size) == (8, 1)


def test_cpu_default_processes_and_explicit_ep():
    assert resolved("-g", "cpu").cfg.num_gpus == 2
    assert resolved("-g", "cpu", "-ng", "4", "-ep", "2").cfg.model.expert_model_parallel_size == 2


def test_cpu_notes_replaced_overrides_and_flex():
    r = resolved("-g", "cpu", "model.hidden_size=512", "--moe_flex_dispatcher_backend", "deepep")
    assert any("model.hidden_size=512" in note for note in r.notes)
    assert any("alltoall" in note for note in r.notes)
    assert r.cfg.model.moe_token_dispatcher_type == "alltoall"


def test_cpu_impossible_layout():
    with pytest.raises(UsageError, match="-ep"):
        resolved("-g", "cpu", "-ng", "2", "-ep", "64")


def test_flex_on_supported_gpu_sets_flex_and_clears_shared_expert_overlap():
    r = resolved(*GPU, "--moe_flex_dispatcher_backend", "deepep")
    assert (r.cfg.model.moe_token_dispatcher_type, r.cfg.model.moe_flex_dispatcher_backend) == ("flex", "deepep")
    assert r.cfg.model.moe_shared_expert_overlap is False


def test_flex_on_unsupported_gpu_is_kept_for_the_validator():
    r = resolved("-g", "gb200", "-ng", "16", "--moe_flex_dispatcher_backend", "deepep")
    assert r.cfg.model.moe_token_dispatcher_type == "flex"
    assert "flex_backend_gpu" in [v.rule for v in r.cfg.validate(r.target.env)]


def test_flex_none_means_alltoall(tmp_path):
    recipe_file = tmp_path / "flex.py"
    recipe_file.write_text(
        "from mbridge_epoverlap.recipes.loader import load_recipe\n"
        "def recipe(task):\n"
        "    cfg = load_recipe('qwen3_30b_a3b', task)\n"
        "    cfg.model.moe_token_dispatcher_type, cfg.model.moe_flex_dispatcher_backend = 'flex', 'deepep'\n"
        "    return cfg\n")
    r = resolved(*GPU, "-mr", str(recipe_file), "--moe_flex_dispatcher_backend", "None")
    assert (r.cfg.model.moe_token_dispatcher_type, r.cfg.model.moe_flex_dispatcher_backend) == ("alltoall", None)
    with pytest.raises(UsageError, match="give each setting once"):
        resolved(*GPU, "model.moe_token_dispatcher_type=flex", "--moe_flex_dispatcher_backend", "None")


def test_compute_dtypes():
    with pytest.raises(UsageError, match="qwen3_30b_a3b pretrain on h100 has -c bf16, fp8_cs, fp8_sc"):
        resolved(*GPU, "-c", "fp16")  # no performance recipe of it: the job would stop, as upstream's
    assert resolved(*GPU, "-c", "fp16", "--use_recipes").cfg.model.fp16 is True
    fp8 = resolved(*GPU, "-c", "fp8_mx", "--use_recipes")  # H100 has no fp8_mx performance recipe
    assert fp8.cfg.model.bf16 is True and fp8.mixed_precision == "bf16_with_mxfp8_mixed"
    cpu32 = resolved("-g", "cpu", "-c", "fp32")
    assert (cpu32.cfg.model.bf16, cpu32.cfg.model.fp16) == (False, False)
    with pytest.raises(UsageError, match="fp8"):
        resolved("-g", "cpu", "-c", "fp8_cs")
    with pytest.raises(UsageError, match="fp32"):
        resolved(*GPU, "-c", "fp32")


def test_gb200_defaults_to_four_gpus_per_node():
    assert resolved("-g", "gb200", "-ng", "16").cfg.gpus_per_node == 4


def test_recipe_selection():
    assert pick_recipe(None, None) == "qwen3_30b_a3b"
    assert pick_recipe("deepseek", None) == "deepseek_v3"
    assert pick_recipe("gpt_oss", None) == "gpt_oss_20b"
    # As upstream's run_script.py, -mr finds the workload in any family; a -m naming another one is said
    notes: list[str] = []
    assert pick_recipe("qwen", "qwen3_vl_30b_a3b", notes) == "qwen3_vl_30b_a3b"
    assert notes == ["-m qwen: qwen3_vl_30b_a3b is in Megatron-Bridge's qwen_vl recipes; found there by -mr, as "
                     "Megatron-Bridge's run_script.py finds it"]
    with pytest.raises(UsageError, match="unknown model family 'llama' .*known: dbrx, deepseek, glm_moe_dsa, gpt_oss"):
        pick_recipe("llama", None)
    with pytest.raises(UsageError, match="unknown recipe"):
        resolved("-mr", "no_such_recipe")


def test_cuda_graph_impl_switches_the_te_rng_tracker_as_run_script_does():
    graphs = resolved(*GPU, "--cuda_graph_impl", "transformer_engine", "--cuda_graph_scope", "attn")
    assert graphs.cfg.model.use_te_rng_tracker is True
    assert "model.use_te_rng_tracker" in graphs.explicit
    none = resolved(*GPU, "--cuda_graph_impl", "none", "model.use_te_rng_tracker=true")
    assert none.cfg.model.use_te_rng_tracker is True  # a dotted override is kept
    assert resolved(*GPU).cfg.model.use_te_rng_tracker is upstream_values()["model.use_te_rng_tracker"] is True
    assert resolved(*GPU, "--cuda_graph_impl", "none").cfg.model.use_te_rng_tracker is False


def test_use_megatron_fsdp_reaches_the_validated_config():
    r = resolved(*GPU, "--use_megatron_fsdp", "true")
    assert (r.cfg.ddp.use_megatron_fsdp, r.cfg.ddp.data_parallel_sharding_strategy) == (True, "optim_grads_params")
    assert r.cfg.model.gradient_accumulation_fusion is True
    assert resolved(*GPU).cfg.ddp.use_megatron_fsdp is False


def test_bridge_version_is_part_of_the_target():
    assert resolved(*GPU, "--bridge_version", "main").target.env.bridge_version == "main"
    assert resolved(*GPU).target.env.bridge_version is None
