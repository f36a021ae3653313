"""Llama 4 (`Llama4ForCausalLM`): chunked attention on the rope layers, NoPE layers with the attention temperature,
the pairwise rope (Llama 3 scaling too), the q/k RMS norm without weights, and top-1 routing whose score scales the
expert's input beside a shared expert.

On the tiny checkpoint of the serving fixtures (`tiny_llama4_dir`; the shared checks of every family, greedy tokens
and bit-for-bit fp32 and bf16 prefill logits, experts split over parts and the disaggregated engine, are
`test_architectures.py`'s): the spec reads what the config says; each Llama 4 feature changes the fixture's logits (so
those checks check it); a prompt fed in pieces across chunk boundaries decodes to `transformers`' tokens; every
attention path of the KV cache (exact and the workers') attends within chunks; the config variants of the released
models (Llama 3 rope scaling, no q/k norm, no temperature, a 4.x config) give `transformers`' logits bit for bit;
the engine's other layouts give its tokens; what cannot be served is refused before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from mbridge_epoverlap.moe.rotary import llama3_inv_freq
from mbridge_epoverlap.serving.model.batch import TokenBatch
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.kv_cache import KVCache
from mbridge_epoverlap.serving.model.parts import LocalModel, load_attention_part, load_expert_part
from mbridge_epoverlap.serving.model.spec import ModelSpec, RopeScaling
from tests.unit_tests.serving.conftest import LLAMA4_CHUNK
from tests.unit_tests.serving.engine_runs import (
    assert_refused_before_weights,
    config_only,
    engine_tokens,
    prefill_logits,
)

MAX_NEW = 10


def _local(spec: ModelSpec) -> LocalModel:
    return LocalModel(load_attention_part(spec), [load_expert_part(spec, range(spec.num_experts))])


def _prefill(spec: ModelSpec, prompt: list[int]) -> torch.Tensor:
    model = _local(spec)
    cache = KVCache.for_spec(spec)
    cache.add(0)
    return model.attention.logits(model.forward(TokenBatch.from_chunks([(0, prompt, 0)]), cache))


def test_spec_reads_the_llama4_fields(tiny_llama4_dir) -> None:
    spec = load_spec(tiny_llama4_dir)
    assert spec.architecture == "Llama4ForCausalLM"
    assert spec.moe_layers == (False, True, False, True)
    assert spec.rope_layers == (True, True, True, False)
    assert spec.layer_chunks == (LLAMA4_CHUNK,) * 3 + (None,)
    assert [spec.chunk_of(i) for i in range(4)] == [4, 4, 4, None] and not spec.rope_of(3)
    sizes = (spec.num_experts, spec.top_k, spec.expert_ffn, spec.shared_expert_ffn, spec.dense_ffn)
    assert sizes == (8, 1, 24, 24, 40)
    assert (spec.rope_pairs, spec.qk_l2_norm, spec.attn_temperature, spec.rope_theta) == (True, True, (4.0, 0.5), 5e5)
    assert spec.router_sigmoid_after_topk and spec.router_scales_input and spec.expert_weights_in_out
    assert not (spec.qkv_bias or spec.attention_out_bias) and spec.rope_scaling is None and spec.eos_token_ids == (3,)


@pytest.mark.parametrize("change", [{"layer_chunks": ()}, {"attn_temperature": None}, {"qk_l2_norm": False},
                                    {"rope_pairs": False}, {"router_scales_input": False}],
                         ids=["chunks", "temperature", "qk-norm", "pairs", "scaled-input"])
def test_each_feature_changes_the_fixture_logits(tiny_llama4_dir, prompts, change) -> None:
    """Served without one of its features, the fixture's 13-token prompt gives other logits: the bit-for-bit checks
    of `test_architectures.py` check each (the prompt crosses three chunks, reaches the temperature's positions, and
    its tokens' router scores are not 1)."""
    spec = load_spec(tiny_llama4_dir)
    assert not torch.equal(_prefill(dataclasses.replace(spec, **change), prompts[2]), _prefill(spec, prompts[2]))


def test_a_prompt_fed_in_pieces_across_chunks_equals_transformers(tiny_llama4_dir, prompts, hf_greedy) -> None:
    """Pieces of 3, 1, 6 and 3 tokens, each attending to the keys its earlier pieces left in the cache, within their
    chunks, then decode steps: `transformers`' greedy tokens."""
    spec = load_spec(tiny_llama4_dir)
    model = _local(spec)
    prompt = prompts[2]
    cache = KVCache.for_spec(spec)
    cache.add(0)
    start = 0
    for size in (3, 1, 6, 3):
        token = model.next_tokens(TokenBatch.from_chunks([(0, prompt[start:start + size], start)]), cache)[0]
        start += size
    out = [token]
    while len(out) < MAX_NEW:
        out.append(model.next_tokens(TokenBatch.from_chunks([(0, [out[-1]], len(prompt) + len(out) - 1)]), cache)[0])
    assert out == hf_greedy(tiny_llama4_dir, [prompt], MAX_NEW)[0]


def _dense_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> torch.Tensor:
    """Causal attention within chunks, written out: q [n, heads, d], k and v [n, groups, d] -> [n, heads * d]."""
    n, heads, d = q.shape
    positions = torch.arange(n)
    allowed = (positions[None, :] <= positions[:, None]) & (positions[None, :] // chunk == positions[:, None] // chunk)
    keys, values = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(d)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, values).reshape(n, heads * d)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "workers"])
