"""Each architecture module (`serving.model.architectures`) decodes its checkpoints exactly as `transformers` does,
and refuses what it cannot serve before any weight is read.

Qwen2-MoE (q/k/v biases, a sigmoid-gated shared expert, a dense layer), OLMoE (q/k RMSNorm over the whole
projection), DBRX (nested config, clamped fused q/k/v, LayerNorm, p-norm routing, experts fused in one tensor per
projection), GPT-OSS, GLM-4.5, Qwen3-Next and Qwen3.5-MoE (gated DeltaNet layers beside gated full attention),
MiniMax-M2 (sigmoid routing with a correction bias, q/k RMSNorm over the projections, partial rotary), Nemotron-H
(Mamba-2, attention without rope, relu^2 experts), Llama 4 (chunked attention, NoPE layers, the router score
scaling the expert's input; its own checks in `test_llama4.py`) and DeepSeek-V4 (compressed attention,
hyper-connections, hash routing; its own checks in `test_deepseek_v4.py`) on tiny checkpoints written by
`transformers` (the serving fixtures): greedy tokens equal `generate(do_sample=False)`, fp32 and bf16 prefill logits
equal the eager model's bit for bit, experts split over parts and the disaggregated engine give the same tokens.
Mixtral and Qwen3-MoE have the same checks in `test_reference_decode.py` and `test_engine.py`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model import architectures
from mbridge_epoverlap.serving.model.architectures.base import ConfigFields
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.parts import generate_reference
from tests.unit_tests.serving.engine_runs import assert_refused_before_weights, config_only, prefill_logits

MAX_NEW = 10
# The reference-model and disaggregated-engine checks of every architecture module but Mixtral and Qwen3-MoE
# (`test_reference_decode.py`, `test_engine.py`) and DeepSeek-V3 (its own file: two fixtures, two decode paths).
FAMILIES = ["qwen2_moe", "olmoe", "dbrx", "gpt_oss", "glm4_moe", "qwen3_next", "qwen3_5_moe", "minimax_m2",
            "nemotron_h", "deepseek_v32", "glm_moe_dsa", "llama4", "deepseek_v4"]
SHARDED = ["qwen2_moe", "olmoe", "dbrx", "llama4"]  # the sharded bf16 checkpoints below


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


# --- tokens and logits ------------------------------------------------------------------------------

def test_greedy_tokens_equal_transformers_generate(checkpoint, prompts, hf_greedy) -> None:
    spec = load_spec(checkpoint)
    ours = generate_reference(spec, prompts, MAX_NEW)
    assert ours == hf_greedy(checkpoint, prompts, MAX_NEW)
    assert len({tuple(o) for o in ours}) == len(prompts)  # different continuations: not a vacuous comparison


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_equal_transformers_bit_for_bit(checkpoint, prompts, dtype) -> None:
    """In bf16 too: the fixtures' norm weights are not all ones, so the RMSNorm must round the normalised input to
    bf16 before the weight multiplies it, as `transformers` does (GPT-OSS multiplies the fp32 normalised input by
    the weight, then rounds: its order). GPT-OSS's 13-token prompt runs past its sliding window; in bf16 its sinks'
    softmax and the router's softmax over the top k run in bf16 as `transformers` runs them, and each expert's
    activation runs on its own rows (ATen's sigmoid rounds an array's last elements on another path)."""
    ours, expected = prefill_logits(checkpoint, prompts[2], dtype)
    assert torch.equal(ours, expected.float())


@pytest.mark.parametrize(("family", "dtype"), [(f, "bfloat16") for f in SHARDED] + [("dbrx", "float32")])
def test_a_sharded_checkpoint_stored_in_the_serving_dtype(family, dtype, request, prompts, tmp_path) -> None:
    """Published checkpoints are sharded (an index names each tensor's file) and stored in bf16. `transformers` then
    multiplies by views of the files (no conversion copies them), and DBRX's experts are rows of fused tensors in
    whichever shard holds them: the logits still equal its eager model's bit for bit."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path / f"{family}_{dtype}"
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(f"tiny_{family}_dir"), dtype=dtype)
    model.save_pretrained(directory, max_shard_size="24KB")
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(set(load_spec(directory).file_of().values())) > 1
    ours, expected = prefill_logits(directory, prompts[2], dtype)
    assert torch.equal(ours, expected.float())


