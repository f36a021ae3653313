"""DeepSeek-V3 (`serving.model.architectures.deepseek.deepseek_v3`, `layers.MultiLatentAttention`) decodes its
checkpoints as `transformers` does, and refuses what it cannot serve before any weight is read.

Latent attention against `transformers`' `DeepseekV3Attention` on random inputs: the exact path (prefill, a lone
decode token, a batch of decode tokens each alone) bit for bit, the absorbed decode batch to rounding. On the tiny
checkpoints of the serving fixtures (queries through a bottleneck or not, interleaved YaRN rope with
`mscale_all_dim`, a dense first layer, grouped sigmoid routing, a shared expert): greedy tokens equal
`generate(do_sample=False)`, fp32 and bf16 prefill logits equal the eager model's bit for bit, and the
disaggregated engine (absorbed decode, or exact with MBRIDGE_EPOVERLAP_MLA_ABSORB=0) gives the same tokens.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from mbridge_epoverlap.serving.model.batch import TokenBatch
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.kv_cache import KVCache, LatentKVCache, kv_cache_bytes_per_token
from mbridge_epoverlap.serving.model.layers import MultiLatentAttention, rotary_for
from mbridge_epoverlap.serving.model.parts import generate_reference
from tests.unit_tests.serving.conftest import deepseek_v3_config
from tests.unit_tests.serving.engine_runs import assert_refused_before_weights, config_only, prefill_logits

MAX_NEW = 10


@pytest.fixture(scope="module", params=["q_lora", "direct_q"])
def checkpoint(request: pytest.FixtureRequest) -> Path:
    name = "tiny_deepseek_v3_dir" if request.param == "q_lora" else "tiny_deepseek_v3_direct_q_dir"
    return request.getfixturevalue(name)


def test_spec_reads_what_deepseek_v3_has(tiny_deepseek_v3_dir, tiny_deepseek_v3_direct_q_dir) -> None:
    spec = load_spec(tiny_deepseek_v3_dir)
    assert spec.architecture == "DeepseekV3ForCausalLM" and spec.mla is not None
    m = spec.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (16, 16, 8, 8, 12)
    assert m.rope_interleave and spec.head_dim == 8 and spec.num_kv_heads == spec.num_heads == 4
    # 16^-0.5 times mscale^2, mscale = 0.1 ln 4 + 1
    mscale = 0.1 * torch.log(torch.tensor(4.0, dtype=torch.float64)).item() + 1.0
    assert m.softmax_scale == pytest.approx(16 ** -0.5 * mscale ** 2, rel=1e-15)
    assert spec.rope_scaling is not None and spec.rope_scaling.attention_factor == 1.0
    assert spec.moe_layers == (False, True, True) and (spec.dense_ffn, spec.expert_ffn, spec.shared_expert_ffn) == (
        40, 24, 24)
    assert spec.grouped_routing is not None and spec.grouped_routing.routed_scaling_factor == 2.5
    direct = load_spec(tiny_deepseek_v3_direct_q_dir)
    assert direct.mla is not None and direct.mla.q_lora_rank is None


def test_the_kv_cache_holds_latents(tiny_deepseek_v3_dir) -> None:
    """kv_lora_rank + qk_rope_head_dim values per token and layer, whatever the head count: 3 x (16 + 8) x 4 bytes
    in fp32 (per-head keys and values would be 3 x 2 x 4 x (16 + 12) x 4 at least)."""
    spec = load_spec(tiny_deepseek_v3_dir)
    assert kv_cache_bytes_per_token(spec) == 3 * 24 * 4
    cache = KVCache.for_spec(spec)
    assert isinstance(cache, LatentKVCache) and cache.bytes_per_token() == kv_cache_bytes_per_token(spec)
    assert isinstance(cache.empty_like(), LatentKVCache)
    assert kv_cache_bytes_per_token(load_spec(tiny_deepseek_v3_dir, dtype="bfloat16")) == 3 * 24 * 2


# --- latent attention against transformers' DeepseekV3Attention ---------------------------------------------

def _attention_pair(checkpoint: Path, q_lora_rank: int | None):
    """transformers' attention of layer 0 with random weights, and ours with the same weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from mbridge_epoverlap.serving.model.architectures.deepseek.deepseek_v3 import DeepseekV3

    config = deepseek_v3_config(q_lora_rank)
    config._attn_implementation = "eager"
    torch.manual_seed(5)
    theirs = DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            param.normal_(1.0 if "layernorm" in name else 0.0, 0.1 if "layernorm" in name else 0.3)
    spec = load_spec(checkpoint)
    ours = MultiLatentAttention(spec, torch.float32).requires_grad_(False)
    state = theirs.state_dict()
    for name, source in DeepseekV3().attention_tensors(spec, "attn").items():
        ours.get_parameter(name).copy_(state[source.parts[0][0].removeprefix("attn.")])
    return config, spec, theirs, DeepseekV3RotaryEmbedding(config), ours


