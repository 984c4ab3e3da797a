"""The router's KV cache bookkeeping: which blocks of the workers' paged cache each request owns, and which
blocks hold a prefix another request may reuse (automatic prefix caching).

The workers report how many blocks their cache holds (Warmup); the router hands them out so that a request
is admitted only when its whole budget (prompt + max_new_tokens + speculative lookahead) fits. A request's
blocks come back when it finishes, fails or its client goes away.

Prefix caching. A full block whose KV has been written is known by a hash chain: the hash of (the previous
block's hash, the block's token ids, the namespace), where the namespace is everything else that changes the
KV (the adapter: a LoRA request never reuses the base model's blocks). A new request reuses the longest chain
of cached blocks its prompt starts with and the worker prefills only the rest. Example, blocks of 4 tokens:

    request A, prompt  a b c d | e f g h | i j        A's prefill writes 3 blocks; the 2 full ones are cached
    request B, prompt  a b c d | e f g h | x y z      B gets A's 2 blocks (8 cached tokens), prefills x y z

Cached blocks are read-only: a request writes only into blocks of its own, so a request never reuses the
block holding its last prompt token (the prefill must compute that token's row to get its logits). A cached
block with no request left is kept, least recently used first out, until its space is needed.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Allocation:
    blocks: list[int]  # in position order
    num_cached_tokens: int  # leading positions whose KV is already in `blocks`


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks - 1, -1, -1))  # never cached (or evicted); popped from the end
        self._refs: dict[int, int] = {}  # block -> requests holding it
        self._hash_of: dict[int, bytes] = {}  # cached block -> its chain hash
        self._by_hash: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks no request holds, oldest use first

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request may take: free ones and cached ones no request holds."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    @property
    def num_used_tokens(self) -> int:
        return (self.num_blocks - self.num_free_blocks) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num_tokens: int, prompt: Sequence[int] = (), namespace: str = "") -> Allocation | None:
        """Blocks covering `num_tokens` positions, reusing the cached blocks `prompt` starts with; None (and
        nothing taken) when they do not fit."""
        cached = self._lookup(prompt, namespace) if self.prefix_caching else []
        num_new = self.blocks_for(num_tokens) - len(cached)
        idle_reused = sum(1 for b in cached if b in self._idle)
        if num_new > self.num_free_blocks - idle_reused:
            return None
        for block in cached:
            self._idle.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
        fresh = [self._take() for _ in range(num_new)]
        for block in fresh:
            self._refs[block] = 1
        return Allocation(cached + fresh, len(cached) * self.block_size)

    def cache(self, blocks: Sequence[int], token_ids: Sequence[int], namespace: str = "") -> int:
        """Marks the full blocks of `token_ids` (positions whose KV is written, in `blocks`) as reusable.
        Returns how many blocks became cached."""
        if not self.prefix_caching:
            return 0
        num_new = 0
        for block, digest in zip(blocks, self._chain(token_ids, len(token_ids) // self.block_size, namespace)):
            if block in self._hash_of or digest in self._by_hash:
                continue  # cached already (it is the reused prefix), or another block holds the same content
            self._hash_of[block], self._by_hash[digest] = digest, block
            num_new += 1
        return num_new

    def free(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):
            refs = self._refs.pop(block) - 1
            if refs:
                self._refs[block] = refs
            elif block in self._hash_of:
                self._idle[block] = None  # most recently used last
            else:
                self._free.append(block)

    def _lookup(self, prompt: Sequence[int], namespace: str) -> list[int]:
        """The cached blocks `prompt` starts with, never the one holding its last token."""
        blocks = []
        for digest in self._chain(prompt, (len(prompt) - 1) // self.block_size, namespace):
            block = self._by_hash.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _chain(self, token_ids: Sequence[int], num_blocks: int, namespace: str):
        """The hash chain of the first `num_blocks` full blocks of `token_ids`."""
        digest = hashlib.sha256(namespace.encode()).digest()
        size = self.block_size
        for i in range(num_blocks):
            block = token_ids[i * size:(i + 1) * size]
            digest = hashlib.sha256(digest + struct.pack(f"<{size}I", *block)).digest()
            yield digest

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._idle.popitem(last=False)  # the least recently used cached block
        del self._by_hash[self._hash_of.pop(block)]
        return block