def test_experts_split_over_parts_give_the_same_tokens(checkpoint, prompts) -> None:
    spec = load_spec(checkpoint)
    groups = [[7, 0, 5], [1, 6], [2, 3, 4]]
    assert generate_reference(spec, prompts, MAX_NEW, expert_groups=groups) == generate_reference(
        spec, prompts, MAX_NEW)


@pytest.mark.parametrize("family", FAMILIES)
def test_disaggregated_engine_tokens_equal_transformers_greedy(family, request, prompts, hf_greedy) -> None:
    from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
    from tests.unit_tests.serving.engine_runs import requests_of

    directory = request.getfixturevalue(f"tiny_{family}_dir")
    max_new = 6
    plan = make_plan(load_spec(directory), requests_of(prompts), max_new_tokens=max_new, timeout_s=20,
                     micro_batches=2, expert_workers=2)
    result = run_engine(plan)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(directory, prompts, max_new)
    assert all(c["status"] == "ok" for c in result["completions"])


# The layouts each newer family's own file does not run (MiniMax-M2 has none; Llama 4 runs two attention workers and
# colocation; DeepSeek-V4 those and an expert worker lost; DeepSeek-V3.2 and GLM-5 all: `test_dsa.py`), on the
# 13-token prompt with others; the arithmetic of each is the m = 2 run's above, so these check what the layout adds
# (micro-batch caches, a process of its own per expert group or none, a failover) on each family's caches.
_ELASTIC = {"elastic": True}  # `tokens_after_a_lost_expert_worker`'s layout
NEWER_LAYOUTS = [
    *(("minimax_m2", layout) for layout in ({"micro_batches": 1, "expert_workers": 1},
                                             {"micro_batches": 3, "expert_workers": 2},
                                             {"colocated": 2, "micro_batches": 2},
                                             {"colocated": 1, "micro_batches": 1, "replicated_experts": True},
                                             _ELASTIC)),
    *(("llama4", layout) for layout in ({"micro_batches": 1, "expert_workers": 1},
                                         {"micro_batches": 3, "expert_workers": 2},
                                         {"colocated": 1, "micro_batches": 1, "replicated_experts": True},
                                         _ELASTIC)),
    *(("deepseek_v4", layout) for layout in ({"micro_batches": 1, "expert_workers": 1},
                                              {"micro_batches": 3, "expert_workers": 2},
                                              {"colocated": 1, "micro_batches": 1, "replicated_experts": True})),
]


def _layout_id(layout: dict) -> str:
    if layout.get("elastic"):
        return "elastic"
    if layout.get("replicated_experts"):
        return "replicated"
    if "colocated" in layout:
        return f"colocated{layout['colocated']}"
    return f"disaggregated-m{layout['micro_batches']}"


@pytest.mark.parametrize(("family", "layout"), NEWER_LAYOUTS,
                         ids=[f"{f}-{_layout_id(lay)}" for f, lay in NEWER_LAYOUTS])
def test_every_layout_serves_the_newer_families(family, layout, request, prompts, hf_greedy) -> None:
    """Elastic: an expert worker SIGKILLed at step 2, its experts served by their surviving copies."""
    from tests.unit_tests.serving.engine_runs import engine_tokens, tokens_after_a_lost_expert_worker

    directory = request.getfixturevalue(f"tiny_{family}_dir")
    batch, max_new = prompts[:3], 4
    if layout.get("elastic"):
        tokens = tokens_after_a_lost_expert_worker(directory, batch, max_new, kill_step=2)
    else:
        tokens = engine_tokens(directory, batch, max_new, **layout)
    assert tokens == hf_greedy(directory, batch, max_new)


# --- what each module reads -------------------------------------------------------------------------

def test_qwen2_moe_spec(tiny_qwen2_moe_dir) -> None:
    spec = load_spec(tiny_qwen2_moe_dir)
    assert spec.architecture == "Qwen2MoeForCausalLM"
    assert (spec.qkv_bias, spec.shared_expert_gate, spec.qk_norm, spec.norm_topk_prob) == (True, True, False, False)
    assert spec.moe_layers == (True, False, True)
    assert (spec.expert_ffn, spec.dense_ffn, spec.shared_expert_ffn) == (24, 40, 36)