def _their_step(theirs, rotary, cache, x: torch.Tensor, start: int) -> torch.Tensor:
    n = x.shape[1]
    positions = torch.arange(start, start + n)[None]
    mask = None
    if n > 1:
        hidden = torch.arange(start + n)[None, :] > positions[0, :, None]
        mask = torch.zeros(1, 1, n, start + n).masked_fill(hidden, torch.finfo(torch.float32).min)
    with torch.no_grad():
        return theirs(x, rotary(x, positions), mask, cache=cache)[0][0]


def _our_step(ours, rotary, cache, chunks: list[tuple[int, torch.Tensor, int]]) -> torch.Tensor:
    """chunks: (sequence, x [n, hidden], start); the outputs in batch order."""
    batch = TokenBatch.from_chunks([(seq, [0] * x.shape[0], start) for seq, x, start in chunks])
    x = torch.cat([x for _, x, _ in chunks])
    with torch.no_grad():
        return ours.project_out(ours.attend(0, x, batch, cache, rotary.cos_sin(batch.positions)))


@pytest.mark.parametrize(("fixture", "q_lora_rank"), [("tiny_deepseek_v3_dir", 16),
                                                     ("tiny_deepseek_v3_direct_q_dir", None)])
def test_exact_latent_attention_equals_transformers_bit_for_bit(fixture, q_lora_rank, request) -> None:
    """A prompt and lone decode tokens bit for bit; two sequences decoding in one batch (each attending alone) to
    the rounding of their batched projections (`test_batched_exact_decode_is_each_sequence_alone` checks the
    attention itself)."""
    from transformers import DynamicCache

    config, spec, theirs, their_rotary, ours = _attention_pair(request.getfixturevalue(fixture), q_lora_rank)
    rotary = rotary_for(spec)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randn(1, 7, 32, generator=gen), torch.randn(1, 4, 32, generator=gen)]
    their_caches = [DynamicCache(config=config) for _ in prompts]
    cache = KVCache.for_spec(spec)
    for seq, x in enumerate(prompts):
        cache.add(seq)
        assert torch.equal(_our_step(ours, rotary, cache, [(seq, x[0], 0)]),
                           _their_step(theirs, their_rotary, their_caches[seq], x, 0))
    lengths = [7, 4]
    for _ in range(3):  # lone decode tokens of sequence 0
        x = torch.randn(1, 1, 32, generator=gen)
        assert torch.equal(_our_step(ours, rotary, cache, [(0, x[0], lengths[0])]),
                           _their_step(theirs, their_rotary, their_caches[0], x, lengths[0]))
        lengths[0] += 1
    for _ in range(3):  # both sequences in one decode batch: the projections of two rows round as two rows do
        xs = [torch.randn(1, 1, 32, generator=gen) for _ in prompts]
        ours_out = _our_step(ours, rotary, cache, [(s, xs[s][0], lengths[s]) for s in range(2)])
        for s in range(2):
            expected = _their_step(theirs, their_rotary, their_caches[s], xs[s], lengths[s])
            # fp32 rounding of two-row against one-row GEMMs, through the projections: 1.1e-6 absolute on an
            # element near zero with MKL's AVX2 kernels and oneDNN's AVX-512 ones (docs/numerics.md's profiles)
            torch.testing.assert_close(ours_out[s:s + 1], expected, rtol=1e-5, atol=1e-5)
            lengths[s] += 1


