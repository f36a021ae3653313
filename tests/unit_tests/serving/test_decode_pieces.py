"""The small decode pieces: rotary embeddings, token batches, the KV cache and the stop rule."""

from __future__ import annotations

import pickle

import pytest
import torch

from mbridge_epoverlap.moe.rotary import RotaryEmbedding, apply_rotary
from mbridge_epoverlap.serving.batch import TokenBatch
from mbridge_epoverlap.serving.kv_cache import KVCache
from mbridge_epoverlap.serving.sampling import StopRule, greedy


def test_rotary_scores_depend_only_on_the_distance() -> None:
    rope = RotaryEmbedding(16, 10000.0)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 16, generator=gen) for _ in range(2))

    def score(m: int, n: int) -> float:
        cos_m, sin_m = rope.cos_sin(torch.tensor([m]))
        cos_n, sin_n = rope.cos_sin(torch.tensor([n]))
        return float((apply_rotary(q, cos_m, sin_m) * apply_rotary(k, cos_n, sin_n)).sum())

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-5)
    assert score(7, 3) != pytest.approx(score(8, 3), rel=1e-3)
    cos, sin = rope.cos_sin(torch.tensor([5]))
    assert float(apply_rotary(q, cos, sin).norm()) == pytest.approx(float(q.norm()), rel=1e-5)  # a rotation


def test_token_batch_segments_last_rows_and_round_trip() -> None:
    batch = TokenBatch.from_chunks([(4, [10, 11, 12], 0), (9, [7], 20), (2, [3, 4], 5)])
    assert [(s.seq_id, s.start, s.length) for s in batch.segments] == [(4, 0, 3), (9, 20, 1), (2, 5, 2)]
    rows, seqs = batch.last_rows()
    assert rows.tolist() == [2, 3, 5] and seqs == [4, 9, 2]
    again = pickle.loads(pickle.dumps(TokenBatch(*batch.tensors())))
    assert again.positions.tolist() == [0, 1, 2, 20, 5, 6] and again.segments == batch.segments
    with pytest.raises(ValueError, match="consecutive positions"):
        TokenBatch(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([0, 2]))


def test_kv_cache_grows_past_its_first_buffer_and_frees() -> None:
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=4)
    cache.add(1)
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(150, 2, 4, generator=gen), torch.randn(150, 2, 4, generator=gen)
    start = 0
    for size in (40, 1, 60, 49):  # crosses the initial 64-position buffer twice
        got_k, got_v = cache.append(1, 1, start, keys[start:start + size], values[start:start + size])
        start += size
        assert torch.equal(got_k, keys[:start]) and torch.equal(got_v, values[:start])
    assert (cache.length(1, layer=1), cache.length(1, layer=0)) == (150, 0)
    cache.free(1)
    assert 1 not in cache
    cache.add(1)  # a freed id can be reused
    assert cache.length(1) == 0
    with pytest.raises(ValueError, match="already in the KV cache"):
        cache.add(1)


def test_stop_rule_and_greedy_ties() -> None:
    stop = StopRule(max_new_tokens=3, eos_token_ids=(7,))
    assert not stop.done([]) and not stop.done([1, 2]) and stop.done([1, 2, 3]) and stop.done([7])
    assert greedy(torch.tensor([[0.0, 2.0, 2.0], [5.0, 1.0, 0.0]])) == [1, 0]  # lowest id wins a tie