def test_qwen2_moe_sparse_layers_follow_decoder_sparse_step(tmp_path) -> None:
    arch = architectures.get("Qwen2MoeForCausalLM")
    cfg = ConfigFields(tmp_path / "config.json", {**arch.defaults, "moe_intermediate_size": 8, "intermediate_size": 16,
                                                  "shared_expert_intermediate_size": 8, "decoder_sparse_step": 2,
                                                  "mlp_only_layers": [3]})
    assert arch.read_config(cfg, 6)["moe_layers"] == (False, True, False, False, False, True)


def test_minimax_m2_spec(tiny_minimax_m2_dir) -> None:
    from mbridge_epoverlap.serving.model.spec import GroupedRouting

    spec = load_spec(tiny_minimax_m2_dir)
    assert spec.architecture == "MiniMaxM2ForCausalLM" and all(spec.moe_layers)
    assert (spec.qk_norm, spec.qk_norm_scope, spec.rotary_dim, spec.norm_topk_prob) == (True, "projection", 8, True)
    assert spec.grouped_routing == GroupedRouting(1, 1, 1.0, logits_in_model_dtype=True)
    assert not spec.router_weights_in_dtype and spec.rope_theta == 5e6


def test_minimax_m2_correction_bias_changes_choices(tiny_minimax_m2_dir, prompts) -> None:
    """The drawn correction bias picks other experts for some tokens of the fixture's prompts: the token checks above
    would catch a bias read into the wrong place or left out."""
    from mbridge_epoverlap.serving.model.parts import load_attention_part

    part = load_attention_part(load_spec(tiny_minimax_m2_dir))
    router = part.layers[0].router
    x = part.layers[0].post_norm(part.embed(torch.tensor([t for p in prompts for t in p])))
    chosen = router.route(x).experts.sort(dim=-1).values
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
    assert not torch.equal(chosen, router.route(x).experts.sort(dim=-1).values)


def test_olmoe_spec(tiny_olmoe_dir) -> None:
    spec = load_spec(tiny_olmoe_dir)
    assert (spec.architecture, spec.qk_norm, spec.qk_norm_scope) == ("OlmoeForCausalLM", True, "projection")
    assert (spec.norm_topk_prob, spec.qkv_bias, spec.shared_expert_ffn, spec.norm_eps) == (False, False, 0, 1e-5)
    assert all(spec.moe_layers) and spec.expert_ffn == 24 and spec.head_dim == 8


def test_dbrx_spec(tiny_dbrx_dir) -> None:
    """The nested and renamed fields land where the shared code reads them."""
    from mbridge_epoverlap.serving.model.checkpoint import context_length

    spec = load_spec(tiny_dbrx_dir)
    assert spec.architecture == "DbrxForCausalLM"
    assert (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 4, 2, 8)
    assert (spec.num_experts, spec.top_k, spec.expert_ffn, spec.vocab_size) == (8, 2, 24, 128)
    assert (spec.normalization, spec.norm_eps, spec.clip_qkv, spec.topk_norm_p) == ("LayerNorm", 1e-5, 0.3, 1.0)
    assert spec.router_softmax_in_dtype and not spec.norm_topk_prob and all(spec.moe_layers)
    assert context_length(spec) == 256  # `max_seq_len`


def test_dbrx_clip_qkv_fires_on_the_fixture(tiny_dbrx_dir, prompts) -> None:
    """The clamp changes the projections of the fixture's prompts, so the tests above check it."""
    from mbridge_epoverlap.serving.model.parts import load_attention_part

    part = load_attention_part(load_spec(tiny_dbrx_dir))
    attention = part.layers[0].attention
    x = part.layers[0].input_norm(part.embed(torch.tensor(prompts[2])))
    raw = torch.nn.functional.linear(x, attention.qkv.weight)
    assert bool((raw.abs() > 0.3).any())
    q, k, v, _ = attention.project_qkv(x, separate=True)
    assert max(t.abs().max().item() for t in (q, k, v)) <= torch.tensor(0.3).item()  # 0.3 in fp32