def test_batched_exact_decode_is_each_sequence_alone(tiny_deepseek_v3_dir) -> None:
    """The reference decode batch: each sequence's attention over its cached latents is, bit for bit, what it gets
    alone (given the same queries and latents)."""
    from mbridge_epoverlap.serving.model.kv_cache import exact_latent_attention

    spec = load_spec(tiny_deepseek_v3_dir)
    ours = _attention_pair(tiny_deepseek_v3_dir, 16)[-1]
    gen = torch.Generator().manual_seed(13)
    lengths = [6, 2, 9]
    cache = LatentKVCache.for_spec(spec)
    history = []
    for seq, n in enumerate(lengths):
        cache.add(seq)
        history.append((torch.randn(n, 16, generator=gen), torch.randn(n, 8, generator=gen)))
        cache.append(0, seq, 0, history[-1][0][:, None], history[-1][1][:, None])
    q_nope, q_rope = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 4, 8, generator=gen)
    latent, k_rope = torch.randn(3, 16, generator=gen), torch.randn(3, 8, generator=gen)
    batch = TokenBatch.from_chunks([(s, [0], n) for s, n in enumerate(lengths)])
    with torch.no_grad():
        out = cache.attend_latent(0, q_nope, q_rope, latent, k_rope, batch, ours.kv_b_proj.weight, spec.mla)
        for s, n in enumerate(lengths):
            latents = torch.cat([history[s][0], latent[s:s + 1]])
            alone = exact_latent_attention(q_nope[s:s + 1], q_rope[s:s + 1], latents,
                                           torch.cat([history[s][1], k_rope[s:s + 1]]), torch.tensor([n]),
                                           ours.kv_b_proj.weight, spec.mla)
            assert torch.equal(out[s:s + 1], alone)


def test_absorbed_decode_equals_transformers_to_rounding(tiny_deepseek_v3_dir) -> None:
    """The up-projections absorbed into the query and the output: the same attention, summed in another order."""
    from transformers import DynamicCache

    config, spec, theirs, their_rotary, ours = _attention_pair(tiny_deepseek_v3_dir, 16)
    rotary = rotary_for(spec)
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randn(1, n, 32, generator=gen) for n in (9, 3, 5)]
    their_caches = [DynamicCache(config=config) for _ in prompts]
    cache = LatentKVCache.for_spec(spec, exact_decode=False, absorb=True)
    lengths = []
    for seq, x in enumerate(prompts):
        cache.add(seq)
        _our_step(ours, rotary, cache, [(seq, x[0], 0)])
        _their_step(theirs, their_rotary, their_caches[seq], x, 0)
        lengths.append(x.shape[1])
    for _ in range(4):
        xs = [torch.randn(1, 1, 32, generator=gen) for _ in prompts]
        ours_out = _our_step(ours, rotary, cache, [(s, xs[s][0], lengths[s]) for s in range(3)])
        expected = torch.cat([_their_step(theirs, their_rotary, their_caches[s], xs[s], lengths[s]) for s in range(3)])
        torch.testing.assert_close(ours_out, expected, rtol=1e-5, atol=1e-6)
        lengths = [n + 1 for n in lengths]


# --- the model ----------------------------------------------------------------------------------------

def test_greedy_tokens_equal_transformers_generate(checkpoint, prompts, hf_greedy) -> None:
    spec = load_spec(checkpoint)
    ours = generate_reference(spec, prompts, MAX_NEW)
    assert ours == hf_greedy(checkpoint, prompts, MAX_NEW)
    assert len({tuple(o) for o in ours}) == len(prompts)  # different continuations: not a vacuous comparison


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_equal_transformers_bit_for_bit(checkpoint, prompts, dtype) -> None:
    ours, expected = prefill_logits(checkpoint, prompts[2], dtype)
    assert torch.equal(ours, expected.float())


def test_experts_split_over_parts_give_the_same_tokens(tiny_deepseek_v3_dir, prompts) -> None:
    spec = load_spec(tiny_deepseek_v3_dir)
    groups = [[7, 0, 5], [1, 6], [2, 3, 4]]
    assert generate_reference(spec, prompts, MAX_NEW, expert_groups=groups) == generate_reference(
        spec, prompts, MAX_NEW)


