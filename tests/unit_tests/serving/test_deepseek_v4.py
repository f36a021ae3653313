"""DeepSeek-V4 (`serving.model.architectures.deepseek.deepseek_v4`, `serving.model.compressed`) decodes its checkpoints
as `transformers` does, and refuses what it cannot serve before any weight is read.

On the tiny checkpoint of the serving fixtures (`tiny_deepseek_v4_dir`: compressed sparse attention pooling every 4
tokens with an indexer choosing 2 entries, heavily compressed attention pooling every 8, a sliding-window layer, a
window of 8, 3 residual streams, the first layer hash-routed; the shared checks of every family, greedy tokens and
bit-for-bit fp32 and bf16 prefill logits of a 13-token prompt and the disaggregated m = 2 engine included, are
`test_architectures.py`'s; prompts fed in chunks online: `frontend/test_online_architectures.py`): the spec and the
KV bytes; prompts past the window and several pools long give `transformers`' logits bit for bit and its greedy
tokens; a released config.json's older fields and a YaRN compress rope are read as `transformers` reads them;
prompts fed in chunks that cut the pools' windows continue from the cached buffers and overlaps; the indexer's
choice and the hash table matter; the per-sequence state lives in the attention side's cache (micro-batch caches
their own); the engine's layouts and elastic serving give `transformers`' tokens; what the engine cannot serve is
refused before any weight is read.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from mbridge_epoverlap.serving.model.batch import TokenBatch
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.compressed.state import CompressedCache, window_bytes_per_sequence
from mbridge_epoverlap.serving.model.kv_cache import KVCache, kv_cache_bytes_per_token
from mbridge_epoverlap.serving.model.parts import LocalModel, generate_reference, load_attention_part, load_expert_part
from tests.unit_tests.serving.conftest import TINY_VOCAB, V4_TOPK
from tests.unit_tests.serving.engine_runs import (
    assert_refused_before_weights,
    config_only,
    config_variant,
    engine_tokens,
    prefill_logits,
    tokens_after_a_lost_expert_worker,
)

MAX_NEW = 8


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    """Lengths inside one pool window, past the sliding window (8) and both pools' (4, 8), and a one-token prompt."""
    rng = random.Random(11)
    return [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in (3, 5, 13, 17, 40)] + [[42]]


def test_spec_reads_the_compressed_attention(tiny_deepseek_v4_dir) -> None:
    spec = load_spec(tiny_deepseek_v4_dir)
    c = spec.compressed
    assert spec.architecture == "DeepseekV4ForCausalLM" and all(spec.moe_layers)
    assert (spec.num_kv_heads, spec.head_dim, spec.expert_ffn, spec.shared_expert_ffn) == (1, 16, 24, 24)
    assert (spec.expert_activation, spec.swiglu_limit) == ("limited_swiglu", 0.6)
    assert (c.layer_rates, c.indexed, c.hash_layers) == ((4, 8, 0), (True, False, False), (0,))
    assert (c.rope_dim, c.rope_theta, c.compress_rope_theta, c.sliding_window) == (8, 10000.0, 160000.0, 8)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank, c.hc_mult, c.scoring) == (16, 2, 8, 3, "sqrtsoftplus")
    assert (c.index_heads, c.index_head_dim, c.index_topk) == (4, 12, V4_TOPK)
    # per token: the CSA layer's entry (16) and indexer key (12) every 4 tokens, the HCA layer's (16) every 8, fp32
    assert kv_cache_bytes_per_token(spec) == (16 + 12) * 4 // 4 + 16 * 4 // 8
    assert window_bytes_per_sequence(spec) == 3 * 7 * 16 * 4  # the bounded windows: 7 keys a layer


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompt_past_the_window_and_the_pools_gives_transformers_logits(tiny_deepseek_v4_dir, long_prompts,
                                                                          dtype) -> None:
    """40 tokens: 5 windows of the heavily compressed pool, 10 of the sparse one (the indexer choosing 2), 32
    positions past the sliding window."""
    ours, expected = prefill_logits(tiny_deepseek_v4_dir, long_prompts[4], dtype)
    assert torch.equal(ours, expected.float())


