"""The small decode pieces: rotary embeddings, token batches, the KV cache and the stop rule."""

from __future__ import annotations

import pickle

import pytest
import torch

from mbridge_epoverlap.moe.rotary import RotaryEmbedding, apply_rotary
from mbridge_epoverlap.serving.decoding.sampling import StopRule, greedy
from mbridge_epoverlap.serving.model.batch import TokenBatch
from mbridge_epoverlap.serving.model.kv_cache import KVCache


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


def test_token_batch_groups_its_prompts_by_start_and_length_once() -> None:
    batch = TokenBatch.from_chunks([(1, [5] * 3, 0), (2, [6], 9), (3, [7] * 2, 4), (4, [8] * 3, 0), (5, [9] * 2, 4)])
    groups = batch.prompt_groups
    assert [(g.start, g.length, [s.seq_id for s in g.segments], g.rows.tolist()) for g in groups] == [
        (0, 3, [1, 4], [0, 1, 2, 6, 7, 8]), (4, 2, [3, 5], [4, 5, 9, 10])]
    assert batch.prompt_groups is groups  # every layer reads the same grouping


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


def test_kv_cache_batched_decode_reads_every_history_past_the_first_rows() -> None:
    cache = KVCache(num_layers=1, num_kv_heads=2, head_dim=4)
    gen = torch.Generator().manual_seed(1)
    lengths = [3 + (seq % 5) * 20 for seq in range(20)]  # 20 sequences: past the first 8 rows and 64 positions
    history = {}
    for seq, n in enumerate(lengths):
        cache.add(seq)
        history[seq] = torch.randn(n, 2, 4, generator=gen)
        cache.append(0, seq, 0, history[seq], -history[seq])
    new = torch.randn(20, 2, 4, generator=gen)
    keys, values, got, order = cache.append_decode(0, list(range(20)), lengths, new, -new)
    assert order is None and got.tolist() == [n + 1 for n in lengths] and keys.shape == (20, 2, max(lengths) + 1, 4)
    for seq, n in enumerate(lengths):
        expected = torch.cat([history[seq], new[seq:seq + 1]]).transpose(0, 1)
        assert torch.equal(keys[seq, :, :n + 1], expected) and torch.equal(values[seq, :, :n + 1], -expected)
        assert cache.length(seq) == n + 1
    with pytest.raises(ValueError, match="start at position 3"):
        cache.append_decode(0, [0], [3], new[:1], new[:1])
    # Sequences admitted together hold consecutive rows: their histories are read in place, not copied.
    assert keys.untyped_storage().data_ptr() == cache._keys[0].untyped_storage().data_ptr()
    # Sequence 5 leaves: the sequence of the highest row (19) moves into its row, its history with it.
    cache.free(5)
    assert cache._row[19] == 5 and sorted(cache._row.values()) == list(range(19))
    # A batch of some rows (not a contiguous range) is copied into batch order, same values.
    picked = [7, 2, 19, 0]
    later = torch.randn(4, 2, 4, generator=gen)
    keys, _, got, order = cache.append_decode(0, picked, [lengths[s] + 1 for s in picked], later, later)
    assert order is None and keys.untyped_storage().data_ptr() != cache._keys[0].untyped_storage().data_ptr()
    for b, seq in enumerate(picked):
        expected = torch.cat([history[seq], new[seq:seq + 1], later[b:b + 1]]).transpose(0, 1)
        assert torch.equal(keys[b, :, :lengths[seq] + 2], expected)
    # Every live sequence in another order than its rows: read in place, `order` names each entry's batch slot.
    batch = [19] + [s for s in range(1, 19) if s != 5] + [0]
    step = [lengths[s] + (2 if s in picked else 1) for s in batch]
    final = torch.randn(len(batch), 2, 4, generator=gen)
    keys, _, got, order = cache.append_decode(0, batch, step, final, final)
    assert order is not None and keys.untyped_storage().data_ptr() == cache._keys[0].untyped_storage().data_ptr()
    for entry, b in enumerate(order.tolist()):
        seq = batch[b]
        parts = [history[seq], new[seq:seq + 1]] + ([later[picked.index(seq)][None]] if seq in picked else [])
        expected = torch.cat(parts + [final[b:b + 1]]).transpose(0, 1)
        assert got[entry] == step[b] + 1 and torch.equal(keys[entry, :, :step[b] + 1], expected)
    cache.add(99)  # the lowest free row (19, left by the move) is taken
    assert cache._row[99] == 19


@pytest.mark.parametrize("window", [None, 4])
def test_batched_decode_attention_equals_one_sequence_at_a_time_bitwise(window) -> None:
    from mbridge_epoverlap.serving.model.kv_cache import cached_attention, decode_attention

    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([3, 7, 1, 12, 5])
    k, v = torch.randn(5, 2, 12, 16, generator=gen), torch.randn(5, 2, 12, 16, generator=gen)
    q = torch.randn(5, 4, 16, generator=gen)  # 4 query heads over 2 key/value groups
    batched = decode_attention(q, k, v, lengths, sliding_window=window)
    one_by_one = torch.cat([cached_attention(q[b:b + 1], k[b, :, :n].transpose(0, 1), v[b, :, :n].transpose(0, 1),
                                             torch.tensor([n - 1]), sliding_window=window)
                            for b, n in enumerate(lengths.tolist())])
    assert torch.equal(batched, one_by_one)