def test_every_cache_path_attends_within_chunks(exact) -> None:
    """Two sequences fed prompts in pieces of 5 and 6 tokens (the second from position 5, across a chunk boundary),
    then three decode tokens each: the exact cache (`cached_attention`, `decode_attention`) and the workers' (both
    prompts in one `prompt_attention` call, `padded_decode_attention`) give the written-out chunked attention."""
    g = torch.Generator().manual_seed(4)
    heads, groups, d, total = 4, 2, 8, 14
    q = torch.randn(2, total, heads, d, generator=g)
    k, v = torch.randn(2, total, groups, d, generator=g), torch.randn(2, total, groups, d, generator=g)
    cache = KVCache(1, groups, d, exact_decode=exact)
    cache.add(0)
    cache.add(1)
    out = torch.empty(2, total, heads * d)
    for start, end in [(0, 5), (5, 11), (11, 12), (12, 13), (13, 14)]:
        batch = TokenBatch.from_chunks([(s, [0] * (end - start), start) for s in (0, 1)])
        rows = [t[s, start:end] for s in (0, 1) for t in (q, k, v)]
        got = cache.attend(0, torch.cat(rows[0::3]), torch.cat(rows[1::3]), torch.cat(rows[2::3]), batch,
                           chunk=LLAMA4_CHUNK)
        out[0, start:end], out[1, start:end] = got.split(end - start)
    for s in (0, 1):
        torch.testing.assert_close(out[s], _dense_chunked(q[s], k[s], v[s], LLAMA4_CHUNK), rtol=1e-5, atol=1e-6)


SCOUT_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
              "high_freq_factor": 1.0, "original_max_position_embeddings": 64}
# original / high < 2 pi < ... : one frequency kept, one blended, the rest scaled
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 8.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("params", [SCOUT_ROPE, LLAMA3_ROPE, dict(SCOUT_ROPE, original_max_position_embeddings=8192)])
def test_llama3_frequencies_equal_transformers(params) -> None:
    """Scout's equal low and high factors (a blend never used, its weights inf and nan), a blend in use, Scout's own
    context: the frequencies of `transformers`, bit for bit."""
    from transformers import Llama4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for head_dim in (16, 128):
        config = Llama4TextConfig(hidden_size=32, num_attention_heads=4, head_dim=head_dim, rope_parameters=params)
        theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](config)
        ours = llama3_inv_freq(head_dim, params["rope_theta"], factor=params["factor"],
                               low_freq_factor=params["low_freq_factor"], high_freq_factor=params["high_freq_factor"],
                               original_max_position_embeddings=params["original_max_position_embeddings"])
        assert torch.equal(ours, theirs) and scale == 1.0


