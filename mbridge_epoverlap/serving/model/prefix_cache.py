"""`PrefixCache`: automatic prefix caching. Full blocks of a prompt's cached keys and values (or an MLA model's
latents) are kept after its prefill, keyed by the tokens up to and through each block, and a later prompt that
begins with the same tokens starts from them: its cache is filled with the blocks (`KVCache.load`) and only the
rest of its prompt is prefilled (as a chunked prefill goes on from its previous chunk).

A block is `BLOCK_TOKENS` tokens. Its key is (its parent block's id, its own tokens): exact, no hash collision
can join two prompts. A prompt's longest match leaves at least its last token to prefill (the logits of its first
new token come from it). Blocks are evicted least recently used while their bytes pass the budget; a match
touches its blocks from the last to the first, so a parent is always used more recently than its children and
evicted after them (an evicted parent's children could never match again).

Only the attention side holds it (the experts keep no per-sequence state), so every layout keeps it: each
attention worker has its own, for the prompts it served.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar

BLOCK_TOKENS = 16  # vLLM's default block size

Block = list  # per layer (keys, values), as `KVCache.rows` gives them


class PrefixCache:
    """Blocks of prompts' cached rows within `capacity_bytes` (see the module docstring).

    Attributes:
        query_tokens, hit_tokens: prompt tokens looked up and found (since the start), as vLLM's
            `prefix_cache_queries` and `prefix_cache_hits` count them.
    """

    memory_role: ClassVar[str] = "kv_cache"  # what `memory.resident_bytes` counts its blocks as

    def __init__(self, capacity_bytes: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if capacity_bytes <= 0 or block_tokens < 1:
            raise ValueError(f"a prefix cache needs bytes and a block size, got {capacity_bytes}, {block_tokens}")
        self.capacity_bytes, self.block_tokens = capacity_bytes, block_tokens
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent id, tokens) -> block id
        self._blocks: OrderedDict[int, tuple[tuple[int, tuple[int, ...]], Block, int]] = OrderedDict()
        self._next_id = 1  # 0 is the empty prefix
        self.bytes = 0
        self.query_tokens = self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def has_first(self, tokens: tuple[int, ...]) -> bool:
        """Whether a prompt beginning with the block `tokens` would match at least that block."""
        return (0, tokens) in self._ids

    def cached_tokens(self, prompt: Sequence[int]) -> int:
        """How many of `prompt`'s first tokens `match` would fill now (nothing counted, nothing touched): what a
        scheduler takes off the prompt's prefill cost."""
        return len(self._matched(prompt)) * self.block_tokens

    def match(self, prompt: Sequence[int]) -> list[Block]:
        """The cached blocks that begin `prompt`, longest first match, leaving its last token to prefill."""
        self.query_tokens += len(prompt)
        found = self._matched(prompt)
        for block_id in reversed(found):  # the first block ends most recently used (evicted last)
            self._blocks.move_to_end(block_id)
        self.hit_tokens += len(found) * self.block_tokens
        return [self._blocks[b][1] for b in found]

    def _matched(self, prompt: Sequence[int]) -> list[int]:
        """The ids of the cached blocks that begin `prompt`, before its last token, in order."""
        found: list[int] = []
        parent = 0
        for key in self._keys(prompt, len(prompt) - 1):
            block_id = self._ids.get((parent, key))
            if block_id is None:
                break
            found.append(block_id)
            parent = block_id
        return found

    def insert(self, prompt: Sequence[int], cache: Any, seq_id: int) -> None:
        """Keep the full blocks of `prompt` that `cache` now holds for `seq_id` and this cache has not."""
        chain: list[int] = []
        parent = 0
        for index, key in enumerate(self._keys(prompt, len(prompt))):
            block_id = self._ids.get((parent, key))
            if block_id is None:
                start = index * self.block_tokens
                rows = cache.rows(seq_id, start, start + self.block_tokens)
                size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in rows)
                if self.bytes + size > self.capacity_bytes and size > self.capacity_bytes // 2:
                    break  # a block this large would evict most of what is kept
                block_id, self._next_id = self._next_id, self._next_id + 1
                self._ids[(parent, key)] = block_id
                self._blocks[block_id] = ((parent, key), rows, size)
                self.bytes += size
            chain.append(block_id)
            parent = block_id
        for block_id in reversed(chain):  # parents more recent than their children: children are evicted first
            self._blocks.move_to_end(block_id)
        self._evict()

    def _keys(self, prompt: Sequence[int], limit: int) -> list[tuple[int, ...]]:
        """The tokens of each full block within the first `limit` tokens."""
        size = self.block_tokens
        return [tuple(prompt[i:i + size]) for i in range(0, limit - size + 1, size)]

    def _evict(self) -> None:
        while self.bytes > self.capacity_bytes and self._blocks:
            key, _, size = self._blocks.pop(next(iter(self._blocks)))
            del self._ids[key]
            self.bytes -= size
