"""KV blocks and the prefix cache's bookkeeping: reuse by hash chain, namespaces, reference counts, LRU eviction."""

from __future__ import annotations

from specula_router.block_allocator import BlockAllocator

BLOCK = 4
PROMPT = list(range(100, 111))  # 11 tokens: two whole blocks and three tokens


def allocate(allocator: BlockAllocator, num_tokens: int, prompt=(), namespace: str = ""):
    """`num_tokens` positions for a request whose prompt is `prompt`, as the admission asks for them."""
    return allocator.allocate(num_tokens, allocator.chain(prompt, namespace), len(prompt))


def cache(allocator: BlockAllocator, blocks, token_ids, namespace: str = "") -> int:
    """Marks the full blocks of `token_ids`, written into `blocks`, as reusable."""
    return allocator.cache(blocks, allocator.chain(token_ids, namespace))


def test_without_prefix_caching_nothing_is_reused():
    allocator = BlockAllocator(16, BLOCK)
    first = allocate(allocator, 20, PROMPT)
    assert cache(allocator, first.blocks, PROMPT) == 0
    allocator.free(first.blocks)
    second = allocate(allocator, 20, PROMPT)
    assert second.num_cached_tokens == 0 and allocator.num_free_blocks == 16 - 5


def test_a_prompt_reuses_the_written_blocks_it_starts_with():
    allocator = BlockAllocator(16, BLOCK, prefix_caching=True)
    first = allocate(allocator, 20, PROMPT)
    assert first.num_cached_tokens == 0
    assert cache(allocator, first.blocks, PROMPT) == 2  # the two whole blocks
    second = allocate(allocator, 20, PROMPT[:8] + [7, 7, 7, 7])
    assert second.num_cached_tokens == 8 and second.blocks[:2] == first.blocks[:2]
    assert not set(second.blocks[2:]) & set(first.blocks)  # its own blocks for the rest
    other = allocate(allocator, 20, PROMPT[:4] + [9] * 8)
    assert other.num_cached_tokens == 4 and other.blocks[0] == first.blocks[0]


def test_the_block_holding_the_last_prompt_token_is_never_reused():
    """The prefill must compute the last token's row, and a request writes only into blocks of its own."""
    allocator = BlockAllocator(16, BLOCK, prefix_caching=True)
    first = allocate(allocator, 12, PROMPT[:8])
    cache(allocator, first.blocks, PROMPT[:8])
    assert allocate(allocator, 12, PROMPT[:8]).num_cached_tokens == 4
    assert allocate(allocator, 12, PROMPT[:9]).num_cached_tokens == 8


def test_adapters_never_share_blocks():
    allocator = BlockAllocator(16, BLOCK, prefix_caching=True)
    base = allocate(allocator, 12, PROMPT)
    cache(allocator, base.blocks, PROMPT)
    assert allocate(allocator, 12, PROMPT, namespace="my-lora").num_cached_tokens == 0
    lora = allocate(allocator, 12, PROMPT, namespace="my-lora")
    cache(allocator, lora.blocks, PROMPT, namespace="my-lora")
    assert allocate(allocator, 12, PROMPT, namespace="my-lora").blocks[:2] == lora.blocks[:2]
    assert allocate(allocator, 12, PROMPT).blocks[:2] == base.blocks[:2]


def test_a_block_in_the_chain_identifies_everything_before_it():
    allocator = BlockAllocator(16, BLOCK, prefix_caching=True)
    first = allocate(allocator, 12, PROMPT)
    cache(allocator, first.blocks, PROMPT)
    changed_first_block = [0] + PROMPT[1:]  # same second block, different first one
    assert allocate(allocator, 12, changed_first_block).num_cached_tokens == 0


