"""`PrefixCache` on a real `KVCache`: blocks kept after a prefill fill a later prompt's cache bit for bit, a match
stops at the first block that differs and leaves the last token to prefill, and the least recently used blocks
go first (children before their parents) once the bytes pass the budget."""

from __future__ import annotations

import pytest
import torch

from mbridge_epoverlap.serving.model.kv_cache import KVCache, LatentKVCache
from mbridge_epoverlap.serving.model.prefix_cache import PrefixCache

BLOCK = 4


def _filled(cache: KVCache, seq: int, tokens: int, seed: int) -> None:
    cache.add(seq)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(cache.num_layers):
        keys = torch.randn(tokens, cache.num_kv_heads, cache.head_dim, generator=gen)
        values = torch.randn(tokens, cache.num_kv_heads, cache._values[0].shape[3], generator=gen)
        cache.append(layer, seq, 0, keys, values)


def _block_bytes(cache: KVCache) -> int:
    return sum(k.numel() * 4 + v.numel() * 4 for k, v in cache.rows(0, 0, BLOCK))


@pytest.mark.parametrize("make", [lambda: KVCache(2, 2, 8), lambda: LatentKVCache(2, 16, 4)],
                         ids=["kv", "latent"])
def test_a_later_prompt_starts_from_the_blocks_an_earlier_one_left(make):
    cache = make()
    prefix = PrefixCache(1 << 20, block_tokens=BLOCK)
    first = list(range(100, 111))  # 11 tokens: 2 full blocks
    _filled(cache, 0, len(first), seed=1)
    prefix.insert(first, cache, 0)
    assert len(prefix) == 2
    later = first[:9] + [7, 7]  # shares 2 blocks and a token
    assert prefix.cached_tokens(later) == 8 and prefix.hit_tokens == 0  # a peek counts nothing
    assert len(blocks := prefix.match(later)) == 2 and prefix.hit_tokens == 8 and prefix.query_tokens == len(later)
    cache.add(1)
    assert cache.load(1, blocks) == 8
    for layer in range(cache.num_layers):
        assert torch.equal(cache._keys[layer][cache._row[1], :, :8], cache._keys[layer][cache._row[0], :, :8])
        assert torch.equal(cache._values[layer][cache._row[1], :, :8], cache._values[layer][cache._row[0], :, :8])
    assert cache.length(1) == 8
    assert len(prefix.match(first[:8])) == 1  # its own last token stays to prefill: one block, not two
    assert prefix.match([1] + first[1:]) == []  # the first block differs: nothing further matches


def test_least_recently_used_blocks_go_first_children_before_parents():
    cache = KVCache(1, 1, 4)
    _filled(cache, 0, 12, seed=2)
    _filled(cache, 1, 12, seed=3)
    a = list(range(12))
    b = a[:4] + [50, 51, 52, 53, 54, 55, 56, 57]  # shares a's first block
    budget = 4 * _block_bytes(cache)
    prefix = PrefixCache(budget, block_tokens=BLOCK)
    prefix.insert(a, cache, 0)  # blocks a0 a1 a2
    prefix.insert(b, cache, 1)  # b1 b2 (a0 shared): 5 blocks, one past the budget
    assert len(prefix) == 4 and prefix.bytes <= budget
    assert len(prefix.match(a + [0])) == 2  # a's deepest block (the least recent leaf) went, its parents stay
    assert len(prefix.match(b + [0])) == 3
    with pytest.raises(ValueError):
        PrefixCache(0)