def _edited(source: Path, directory: Path, drop: tuple[str, ...] = (), **changes: object) -> Path:
    """A copy of the checkpoint `source` (weights too) with its config.json's fields changed and `drop` removed."""
    directory = Path(shutil.copytree(source, directory))
    config = json.loads((directory / "config.json").read_text())
    for name in drop:
        config.pop(name)
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("variant", [
    {"rope_parameters": SCOUT_ROPE},
    {"rope_parameters": LLAMA3_ROPE},
    {"use_qk_norm": False},  # Maverick
    {"attn_temperature_tuning": False},
    {"rope_scaling": dict(LLAMA3_ROPE), "rope_theta": 500000.0, "drop": ("rope_parameters",)},  # a 4.x config.json
], ids=["scout-rope", "llama3-rope", "no-qk-norm", "no-temperature", "rope-scaling"])
def test_config_variants_equal_transformers_bit_for_bit(tiny_llama4_dir, prompts, tmp_path, variant) -> None:
    changes = dict(variant)
    directory = _edited(tiny_llama4_dir, tmp_path / "ckpt", changes.pop("drop", ()), **changes)
    scaling = variant.get("rope_parameters") or variant.get("rope_scaling")
    assert load_spec(directory).rope_scaling == (None if scaling is None else RopeScaling(
        kind="llama3", factor=scaling["factor"], beta_fast=0.0, beta_slow=0.0,
        original_max_position_embeddings=scaling["original_max_position_embeddings"], truncate=False,
        attention_factor=1.0, low_freq_factor=scaling["low_freq_factor"],
        high_freq_factor=scaling["high_freq_factor"]))
    ours, expected = prefill_logits(directory, prompts[2], "float32")
    assert torch.equal(ours, expected)


# Disaggregated with two expert workers: `test_architectures.py`.
@pytest.mark.parametrize("layout", [
    {"attn_workers": 2, "micro_batches": 2, "expert_workers": 1},
    {"colocated": 2, "micro_batches": 2},
], ids=["two-attention-workers", "colocated"])
def test_every_layout_gives_transformers_tokens(tiny_llama4_dir, prompts, hf_greedy, layout) -> None:
    assert engine_tokens(tiny_llama4_dir, prompts, 6, **layout) == hf_greedy(tiny_llama4_dir, prompts, 6)


@pytest.mark.parametrize(("changes", "named"), [
    ({"num_experts_per_tok": 2}, ["'num_experts_per_tok'", "is 2", "one routed expert"]),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5}},
     ["'rope_parameters.rope_type'", "'yarn'", "'llama3'"]),
    ({"rope_parameters": {k: v for k, v in LLAMA3_ROPE.items() if k != "high_freq_factor"}},
     ["'rope_parameters.high_freq_factor'", "missing"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}},
     ["'rope_parameters.partial_rotary_factor'", "0.5"]),
    ({"layer_types": ["chunked_attention", "sliding_attention", "chunked_attention", "full_attention"]},
     ["'layer_types'", "'sliding_attention'"]),
    ({"attention_chunk_size": None}, ["'layer_types'", "'attention_chunk_size'"]),
    ({"no_rope_layers": [1, 2, 1, 0]}, ["'no_rope_layers'", "[1, 2, 1, 0]"]),
    ({"moe_layers": []}, ["'moe_layers'", "[]"]),
    ({"moe_layers": None, "interleave_moe_layer_step": 8}, ["'interleave_moe_layer_step'", "is 8"]),
    ({"attn_scale": "strong"}, ["'attn_scale'", "'strong'"]),
    ({"quantization_config": {"quant_method": "fbgemm_fp8"}}, ["'quantization_config.quant_method'", "'fbgemm_fp8'"]),
], ids=["top-2", "yarn", "llama3-incomplete", "partial-rotary", "sliding", "chunk-size-null", "no-rope-layers",
        "no-moe-layers", "sparse-step", "attn-scale", "quantized"])
def test_what_cannot_be_served_is_refused_before_weights_load(tiny_llama4_dir, tmp_path, changes, named) -> None:
    assert_refused_before_weights(config_only(tiny_llama4_dir, tmp_path, **changes), named, tmp_path)