def test_cached_blocks_outlive_their_request_until_their_space_is_needed():
    allocator = BlockAllocator(6, BLOCK, prefix_caching=True)
    first = allocate(allocator, 12, PROMPT)
    cache(allocator, first.blocks, PROMPT)
    allocator.free(first.blocks)
    assert allocator.num_free_blocks == 6 and allocator.num_cached_blocks == 2
    again = allocate(allocator, 12, PROMPT)  # still there
    assert again.num_cached_tokens == 8
    allocator.free(again.blocks)
    unrelated = allocate(allocator, 24, [1] * 20)  # needs all six: the cached ones are evicted
    assert unrelated is not None and allocator.num_cached_blocks == 0
    allocator.free(unrelated.blocks)
    assert allocate(allocator, 12, PROMPT).num_cached_tokens == 0


def test_eviction_takes_the_least_recently_used_block_first():
    allocator = BlockAllocator(4, BLOCK, prefix_caching=True)
    a, b = [1] * 5, [2] * 5
    for prompt in (a, b):
        allocation = allocate(allocator, 8, prompt)
        cache(allocator, allocation.blocks, prompt)
        allocator.free(allocation.blocks)
    # Each cached its one whole block; two blocks are free.
    allocator.free(allocate(allocator, 8, a).blocks)  # a used again: b's block is now the older one
    taken = allocate(allocator, 12, [4] * 9)  # three blocks: the two free ones, then the oldest cached one
    assert taken is not None and allocator.num_cached_blocks == 1
    allocator.free(taken.blocks)
    assert allocate(allocator, 8, a).num_cached_tokens == 4
    assert allocate(allocator, 8, b).num_cached_tokens == 0


def test_a_shared_block_stays_until_its_last_holder_frees_it():
    allocator = BlockAllocator(8, BLOCK, prefix_caching=True)
    first = allocate(allocator, 12, PROMPT)
    cache(allocator, first.blocks, PROMPT)
    second = allocate(allocator, 12, PROMPT)
    allocator.free(first.blocks)
    assert allocator.num_free_blocks == 8 - 3  # second holds two shared blocks and one of its own
    assert allocate(allocator, 32, [5] * 30) is None  # the shared blocks cannot be evicted while held
    allocator.free(second.blocks)
    assert allocator.num_free_blocks == 8


def test_a_failed_allocation_takes_nothing():
    allocator = BlockAllocator(4, BLOCK, prefix_caching=True)
    first = allocate(allocator, 12, PROMPT)
    cache(allocator, first.blocks, PROMPT)
    allocator.free(first.blocks)
    assert allocate(allocator, 40, PROMPT) is None
    assert allocator.num_free_blocks == 4 and allocate(allocator, 12, PROMPT).num_cached_tokens == 8


def test_a_chain_extends_known_hashes_without_redoing_them():
    allocator = BlockAllocator(16, BLOCK, prefix_caching=True)
    prompt_hashes = allocator.chain(PROMPT[:8])
    assert allocator.chain(PROMPT + [7, 7, 7, 7, 7], known=prompt_hashes) == allocator.chain(PROMPT + [7] * 5)
    assert allocator.chain(PROMPT, "a") != allocator.chain(PROMPT, "b")
    assert BlockAllocator(16, BLOCK).chain(PROMPT) == []  # nothing to hash with prefix caching off


def test_extend_gives_fresh_blocks_or_nothing():
    allocator = BlockAllocator(4, 4)
    first = allocator.allocate(5)
    assert first is not None and len(first.blocks) == 2
    grown = allocator.extend(2)
    assert grown is not None and not set(grown) & set(first.blocks)
    assert allocator.extend(1) is None and allocator.num_free_blocks == 0  # nothing taken
    allocator.free(first.blocks + grown)
    assert allocator.num_free_blocks == 4


def test_allocate_leaves_the_reserve_free():
    allocator = BlockAllocator(4, 4)
    assert allocator.allocate(8, reserve=3) is None and allocator.num_free_blocks == 4
    assert allocator.allocate(8, reserve=2) is not None and allocator.num_free_blocks == 2