@pytest.mark.numerics
@pytest.mark.parametrize("window", [None, 4])
def test_padded_decode_attention_is_each_sequence_alone_to_rounding_and_ignores_the_padding(window) -> None:
    from mbridge_epoverlap.serving.model.kv_cache import cached_attention, padded_decode_attention

    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([3, 7, 1, 12, 5])
    k, v = torch.randn(5, 2, 12, 16, generator=gen), torch.randn(5, 2, 12, 16, generator=gen)
    q = torch.randn(5, 4, 16, generator=gen)
    padded = padded_decode_attention(q, k, v, lengths, sliding_window=window)
    one_by_one = torch.cat([cached_attention(q[b:b + 1], k[b, :, :n].transpose(0, 1), v[b, :, :n].transpose(0, 1),
                                             torch.tensor([n - 1]), sliding_window=window)
                            for b, n in enumerate(lengths.tolist())])
    torch.testing.assert_close(padded, one_by_one, rtol=1e-5, atol=1e-6)
    # Whatever the padding holds (a freed sequence's old keys and values), the result is the same, bit for bit.
    beyond = torch.arange(12)[None, None, :, None] >= lengths[:, None, None, None]
    k2 = torch.where(beyond, 1e3 * torch.randn(k.shape, generator=gen), k)
    v2 = torch.where(beyond, 1e3 * torch.randn(v.shape, generator=gen), v)
    assert torch.equal(padded_decode_attention(q, k2, v2, lengths, sliding_window=window), padded)


def test_engine_caches_attend_prompts_of_one_shape_together_as_each_alone_to_rounding() -> None:
    """An engine cache (`exact_decode=False`) attends the prompts of one length at one position in one call
    (`prompt_attention`): fresh prompts, then chunks after the first, beside decode tokens and a prompt of
    another length. Each token's result is the exact cache's to rounding, and both caches hold the same keys and
    values, bit for bit, at the same lengths."""
    layers, groups, heads, d = 2, 2, 4, 16
    exact, engine = KVCache(layers, groups, d), KVCache(layers, groups, d, exact_decode=False)
    for cache in (exact, engine):
        for seq in range(6):
            cache.add(seq)
    gen = torch.Generator().manual_seed(5)
    steps = [
        [(0, [1] * 6, 0), (1, [2] * 6, 0), (2, [3] * 4, 0), (3, [4] * 6, 0), (4, [5], 0), (5, [6] * 4, 0)],
        [(0, [1] * 3, 6), (1, [2] * 3, 6), (3, [7], 6), (2, [3] * 3, 4), (4, [8], 1), (5, [9] * 3, 4)],
    ]
    for chunks in steps:
        batch = TokenBatch.from_chunks(chunks)
        q = torch.randn(len(batch), heads, d, generator=gen)
        k, v = torch.randn(len(batch), groups, d, generator=gen), torch.randn(len(batch), groups, d, generator=gen)
        for layer in range(layers):
            torch.testing.assert_close(engine.attend(layer, q, k, v, batch), exact.attend(layer, q, k, v, batch),
                                       rtol=1e-5, atol=1e-6)
    for seq in range(6):
        assert [engine.length(seq, layer) for layer in range(layers)] == [exact.length(seq, layer)] * layers
        for layer in range(layers):
            n = exact.length(seq, layer)
            for mine, theirs in ((engine._keys, exact._keys), (engine._values, exact._values)):
                assert torch.equal(mine[layer][engine._row[seq], :, :n], theirs[layer][exact._row[seq], :, :n])


def test_engine_caches_decode_padded_unless_exact_attention_is_asked(monkeypatch) -> None:
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    spec = load_spec("qwen3_30b_a3b")
    assert KVCache.for_spec(spec).exact_decode and not KVCache.for_engine(spec).exact_decode
    assert not KVCache.for_engine(spec).empty_like().exact_decode
    monkeypatch.setenv("MBRIDGE_EPOVERLAP_EXACT_ATTENTION", "1")
    assert KVCache.for_engine(spec).exact_decode


def test_stop_rule_and_greedy_ties() -> None:
    stop = StopRule(max_new_tokens=3, eos_token_ids=(7,))
    assert not stop.done([]) and not stop.done([1, 2]) and stop.done([1, 2, 3]) and stop.done([7])
    assert greedy(torch.tensor([[0.0, 2.0, 2.0], [5.0, 1.0, 0.0]])) == [1, 0]  # lowest id wins a tie


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_pass_equals_one_gemm_per_expert_bitwise(dtype, monkeypatch) -> None:
    from mbridge_epoverlap.moe import experts

    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(16, 48, 64, generator=gen).to(dtype)
    w2 = torch.randn(16, 64, 24, generator=gen).to(dtype)
    counts = [3, 0, 1, 7, 0, 2, 5, 1, 1, 0, 4, 2, 6, 1, 0, 3]  # empty experts among full ones
    x = torch.randn(sum(counts), 64, generator=gen).to(dtype)
    grouped = experts.grouped_expert_swiglu(x, w1, w2, counts)
    starts = [sum(counts[:e]) for e in range(16)]
    per_expert = torch.cat([experts.expert_swiglu(x[s:s + n], w1[e], w2[e]) for e, (s, n) in
                            enumerate(zip(starts, counts, strict=True)) if n])
    assert torch.equal(grouped, per_expert)
    monkeypatch.setattr(experts, "_GROUPED_MM", None)  # the loop taken where torch has no grouped GEMM
    assert torch.equal(experts.grouped_expert_swiglu(x, w1, w2, counts), per_expert)
    assert experts.grouped_expert_swiglu(x[:0], w1, w2, [0] * 16).shape == (0, 64)
