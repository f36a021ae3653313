"""Dotted overrides, the tri-state EP switches, recipes and the CPU shrink."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.overrides import apply_overrides, set_moe_a2a_overlap_overrides
from mbridge_epoverlap.config.shrink import shrink_for_cpu
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.recipes.loader import load_recipe, recipe_names


@pytest.fixture
def cfg() -> RunConfig:
    return load_recipe("qwen3_30b_a3b")


def test_overrides_set_typed_values(cfg):
    apply_overrides(cfg, [
        "comm_overlap.overlap_moe_expert_parallel_comm=true",
        "model.moe_shared_expert_overlap=false",
        "model.cuda_graph_scope=[attn,moe_router]",
        "model.recompute_modules=null",
        "model.virtual_pipeline_model_parallel_size=4",
        "train.lr=1e-4",
        "env_vars.NCCL_DEBUG=INFO",
    ])
    assert cfg.comm_overlap.overlap_moe_expert_parallel_comm is True
    assert cfg.model.cuda_graph_scope == ["attn", "moe_router"]
    assert cfg.model.recompute_modules is None
    assert cfg.model.virtual_pipeline_model_parallel_size == 4
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.env_vars["NCCL_DEBUG"] == "INFO"


def test_comma_list_and_later_override_wins(cfg):
    apply_overrides(cfg, ["model.cuda_graph_scope=attn,moe_router", "model.cuda_graph_scope=[attn]"])
    assert cfg.model.cuda_graph_scope == ["attn"]


@pytest.mark.parametrize(("item", "pattern"), [
    ("foo", "not KEY=VALUE"),
    ("a.b=", "has no value"),
    ("=3", "not a dotted key"),
    ("model.num_layer=3", r"unknown config key 'model.num_layer'; did you mean model.num_layers"),
    ("comm_overlap.delay_wgrad=true", "did you mean comm_overlap.delay_wgrad_compute"),
    ("modle.bf16=true", "did you mean model.bf16"),
    ("model.num_layers=abc", "expected an integer"),
    ("model.bf16=yes please", "expected true or false"),
    ("model=3", "names a section"),
    ("model.cuda_graph_scope=[attn", "cannot parse"),
])
def test_bad_overrides_name_the_setting(cfg, item, pattern):
    before = cfg.to_dict()
    with pytest.raises(UsageError, match=pattern):
        apply_overrides(cfg, ["model.bf16=false", item])
    assert cfg.to_dict() == before, "nothing is applied when any item is bad"


@pytest.mark.parametrize(("overlap", "delay"), [(None, None), (True, None), (False, None), (None, True),
                                                (True, False), (False, False)])
def test_tri_state_switches_set_exactly_one_setting(cfg, overlap, delay):
    cfg.comm_overlap.overlap_moe_expert_parallel_comm = True
    cfg.comm_overlap.delay_wgrad_compute = True
    before = cfg.to_dict()
    set_moe_a2a_overlap_overrides(cfg, overlap, delay)
    after = cfg.to_dict()
    assert after["comm_overlap"]["overlap_moe_expert_parallel_comm"] is (True if overlap is None else overlap)
    assert after["comm_overlap"]["delay_wgrad_compute"] is (True if delay is None else delay)
    changed = {k for k in before["comm_overlap"] if before["comm_overlap"][k] != after["comm_overlap"][k]}
    assert changed <= {"overlap_moe_expert_parallel_comm", "delay_wgrad_compute"}
    assert before["model"] == after["model"]


def test_overlap_false_really_turns_off_a_recipe_that_enables_it(cfg):
    cfg.model.overlap_moe_expert_parallel_comm = True
    cfg.comm_overlap.overlap_moe_expert_parallel_comm = None
    set_moe_a2a_overlap_overrides(cfg, False, None)
    assert cfg.comm_overlap.effective_overlap(cfg.model) is False


def test_every_recipe_loads_for_both_tasks_and_round_trips():
    assert {"qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3", "mixtral_8x22b", "dbrx"} <= set(recipe_names())
    for name in recipe_names():
        for task in ("pretrain", "sft"):
            cfg = load_recipe(name, task)
            assert cfg.recipe == name and cfg.task == task
            assert name == "nemotronh_56b" or cfg.model.num_moe_experts > 1  # the one dense hybrid of the table
            assert RunConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


def test_qwen3_30b_a3b_has_the_skill_card_shape(cfg):
    m = cfg.model
    assert (cfg.num_gpus, m.expert_model_parallel_size, m.tensor_model_parallel_size,
            m.pipeline_model_parallel_size, m.context_parallel_size) == (16, 16, 1, 1, 1)
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, m.seq_length, m.bf16) == (1024, 1, 4096, True)
    assert m.moe_token_dispatcher_type == "alltoall"
    assert (m.num_moe_experts, m.moe_router_topk, m.num_layers, m.hidden_size) == (128, 8, 48, 2048)


def test_recipe_from_file(tmp_path):
    path = tmp_path / "my_recipe.py"
    path.write_text(
        "from mbridge_epoverlap.recipes.loader import load_recipe\n"
        "def tiny(task='pretrain'):\n"
        "    cfg = load_recipe('mixtral_8x22b', task)\n"
        "    cfg.recipe = 'tiny'\n"
        "    return cfg\n"
    )
    assert load_recipe(str(path)).recipe == "tiny"
    assert load_recipe(f"{path}:tiny", "sft").task == "sft"
    with pytest.raises(UsageError, match="no function 'nope'"):
        load_recipe(f"{path}:nope")
    with pytest.raises(UsageError, match="unknown recipe 'qwen4'.*qwen3_30b_a3b"):
        load_recipe("qwen4")
    with pytest.raises(UsageError, match="unknown task"):
        load_recipe("dbrx", "finetune")


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "deepseek_v3", "mixtral_8x22b", "dbrx", "qwen3_235b_a22b"])
def test_shrink_keeps_structure(name):
    cfg = load_recipe(name)
    small = shrink_for_cpu(cfg, 2)
    big, m = cfg.model, small.model
    assert m.num_moe_experts // m.moe_router_topk == max(big.num_moe_experts // big.moe_router_topk, 1)
    assert bool(m.moe_shared_expert_intermediate_size) == bool(big.moe_shared_expert_intermediate_size)
    assert m.is_moe_layer(0) == big.is_moe_layer(0) and m.is_moe_layer(m.num_layers - 1)
    assert (small.num_gpus, m.expert_model_parallel_size, m.pipeline_model_parallel_size) == (2, 2, 1)
    assert m.bf16 == big.bf16 and small.validate() == []
    assert cfg.model.num_layers == big.num_layers, "the recipe itself is not changed"


@pytest.mark.parametrize(("procs", "ep", "pattern"), [(3, 2, "does not divide -ng 3"), (16, 16, "larger than the 8"),
                                                      (0, None, "at least one")])
def test_shrink_rejects_layouts_that_cannot_fit(procs, ep, pattern):
    with pytest.raises(UsageError, match=pattern):
        shrink_for_cpu(load_recipe("mixtral_8x22b"), procs, ep=ep)


def test_layout_violations():
    cfg = load_recipe("mixtral_8x22b")
    cfg.num_gpus = 60
    assert [v.rule for v in cfg.validate()] == ["layout_world_size"]
    cfg.num_gpus, cfg.model.expert_model_parallel_size = 64, 32
    assert {v.rule for v in cfg.validate()} == {"layout_expert_parallel", "ep_divides_experts"}


def test_cpu_overlap_cases_differ_only_in_the_two_switches():
    from mbridge_epoverlap.recipes.cpu_case import cpu_overlap_case

    off, on, delay = (cpu_overlap_case("qwen3_30b_a3b", 2, overlap=o, delay_wgrad=d)
                      for o, d in ((False, False), (True, False), (True, True)))
    keys = ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute")
    flat = [c.to_dict() for c in (off, on, delay)]
    for d in flat:  # the switches live in comm_overlap and, once finalized, in the model
        for section in ("comm_overlap", "model"):
            for key in keys:
                d[section].pop(key, None)
    assert flat[0] == flat[1] == flat[2]
    assert (on.model.overlap_moe_expert_parallel_comm, on.model.delay_wgrad_compute) == (True, False)
    assert (delay.model.overlap_moe_expert_parallel_comm, delay.model.delay_wgrad_compute) == (True, True)
    assert not off.ddp.overlap_grad_reduce and off.model.expert_model_parallel_size == 2