def test_disaggregated_engine_on_the_exact_path_equals_transformers_greedy(tiny_deepseek_v3_dir, prompts, hf_greedy,
                                                                          monkeypatch) -> None:
    from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
    from tests.unit_tests.serving.engine_runs import requests_of

    monkeypatch.setenv("MBRIDGE_EPOVERLAP_MLA_ABSORB", "0")
    max_new = 6
    plan = make_plan(load_spec(tiny_deepseek_v3_dir), requests_of(prompts), max_new_tokens=max_new, timeout_s=20,
                     micro_batches=2, expert_workers=2)
    result = run_engine(plan)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_deepseek_v3_dir, prompts, max_new)
    assert all(c["status"] == "ok" for c in result["completions"])


def test_the_planners_deepseek_v3_deployment_runs_on_the_engine(tiny_deepseek_v3_dir, prompts, hf_greedy) -> None:
    """The planner's DeepSeek-V3 deployment (H20 attention, L40S experts), shrunk to 4 processes, served on the
    tiny checkpoint with absorbed decode: its layout is what the engine runs, and the tokens are transformers'."""
    from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
    from mbridge_epoverlap.serving.planning.search import best_disaggregated
    from mbridge_epoverlap.serving.planning.to_engine import engine_layout
    from tests.unit_tests.serving.engine_runs import requests_of

    deployment = best_disaggregated("DeepSeek-V3", "H20", "L40S")
    spec = load_spec(tiny_deepseek_v3_dir)
    layout = engine_layout(deployment, workers=4, num_experts=spec.num_experts)
    assert layout.shrunk and layout.micro_batches == deployment.m > 1
    assert layout.attn_workers + layout.expert_workers == 4 and spec.num_experts % layout.expert_workers == 0
    max_new = 6
    plan = make_plan(spec, requests_of(prompts), max_new_tokens=max_new, timeout_s=20, **layout.plan_kwargs())
    result = run_engine(plan)
    assert (result["attn_workers"], result["expert_workers"], result["micro_batches"]) == (
        layout.attn_workers, layout.expert_workers, layout.micro_batches)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_deepseek_v3_dir, prompts, max_new)
    assert all(c["status"] == "ok" for c in result["completions"])


def test_layers_past_the_model_are_skipped_and_named(tiny_deepseek_v3_dir, tmp_path, caplog) -> None:
    """A multi-token-prediction layer stored as layer 3 of a 3-layer model: not read, named in a log line."""
    from safetensors.torch import load_file, save_file

    directory = Path(shutil.copytree(tiny_deepseek_v3_dir, tmp_path / "ckpt"))
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.3.enorm.weight"] = torch.ones(32)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="mbridge_epoverlap.serving.model.checkpoint"):
        spec = load_spec(directory)
    assert spec.num_layers == 3
    assert any("skipping layers 3 past num_hidden_layers (3)" in r.getMessage() for r in caplog.records)


# --- refused before any weight is read --------------------------------------------------------------

@pytest.mark.parametrize(("changes", "named"), [
    ({"topk_method": "greedy"}, ["'topk_method'", "'greedy'", "'noaux_tc'"]),
    ({"scoring_func": "softmax"}, ["'scoring_func'", "'softmax'"]),
    ({"num_key_value_heads": 2}, ["'num_key_value_heads'", "is 2"]),
    ({"rope_parameters.rope_type": "linear"}, ["'rope_parameters.rope_type'", "'linear'"]),
    ({"n_group": 16}, ["'n_group' (16)"]),
    ({"kv_lora_rank": 0}, ["'kv_lora_rank'", "is 0"]),
    ({"qk_rope_head_dim": 7}, ["'qk_rope_head_dim'", "is 7"]),
])
def test_unsupported_values_are_named_before_weights_load(tiny_deepseek_v3_dir, tmp_path, changes, named) -> None:
    assert_refused_before_weights(config_only(tiny_deepseek_v3_dir, tmp_path, **changes), named, tmp_path)
