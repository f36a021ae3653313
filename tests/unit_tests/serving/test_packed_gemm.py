"""The engine's expert, attention-projection and head GEMMs on oneDNN-packed weights: the same results as the
reference's to fp32 rounding, the weights repacked when they change in place, and the reference model left bit for
bit (no packing)."""

from __future__ import annotations

import pytest
import torch

from mbridge_epoverlap.moe.experts import grouped_expert_swiglu
from mbridge_epoverlap.serving.model import packed
from mbridge_epoverlap.serving.model.batch import TokenBatch
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.kv_cache import KVCache
from mbridge_epoverlap.serving.model.parts import load_attention_part, load_expert_part

pytestmark = pytest.mark.skipif(not packed.available(torch.float32), reason="this torch has no oneDNN linear ops")


def _weights(experts=6, hidden=64, ffn=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, 2 * ffn, hidden, generator=g) * 0.05,
            torch.randn(experts, hidden, ffn, generator=g) * 0.05)


@pytest.mark.parametrize("counts", [[3, 0, 1, 8, 2, 5], [40, 7, 0, 0, 64, 1], [0, 0, 0, 0, 0, 1]])
def test_packed_experts_equal_the_reference_to_fp32_rounding(counts):
    w1, w2 = _weights()
    x = torch.randn(sum(counts), w1.shape[2], generator=torch.Generator().manual_seed(1))
    got = packed.PackedExperts(w1, w2).swiglu(x, counts)
    want = grouped_expert_swiglu(x, w1, w2, counts)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_weights_changed_in_place_are_repacked():
    w1, w2 = _weights()
    experts = packed.PackedExperts(w1, w2)
    counts = [2, 2, 2, 2, 2, 2]
    x = torch.randn(12, w1.shape[2], generator=torch.Generator().manual_seed(2))
    before = experts.swiglu(x, counts)
    new1, new2 = _weights(seed=3)
    with torch.no_grad():
        w1[4].copy_(new1[4])  # an elastic move writes one expert's rows
        w2[4].copy_(new2[4])
    after = experts.swiglu(x, counts)
    torch.testing.assert_close(after, grouped_expert_swiglu(x, w1, w2, counts), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(after[8:10], before[8:10])  # expert 4's rows: computed with the new weights
    torch.testing.assert_close(after[:8], before[:8], rtol=0, atol=0)


def test_only_the_engine_packs(tiny_qwen3_moe_dir):
    spec = load_spec(tiny_qwen3_moe_dir)
    reference = load_expert_part(spec, range(spec.num_experts))
    engine = load_expert_part(spec, range(spec.num_experts), packed=True)
    layer = spec.moe_layer_ids[0]
    g = torch.Generator().manual_seed(4)
    tokens = torch.randn(10, spec.hidden_size, generator=g)
    ids = torch.randint(0, spec.num_experts, (10,), generator=g)
    assert not reference._packed and engine._packed
    torch.testing.assert_close(engine(layer, tokens, ids), reference(layer, tokens, ids), rtol=1e-5, atol=1e-6)


def test_the_switch_turns_packing_off(monkeypatch):
    assert not packed.available(torch.float16)  # no packed kernel asked for
    monkeypatch.setenv("MBRIDGE_EPOVERLAP_PACKED_GEMM", "0")
    assert not packed.available(torch.float32) and not packed.available(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 7, 32, 130])
def test_a_packed_linear_equals_f_linear_to_fp32_rounding_and_follows_its_weight(rows):
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(96, 64, generator=g) * 0.05
    gemm = packed.PackedLinear(weight)
    x = torch.randn(2, rows, 64, generator=g)  # leading dimensions are kept
    torch.testing.assert_close(gemm(x), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        weight[3].mul_(-2.0)  # changed in place: repacked before the next product
    torch.testing.assert_close(gemm(x), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-6)


def test_only_the_engine_packs_the_head_and_the_attention_projections(tiny_qwen3_moe_dir):
    spec = load_spec(tiny_qwen3_moe_dir)
    reference, engine = load_attention_part(spec), load_attention_part(spec, packed=True)
    assert reference._head is None and engine._head is not None
    assert all(b.attention.packed_qkv is None and b.attention.packed_proj is None for b in reference.layers)
    assert all(b.attention.packed_qkv is not None and b.attention.packed_proj is not None for b in engine.layers)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, spec.hidden_size, generator=g)
    batch = TokenBatch.from_chunks([(0, [5, 6, 7, 8], 0), (1, [9, 10, 11, 12, 13], 0)])
    outs = []
    for part in (reference, engine):
        cache = KVCache.for_engine(spec)
        cache.add(0)
        cache.add(1)
        outs.append((part.attention_step(spec.moe_layer_ids[0], x, batch, cache), part.logits(x[:2])))
    (want, want_logits), (got, got_logits) = outs
    torch.testing.assert_close(got.resid, want.resid, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.expert_ids, want.expert_ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)


def test_many_rows_take_the_activation_per_expert_bitwise(monkeypatch):
    """A prefill's rows (`PER_EXPERT_ROWS` or more) run each expert's activation after its own GEMM instead of once
    over every row: the same arithmetic, bit for bit."""
    w1, w2 = _weights(ffn=40)  # 40 columns: a vector's worth and a tail per row
    counts = [70, 0, 3, 130, 1, 56]
    x = torch.randn(sum(counts), w1.shape[2], generator=torch.Generator().manual_seed(7))
    experts = packed.PackedExperts(w1, w2)
    monkeypatch.setattr(packed, "PER_EXPERT_ROWS", 10**9)
    whole = experts.swiglu(x, counts)
    monkeypatch.setattr(packed, "PER_EXPERT_ROWS", sum(counts))
    assert torch.equal(experts.swiglu(x, counts), whole)


def test_a_step_of_many_experts_with_a_few_rows_each_keeps_one_activation_pass(monkeypatch):
    """Past `PER_EXPERT_ROWS` rows the activation follows each expert's GEMM only where the experts average
    `EACH_ROWS_PER_EXPERT` rows or more (a prefill of many tokens); a decode step that takes one prompt gives 64
    experts ~9 rows each, where 3 small ops an expert cost more than one pass over every row."""
    w1, w2 = _weights(ffn=40)
    each = []
    run_each = packed.PackedExperts._swiglu_each
    monkeypatch.setattr(packed.PackedExperts, "_swiglu_each", lambda self, *a: each.append(1) or run_each(self, *a))
    monkeypatch.setattr(packed, "PER_EXPERT_ROWS", 64)
    experts = packed.PackedExperts(w1, w2)
    gen = torch.Generator().manual_seed(8)
    spread = [20, 20, 20, 20, 20, 20]  # 120 rows, 20 an expert
    experts.swiglu(torch.randn(sum(spread), w1.shape[2], generator=gen), spread)
    assert each == []
    bunched = [70, 0, 3, 130, 1, 56]  # 260 rows, 52 an expert
    experts.swiglu(torch.randn(sum(bunched), w1.shape[2], generator=gen), bunched)
    assert each == [1]