def test_an_older_dbrx_config_gives_the_rotary_base_in_attn_config(tiny_dbrx_dir, tmp_path) -> None:
    directory = Path(shutil.copytree(tiny_dbrx_dir, tmp_path / "ckpt"))
    config = json.loads((directory / "config.json").read_text())
    del config["rope_parameters"]
    config["attn_config"]["rope_theta"] = 500000
    (directory / "config.json").write_text(json.dumps(config))
    assert load_spec(directory).rope_theta == 500000


def test_every_registered_architecture_is_named_when_one_is_unknown(tiny_olmoe_dir, tmp_path) -> None:
    directory = config_only(tiny_olmoe_dir, tmp_path, architectures=["JambaForCausalLM"])
    with pytest.raises(UsageError, match="'architectures'") as info:
        load_spec(directory)
    assert all(name in str(info.value) for name in architectures.NAMES)


# --- refused before any weight is read --------------------------------------------------------------

@pytest.mark.parametrize(("family", "changes", "named"), [
    ("qwen2_moe", {"quantization_config": {"quant_method": "awq"}}, ["'quantization_config.quant_method'", "awq",
                                                                       "'fp8'"]),
    ("qwen2_moe", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     ["'rope_parameters.rope_type'", "'yarn'"]),
    ("qwen2_moe", {"use_sliding_window": True}, ["'use_sliding_window'", "True"]),
    ("qwen2_moe", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     ["'layer_types'", "sliding_attention"]),
    ("olmoe", {"clip_qkv": 8.0}, ["'clip_qkv'", "8.0"]),
    ("olmoe", {"attention_bias": True}, ["'attention_bias'", "True"]),
    ("olmoe", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, ["'quantization_config.quant_method'",
                                                                              "gptq"]),
    ("dbrx", {"ffn_config.ffn_act_fn": {"name": "gelu"}}, ["'ffn_config.ffn_act_fn.name'", "'gelu'"]),
    ("dbrx", {"ffn_config.moe_normalize_expert_weights": -1.0},
     ["'ffn_config.moe_normalize_expert_weights'", "-1.0"]),
    ("dbrx", {"attn_config.clip_qkv": 0}, ["'attn_config.clip_qkv'", "is 0"]),
    ("dbrx", {"attn_config.kv_n_heads": 3}, ["'n_heads' (4)", "'attn_config.kv_n_heads' (3)"]),
    ("dbrx", {"ffn_config": "moe"}, ["'ffn_config'", "'moe'"]),
    ("minimax_m2", {"scoring_func": "softmax"}, ["'scoring_func'", "'softmax'", "sigmoid"]),
    ("minimax_m2", {"qk_norm_type": "per_head"}, ["'qk_norm_type'", "'per_head'"]),
    ("minimax_m2", {"rotary_dim": 7, "rope_parameters": {"rope_theta": 5e6}}, ["'rotary_dim'", "7"]),
])
def test_unsupported_features_exit_2_naming_field_and_value(family, changes, named, request, tmp_path) -> None:
    directory = config_only(request.getfixturevalue(f"tiny_{family}_dir"), tmp_path, **changes)
    assert_refused_before_weights(directory, named, tmp_path)


@pytest.mark.parametrize(("family", "name", "wrong", "right"), [
    ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate.weight", [2, 32], [1, 32]),
    ("qwen2_moe", "model.layers.2.self_attn.k_proj.bias", [32], [16]),
    ("olmoe", "model.layers.1.self_attn.q_norm.weight", [8], [32]),
    ("dbrx", "transformer.blocks.1.ffn.experts.mlp.w2", [8, 24, 32], [192, 32]),
    ("dbrx", "transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight", [96, 32], [64, 32]),
])
def test_a_tensor_whose_shape_disagrees_with_the_config_is_named(family, name, wrong, right, request,
                                                                 tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    directory = Path(shutil.copytree(request.getfixturevalue(f"tiny_{family}_dir"), tmp_path / "ckpt"))
    tensors = load_file(str(directory / "model.safetensors"))
    tensors[name] = torch.zeros(wrong)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UsageError, match=name.replace(".", r"\.")) as info:
        load_spec(directory)
    assert str(wrong) in str(info.value) and str(right) in str(info.value)
