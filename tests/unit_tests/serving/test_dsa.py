"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer per layer chooses the tokens each query
attends to over the latent cache (`serving.model.latent.indexer`, `kv_cache.LatentKVCache`).

On the tiny checkpoints of the serving fixtures (`tiny_deepseek_v32_dir`, `tiny_glm_moe_dsa_dir`: 4 tokens chosen per
query; the shared checks of every family, bit-for-bit prefill logits in fp32 and bf16 and the disaggregated m = 2
engine included, are `test_architectures.py`'s): the spec reads the indexer and GLM-5's shared layers; the indexer's
keys are cached and counted; the choice matters (other tokens than dense attention's) and a context within
`index_topk` gives the dense model's tokens; prompts fed in chunks and decode tokens longer than the choice give
`transformers`' tokens; the workers' batched choice equals the exact one; every layout and the prefix cache serve it;
what the engine cannot serve is refused before any weight is read.
"""

from __future__ import annotations

import random

import pytest
import torch

from mbridge_epoverlap.serving.model.batch import TokenBatch
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.kv_cache import KVCache, LatentKVCache, kv_cache_bytes_per_token
from mbridge_epoverlap.serving.model.latent.indexer import exact_selection, padded_selection
from mbridge_epoverlap.serving.model.parts import LocalModel, generate_reference, load_attention_part, load_expert_part
from mbridge_epoverlap.serving.model.spec import SparseIndexer
from tests.unit_tests.serving.conftest import DSA_TOPK, TINY_VOCAB
from tests.unit_tests.serving.engine_runs import (
    assert_refused_before_weights,
    config_only,
    config_variant,
    engine_tokens,
    tokens_after_a_lost_expert_worker,
)

MAX_NEW = 8


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    """Lengths around the 4-token choice and several times it, and a one-token prompt."""
    rng = random.Random(11)
    return [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in (4, 5, 17, 40)] + [[42]]


def test_spec_reads_the_indexer(tiny_deepseek_v32_dir, tiny_glm_moe_dsa_dir) -> None:
    v32, glm = load_spec(tiny_deepseek_v32_dir), load_spec(tiny_glm_moe_dsa_dir)
    assert v32.mla.indexer == SparseIndexer(num_heads=8, head_dim=16, topk=DSA_TOPK, rope_interleave=False)
    assert glm.mla.indexer == SparseIndexer(num_heads=8, head_dim=16, topk=DSA_TOPK, rope_interleave=True,
                                            shared_layers=(1,))
    assert v32.moe_layers == glm.moe_layers == (False, True, True)
    # per token: each layer's latent (16) and rotary key (8), and the indexer key (16) of each indexed layer, fp32
    assert kv_cache_bytes_per_token(v32) == (3 * 24 + 3 * 16) * 4
    assert kv_cache_bytes_per_token(glm) == (3 * 24 + 2 * 16) * 4
    assert LatentKVCache.for_spec(glm).bytes_per_token() == kv_cache_bytes_per_token(glm)


def test_the_choice_matters_and_a_short_context_is_dense(tiny_deepseek_v32_dir, long_prompts, tmp_path) -> None:
    """With `index_topk` past every context the tokens are the dense DeepSeek-V3 model's (the same weights read as
    `DeepseekV3ForCausalLM`); with the fixture's 4 they are not."""
    wide = config_variant(tiny_deepseek_v32_dir, tmp_path / "wide", index_topk=1024)
    dense = config_variant(tiny_deepseek_v32_dir, tmp_path / "dense", architectures=["DeepseekV3ForCausalLM"])
    dense_tokens = generate_reference(load_spec(dense), long_prompts, MAX_NEW)
    assert generate_reference(load_spec(wide), long_prompts, MAX_NEW) == dense_tokens
    assert generate_reference(load_spec(tiny_deepseek_v32_dir), long_prompts, MAX_NEW) != dense_tokens


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_contexts_past_the_choice_equal_transformers(family, request, long_prompts, hf_greedy) -> None:
    directory = request.getfixturevalue(f"tiny_{family}_dir")
    assert generate_reference(load_spec(directory), long_prompts, MAX_NEW) == hf_greedy(directory, long_prompts,
                                                                                         MAX_NEW)


def test_a_prompt_fed_in_chunks_chooses_from_its_whole_history(tiny_glm_moe_dsa_dir, long_prompts, hf_greedy) -> None:
    """Chunks of 7, 1 and 20 tokens and the rest: each chunk's queries choose among the indexer keys of the chunks
    before it (and the shared layer reuses the choice of its chunk), to the tokens of the whole prompt."""
    spec = load_spec(tiny_glm_moe_dsa_dir)
    model = LocalModel(load_attention_part(spec), [load_expert_part(spec, range(spec.num_experts))])
    prompt = long_prompts[3]
    cache = KVCache.for_spec(spec)
    cache.add(0)
    start = 0
    for size in (7, 1, 20, len(prompt) - 28):
        token = model.next_tokens(TokenBatch.from_chunks([(0, prompt[start:start + size], start)]), cache)[0]
        start += size
    out = [token]
    while len(out) < MAX_NEW:
        out.append(model.next_tokens(TokenBatch.from_chunks([(0, [out[-1]], len(prompt) + len(out) - 1)]), cache)[0])
    assert out == hf_greedy(tiny_glm_moe_dsa_dir, [prompt], MAX_NEW)[0]


def test_the_batched_choice_is_each_sequence_s_exact_one() -> None:
    """`padded_selection` (the workers' decode batch) chooses, per sequence, the tokens `exact_selection` chooses for
    it alone; a sequence shorter than the choice gets all its tokens and padding marked unusable."""
    gen = torch.Generator().manual_seed(5)
    heads, dim, topk, lengths = 4, 16, 6, [20, 9, 4, 13]
    longest = max(lengths)
    keys = torch.randn(len(lengths), longest, dim, generator=gen)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    weights = torch.randn(len(lengths), heads, generator=gen)
    positions, usable = padded_selection(q, weights, keys, torch.tensor(lengths), topk)
    for b, n in enumerate(lengths):
        chosen = set(positions[b][usable[b]].tolist())
        exact = exact_selection(q[b:b + 1], weights[b:b + 1], keys[b, :n], torch.tensor([n - 1]), topk, torch.float32)
        assert chosen == (set(range(n)) if exact is None else set(exact[0].nonzero().flatten().tolist()))
        assert len(chosen) == min(n, topk)


def test_indexer_keys_travel_with_prefix_blocks_and_moved_rows() -> None:
    """The prefix cache's blocks carry the indexer keys (after the rotary keys) and load them back; a freed row's
    place is taken by the last sequence with its indexer keys."""
    cache = LatentKVCache(2, 8, 4, index_widths=(6, 0))
    for seq in (0, 1, 2):
        cache.add(seq)
        for layer in range(2):
            cache.append(layer, seq, 0, torch.randn(5, 1, 8), torch.randn(5, 1, 4))
            cache._index_keys[layer][cache._row[seq], 0, :5] = torch.randn(5, cache.index_widths[layer])
    blocks = [cache.rows(0, 0, 4)]
    assert [tuple(both.shape) for _, both in blocks[0]] == [(1, 4, 10), (1, 4, 4)]
    cache.add(3)
    assert cache.load(3, blocks) == 4
    assert torch.equal(cache._index_keys[0][cache._row[3], 0, :4], cache._index_keys[0][cache._row[0], 0, :4])
    moved = cache._index_keys[0][cache._row[3], 0, :4].clone()
    cache.free(1)  # the highest row (sequence 3's) moves into row 1
    assert torch.equal(cache._index_keys[0][cache._row[3], 0, :4], moved)


# The disaggregated m = 2 engine: `test_architectures.py`.
@pytest.mark.parametrize(("family", "layout"), [
    ("deepseek_v32", {"micro_batches": 1, "expert_workers": 1}),
    ("glm_moe_dsa", {"micro_batches": 3, "expert_workers": 2}),
    ("glm_moe_dsa", {"attn_workers": 2, "micro_batches": 2, "expert_workers": 1}),
    ("deepseek_v32", {"colocated": 2, "micro_batches": 2}),
    ("deepseek_v32", {"colocated": 1, "micro_batches": 1, "replicated_experts": True}),
], ids=["disaggregated-m1", "disaggregated-m3", "two-attention-workers", "colocated", "replicated"])
def test_every_layout_gives_transformers_tokens(family, layout, request, long_prompts, prompts, hf_greedy) -> None:
    """The workers decode with the batched choice and the absorbed attention over the chosen latents."""
    directory = request.getfixturevalue(f"tiny_{family}_dir")
    batch = long_prompts + prompts
    assert engine_tokens(directory, batch, 5, **layout) == hf_greedy(directory, batch, 5)


def test_a_lost_expert_worker_leaves_the_caches_whole(tiny_glm_moe_dsa_dir, long_prompts, hf_greedy) -> None:
    """Elastic serving: an expert worker SIGKILLed mid-decode; the latents and indexer keys live on the attention
    worker, so every sequence carries on over the surviving copies of its experts, to `transformers`' tokens."""
    tokens = tokens_after_a_lost_expert_worker(tiny_glm_moe_dsa_dir, long_prompts, MAX_NEW)
    assert tokens == hf_greedy(tiny_glm_moe_dsa_dir, long_prompts, MAX_NEW)


@pytest.mark.parametrize(("family", "changes", "named"), [
    ("deepseek_v32", {"index_topk": 0}, ["'index_topk'", "is 0"]),
    ("deepseek_v32", {"q_lora_rank": None}, ["'q_lora_rank'", "query bottleneck"]),
    ("deepseek_v32", {"index_head_dim": 4}, ["'index_head_dim'", "'qk_rope_head_dim' (8)"]),
    ("deepseek_v32", {"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]},
     ["'layer_types'", "'full_attention'"]),
    ("deepseek_v32", {"mlp_layer_types": ["dense", "moe", "sparse"]}, ["'mlp_layer_types'", "'moe'"]),
    ("glm_moe_dsa", {"indexer_types": ["shared", "full", "full"]}, ["'indexer_types'", "the first 'full'"]),
    ("glm_moe_dsa", {"indexer_types": None, "index_topk_pattern": "FXF"}, ["'index_topk_pattern'", "FXF"]),
])
def test_what_the_engine_cannot_serve_is_named_before_weights_load(family, changes, named, request,
                                                                   tmp_path) -> None:
    directory = request.getfixturevalue(f"tiny_{family}_dir")
    assert_refused_before_weights(config_only(directory, tmp_path, **changes), named, tmp_path)


def test_a_long_prompt_chooses_in_blocks_of_queries_with_the_same_bits(tiny_deepseek_v32_dir, long_prompts,
                                                                        monkeypatch) -> None:
    """The choice of a prompt's queries is scored a block of queries at a time (`SCORE_BYTES`), each query's product
    the one `transformers` runs for it: the logits stay its bits with one query per block."""
    from mbridge_epoverlap.serving.model.latent import indexer
    from tests.unit_tests.serving.engine_runs import prefill_logits

    monkeypatch.setattr(indexer, "SCORE_BYTES", 1)
    ours, expected = prefill_logits(tiny_deepseek_v32_dir, long_prompts[3], "float32")
    assert torch.equal(ours, expected)
