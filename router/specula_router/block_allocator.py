"""The router's KV cache bookkeeping: which blocks of the workers' paged cache each request owns, and which
blocks hold a prefix another request may reuse (automatic prefix caching).

The workers report how many blocks their cache holds (Warmup); the router hands them out as sequences grow: a
request is admitted with blocks for its prompt and its first step (`allocate`), and gets more before each step
that may write past them (`extend`). A request's blocks come back when it finishes, fails, is preempted or its
client goes away.

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
    def num_idle_cached_blocks(self) -> int:
        """Cached blocks no request holds: free, but kept for their prefix until taken."""
        return len(self._idle)

    @property
    def num_used_tokens(self) -> int:
        return (self.num_blocks - self.num_free_blocks) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def chain(self, token_ids: Sequence[int], namespace: str = "", known: Sequence[bytes] = ()) -> list[bytes]:
        """The hash chain of the full blocks of `token_ids`, one hash per block; `known` are the hashes of its
        first blocks already computed (a request's prompt, when its answer is added), which are not redone.
        Empty when prefix caching is off. A request's prompt is hashed once, at its first admission attempt."""
        if not self.prefix_caching:
            return []
        hashes = list(known)
        digest = hashes[-1] if hashes else hashlib.sha256(namespace.encode()).digest()
        size = self.block_size
        for i in range(len(hashes), len(token_ids) // size):
            digest = hashlib.sha256(digest + struct.pack(f"<{size}I", *token_ids[i * size:(i + 1) * size])).digest()
            hashes.append(digest)
        return hashes

    def allocate(self, num_tokens: int, prompt_hashes: Sequence[bytes] = (), prompt_len: int = 0, reserve: int = 0
                 ) -> Allocation | None:
        """Blocks covering `num_tokens` positions, reusing the cached blocks a prompt of `prompt_len` tokens
        (with `prompt_hashes`, its `chain`) starts with; None (and nothing taken) when they do not fit with
        `reserve` blocks left free."""
        cached = self._lookup(prompt_hashes[: max(prompt_len - 1, 0) // self.block_size])
        num_new = self.blocks_for(num_tokens) - len(cached)
        idle_reused = sum(1 for b in cached if b in self._idle)
        if num_new > self.num_free_blocks - idle_reused - reserve:
            return None
        for block in cached:
            self._idle.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
        fresh = [self._take() for _ in range(num_new)]
        for block in fresh:
            self._refs[block] = 1
        return Allocation(cached + fresh, len(cached) * self.block_size)

    def extend(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh blocks for a growing request; None (and nothing taken) when fewer are free."""
        if num_blocks > self.num_free_blocks:
            return None
        fresh = [self._take() for _ in range(num_blocks)]
        for block in fresh:
            self._refs[block] = 1
        return fresh

    def cache(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> int:
        """Marks the first blocks of `blocks`, whose KV is written and whose `chain` is `hashes`, as reusable.
        Returns how many blocks became cached."""
        num_new = 0
        for block, digest in zip(blocks, hashes):
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

    def _lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks a chain starts with."""
        blocks = []
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._idle.popitem(last=False)  # the least recently used cached block
        del self._by_hash[self._hash_of.pop(block)]
        return block