def test_a_released_config_s_older_fields_and_yarn_give_transformers_logits(tiny_deepseek_v4_dir, long_prompts,
                                                                           tmp_path) -> None:
    """The fixture's config.json as released checkpoints state it (`compress_ratios` with the prediction layer's
    entry past the layers, `compress_rate_hca`, `num_hash_layers`, `qk_rope_head_dim`, a flat YaRN `rope_scaling`
    that is the compress rope's): read as `transformers` folds them in, the logits are its own, bit for bit, and not
    the default rope's."""
    directory = Path(shutil.copytree(tiny_deepseek_v4_dir, tmp_path / "released"))
    config = json.loads((directory / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_parameters"):
        del config[key]
    config.update(compress_ratios=[4, 128, 0, 0], compress_rate_hca=8, num_hash_layers=1, qk_rope_head_dim=8,
                  rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 16,
                                "beta_fast": 32, "beta_slow": 1})
    (directory / "config.json").write_text(json.dumps(config))
    spec, fixture = load_spec(directory).compressed, load_spec(tiny_deepseek_v4_dir).compressed
    assert (spec.layer_rates, spec.indexed, spec.hash_layers, spec.rope_dim) == (
        fixture.layer_rates, fixture.indexed, fixture.hash_layers, fixture.rope_dim)
    assert spec.rope_scaling is None and spec.compress_rope_scaling.factor == 4.0
    assert spec.compress_rope_scaling.attention_factor == 1.0  # V4's YaRN leaves cos and sin unscaled
    ours, expected = prefill_logits(directory, long_prompts[4], "float32")
    assert torch.equal(ours, expected.float())
    assert not torch.equal(ours, prefill_logits(tiny_deepseek_v4_dir, long_prompts[4], "float32")[0])


def test_decoding_past_the_pools_gives_transformers_tokens(tiny_deepseek_v4_dir, long_prompts, hf_greedy) -> None:
    """Decode tokens close windows of both pools (the 3- and 5-token prompts their first) and leave the window."""
    ours = generate_reference(load_spec(tiny_deepseek_v4_dir), long_prompts, MAX_NEW)
    assert ours == hf_greedy(tiny_deepseek_v4_dir, long_prompts, MAX_NEW)
    assert len({tuple(o) for o in ours}) == len(long_prompts)


def test_a_prompt_fed_in_chunks_continues_from_the_cached_pools(tiny_deepseek_v4_dir, long_prompts,
                                                                hf_greedy) -> None:
    """Chunks of 3, 6 and 5 tokens cut the pools' windows (4 and 8) and the overlap between two windows: the buffered
    tokens, the previous window's half and the entries pooled so far carry over, so the tokens are `transformers`'
    from the whole prompt."""
    spec = load_spec(tiny_deepseek_v4_dir)
    model = LocalModel(load_attention_part(spec), [load_expert_part(spec, range(spec.num_experts))])
    prompt = long_prompts[4][:14]
    cache = KVCache.for_spec(spec)
    cache.add(0)
    start = 0
    for size in (3, 6, 5):
        nxt = model.next_tokens(TokenBatch.from_chunks([(0, prompt[start:start + size], start)]), cache)
        start += size
    tokens = [nxt[0]]
    for _ in range(MAX_NEW - 1):
        tokens.append(model.next_tokens(TokenBatch.from_chunks([(0, [tokens[-1]], start)]), cache)[0])
        start += 1
    assert tokens == hf_greedy(tiny_deepseek_v4_dir, [prompt], MAX_NEW)[0]


def test_the_indexer_choice_and_the_hash_table_matter(tiny_deepseek_v4_dir, long_prompts, tmp_path) -> None:
    """Choosing every pooled entry (a wide `index_topk`), or routing the first layer by the top-k instead of the
    token-id table, gives other tokens: the checks above would catch either read wrongly."""
    spec = load_spec(tiny_deepseek_v4_dir)
    tokens = generate_reference(spec, long_prompts, MAX_NEW)
    wide = config_variant(tiny_deepseek_v4_dir, tmp_path / "wide", index_topk=64)
    assert generate_reference(load_spec(wide), long_prompts, MAX_NEW) != tokens
    part = load_attention_part(spec)
    router = part.layers[0].router
    x = torch.randn(6, spec.hidden_size)
    ids = torch.tensor([5, 6, 7, 5, 6, 7])
    chosen, _ = router.route(x, ids)
    assert torch.equal(chosen, router.tid2eid[ids])
    assert torch.equal(chosen[:3], chosen[3:])  # the table's, whatever the hidden state


def test_each_sequence_s_state_lives_in_its_cache(tiny_deepseek_v4_dir) -> None:
    """The windows and pools are added and freed with the sequence, and a micro-batch's cache has its own."""
    spec = load_spec(tiny_deepseek_v4_dir)
    cache = KVCache.for_spec(spec)
    assert isinstance(cache.compressed, CompressedCache)
    cache.add(7)
    part = load_attention_part(spec)
    model = LocalModel(part, [load_expert_part(spec, range(spec.num_experts))])
    model.forward(TokenBatch.from_chunks([(7, list(range(10, 23)), 0)]), cache)
    state = cache.compressed.layer(7, 0)
    assert state.window.shape[2] == 7  # the last sliding_window - 1 keys
    assert state.pools["compressor"].count == 3 and state.pools["compressor"].buffer_kv.shape[1] == 1
    assert state.pools["indexer"].count == 3 and state.pools["compressor"].overlap_kv is not None
    assert cache.compressed.layer(7, 1).pools["compressor"].count == 1 and not cache.compressed.layer(7, 2).pools
    other = cache.empty_like()
    assert other.compressed is not cache.compressed and 7 not in other.compressed
    cache.free(7)
    assert 7 not in cache.compressed


@pytest.mark.parametrize("layout", [
    {"colocated": 2, "micro_batches": 2},
    {"attn_workers": 2, "micro_batches": 2, "expert_workers": 1},
], ids=["colocated", "two-attention-workers"])
def test_the_engine_layouts_give_transformers_tokens(tiny_deepseek_v4_dir, layout, long_prompts, hf_greedy) -> None:
    tokens = engine_tokens(tiny_deepseek_v4_dir, long_prompts, MAX_NEW, **layout)
    assert tokens == hf_greedy(tiny_deepseek_v4_dir, long_prompts, MAX_NEW)


def test_a_lost_expert_worker_leaves_the_hash_routed_tokens_whole(tiny_deepseek_v4_dir, long_prompts,
                                                                  hf_greedy) -> None:
    """Elastic serving: the hash layer's experts come from the table on the attention side and are placed as any
    other; an expert worker SIGKILLed mid-decode, every sequence carries on to `transformers`' tokens."""
    tokens = tokens_after_a_lost_expert_worker(tiny_deepseek_v4_dir, long_prompts, MAX_NEW)
    assert tokens == hf_greedy(tiny_deepseek_v4_dir, long_prompts, MAX_NEW)


@pytest.mark.parametrize(("changes", "named"), [
    ({"num_key_value_heads": 2}, ["'num_key_value_heads'", "is 2"]),
    ({"scoring_func": "softmax"}, ["'scoring_func'", "'softmax'"]),
    ({"layer_types": ["compressed_sparse_attention", "full_attention", "sliding_attention"]},
     ["'layer_types'", "'full_attention'"]),
    ({"mlp_layer_types": ["hash_moe", "dense", "moe"]}, ["'mlp_layer_types'", "'dense'"]),
    ({"compress_rates": {"compressed_sparse_attention": 0, "heavily_compressed_attention": 8}},
     ["'compress_rates.compressed_sparse_attention'", "is 0"]),
    ({"rope_parameters.compress.rope_type": "longrope"}, ["'rope_parameters.compress.rope_type'", "'longrope'"]),
    ({"compress_ratios": [4, 64, 0], "layer_types": None}, ["'compress_ratios'", "64"]),
    ({"rope_parameters.main": {"rope_type": "default", "rope_theta": 1e4}},
     ["'rope_parameters.main'", "'partial_rotary_factor'"]),
    ({"sliding_window": 1}, ["'sliding_window'", "at least 2"]),
    ({"o_groups": 3}, ["'o_groups'", "'num_attention_heads' (4)"]),
    ({"n_shared_experts": 2}, ["'n_shared_experts'", "is 2"]),
    ({"index_head_dim": 6}, ["'index_head_dim'", "rotary part (8)"]),
    ({"mlp_bias": True}, ["'mlp_bias'", "True"]),
    ({"quantization_config": {"quant_method": "fp8"}}, ["'quantization_config.quant_method'", "'fp8'"]),
])
def test_what_the_engine_cannot_serve_is_named_before_weights_load(tiny_deepseek_v4_dir, changes, named,
                                                                   tmp_path) -> None:
    assert_refused_before_weights(config_only(tiny_deepseek_v4_dir, tmp_path, **changes), named, tmp_path)
