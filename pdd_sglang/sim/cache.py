"""A prefix cache at block granularity, standing in for SGLang's radix cache.

Blocks are identified by hash ids that are chained (equal id = equal prefix up to that block),
as in the Mooncake trace format.  A prompt's cached prefix is its longest run of leading blocks
present in the cache; eviction is least-recently-used.  Evicting an inner block cuts the prefix
there, as a radix tree would.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

BLOCK_TOKENS = 512


class BlockPrefixCache:
    def __init__(self, capacity_tokens: int, block_tokens: int = BLOCK_TOKENS):
        if capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def matched_blocks(self, blocks: Sequence[int]) -> int:
        count = 0
        present = self._blocks
        for block in blocks:
            if block not in present:
                break
            count += 1
        return count

    def cached_tokens(self, blocks: Sequence[int], prompt_tokens: int, touch: bool = False) -> int:
        """Tokens of the prompt's prefix held here; at least one token is always left to compute
        (a prefill needs the last token's logits)."""
        count = self.matched_blocks(blocks)
        if touch:
            for block in blocks[:count]:
                self._blocks.move_to_end(block)
        return max(0, min(count * self.block_tokens, prompt_tokens - 1))

    def insert(self, blocks: Sequence[int]) -> None:
        present = self._blocks
        for block in blocks:
            if block in present:
                present.move_to_end(block)
            else:
                present[block] = None
        while len(present) > self.capacity_blocks:
            present.popitem(last=False)
