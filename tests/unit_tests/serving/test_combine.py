"""The one-pass combine (`kernels.combine`): the bits of the torch loop (`parts.gate_weighted_sum`) plus the
residual on every CPU, for any token and slot strides, taken only where it applies, and the loop where the
library cannot be built."""

from __future__ import annotations

import pytest
import torch

from mbridge_epoverlap.serving.model.kernels import combine
from mbridge_epoverlap.serving.model.parts import gate_weighted_sum

needs_library = pytest.mark.skipif(not combine.available(), reason=f"{combine.unavailable_reason()}")


def _case(tokens: int, k: int, hidden: int, experts: int, *, seed: int, slot_major: bool = False):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)] or [torch.zeros(0, k)])
    ids = ids.reshape(tokens, k).long()
    gates = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    if slot_major:  # [k, T, hidden] rows seen as [T, k, hidden], as a one-process run_experts returns them
        out = (torch.randn(k, tokens, hidden, generator=gen) * 3).transpose(0, 1)
    else:
        out = torch.randn(tokens, k, hidden, generator=gen) * 3
    return out, ids, gates, torch.randn(tokens, hidden, generator=gen)


@needs_library
@pytest.mark.numerics
@pytest.mark.parametrize(("tokens", "k", "hidden", "experts"), [
    (1, 1, 8, 4), (3, 2, 40, 8), (16, 8, 512, 64), (100, 8, 100, 64), (257, 4, 520, 9)])
@pytest.mark.parametrize("slot_major", [False, True])
def test_the_one_pass_combine_is_the_torch_loop_bit_for_bit(tokens, k, hidden, experts, slot_major):
    out, ids, gates, resid = _case(tokens, k, hidden, experts, seed=tokens + k, slot_major=slot_major)
    summed = gate_weighted_sum(out, ids, gates, torch.float32)
    assert combine.applies(out, ids, gates, resid)
    assert torch.equal(combine.weighted_sum(out, ids, gates, resid), resid + summed)
    assert torch.equal(combine.weighted_sum(out, ids, gates, None), summed)


@needs_library
def test_no_tokens_give_no_rows():
    out, ids, gates, resid = _case(0, 8, 16, 64, seed=0)
    assert combine.weighted_sum(out, ids, gates, resid).shape == (0, 16)


@needs_library
def test_it_applies_only_to_fp32_rows_it_can_read():
    out, ids, gates, resid = _case(4, 2, 16, 8, seed=1)
    assert not combine.applies(out.bfloat16(), ids, gates, resid)  # bf16 products round between steps
    assert not combine.applies(out, ids, gates, resid.bfloat16())
    assert not combine.applies(out.transpose(1, 2).contiguous().transpose(1, 2), ids, gates, resid)  # strided rows
    wide = _case(2, combine.MAX_K + 1, 8, 128, seed=2)
    assert not combine.applies(*wide)
    with pytest.raises(ValueError, match=f"at most {combine.MAX_K} experts per token"):
        combine.weighted_sum(*wide)
    with pytest.raises(ValueError, match="resid must be fp32"):
        combine.weighted_sum(out, ids, gates, resid[:3])
    with pytest.raises(ValueError, match="fp32 expert outputs with contiguous rows"):
        combine.weighted_sum(out.bfloat16(), ids, gates, resid)
    with pytest.raises(ValueError, match=r"must be \[4, 2\]"):
        combine.weighted_sum(out, ids[:, :1], gates, resid)


def test_without_a_compiler_it_is_unavailable_and_the_loop_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    combine._library.cache_clear()
    try:
        assert not combine.available()
        assert combine.unavailable_reason() == "CC=no-such-compiler-here is not a program here"
        out, ids, gates, resid = _case(2, 2, 8, 4, seed=3)
        assert not combine.applies(out, ids, gates, resid)
        with pytest.raises(RuntimeError, match="does not run here"):
            combine.weighted_sum(out, ids, gates, resid)
    finally:
        combine._library.cache_clear()
