"""The router's KV cache bookkeeping: which blocks of the workers' paged cache each request owns.

The workers report how many blocks their cache holds (Warmup); the router hands them out so that a request
is admitted only when its whole budget (prompt + max_new_tokens + speculative lookahead) fits. A request's
blocks return to the free list when it finishes, fails or its client goes away.
"""

from __future__ import annotations


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_tokens(self) -> int:
        return (self.num_blocks - len(self._free)) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num_tokens: int) -> list[int] | None:
        """Blocks covering `num_tokens` positions, or None (and nothing taken) when they do not fit."""
        count = self.blocks_for(num_tokens)
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
