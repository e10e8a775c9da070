import pytest

from pagedserve.scheduler.block_manager import BlockManager


def test_allocate_grows_tables_with_exact_ids():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate_slots(1, 5) == [0, 1]  # 5 tokens -> 2 blocks
    assert bm.allocate_slots(2, 4) == [2]
    assert bm.allocate_slots(1, 8) == []  # still fits in 2 blocks
    assert bm.allocate_slots(1, 9) == [3]
    assert bm.block_table(1) == [0, 1, 3]
    assert bm.block_table(2) == [2]
    assert bm.num_free_blocks == 4
    bm.check_integrity()


def test_free_returns_blocks_tail_first_to_the_back():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate_slots(1, 4)  # [0, 1]
    bm.allocate_slots(2, 2)  # [2]
    bm.free(1)
    assert bm.num_free_blocks == 5
    # free list is now 3, 4, 5, 1, 0: a request's tail is reused (evicted) before its prefix
    assert bm.allocate_slots(3, 8) == [3, 4, 5, 1]
    bm.check_integrity()


def test_allocation_fails_without_partial_effect():
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate_slots(1, 8) == [0, 1]
    assert bm.allocate_slots(2, 9) is None
    assert bm.block_table(2) == []
    assert bm.num_free_blocks == 1
    bm.check_integrity()


def test_watermark_applies_to_admission_only():
    bm = BlockManager(num_blocks=4, block_size=1, watermark_blocks=1)
    assert bm.allocate_slots(1, 3, admit=True) == [0, 1, 2]
    assert bm.allocate_slots(2, 1, admit=True) is None  # would eat the watermark
    assert bm.allocate_slots(1, 4) == [3]  # a running request may use it


def test_integrity_check_catches_double_ownership():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate_slots(1, 4)
    bm._tables[2] = [0]  # corrupt on purpose
    with pytest.raises(AssertionError, match="block accounting"):
        bm.check_integrity()


def test_prefix_hit_shares_blocks_by_reference():
    bm = BlockManager(num_blocks=10, block_size=4)
    first = list(range(10))
    assert bm.allocate_slots(1, 10) == [0, 1, 2]
    bm.cache_full_blocks(1, first, 10)  # blocks 0 and 1 are full; 2 is not
    assert bm.num_cached_blocks == 2
    second = first[:8] + [50, 51, 52]
    prefix = bm.cached_prefix(second)
    assert (prefix.blocks, prefix.num_tokens) == ((0, 1), 8)
    assert bm.allocate_slots(2, 11, prefix=prefix) == [3]
    assert bm.block_table(2) == [0, 1, 3]
    bm.free(1)
    assert bm.num_free_blocks == 7  # 0 and 1 are still held by request 2
    bm.check_integrity()
    bm.free(2)
    assert bm.num_free_blocks == 10
    assert bm.cached_prefix(second).blocks == (0, 1)  # freed but still cached
    bm.check_integrity()


def test_the_last_prompt_token_is_never_a_hit():
    bm = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(8))
    bm.allocate_slots(1, 8)
    bm.cache_full_blocks(1, tokens, 8)
    assert bm.cached_prefix(tokens).blocks == (0,)  # block 1 would leave nothing to compute
    assert bm.cached_prefix(tokens + [99]).blocks == (0, 1)


def test_cached_blocks_are_evicted_in_lru_order_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate_slots(1, 4)
    bm.cache_full_blocks(1, [1, 2, 3, 4], 4)
    bm.free(1)  # free list: 2, 3, 1, 0
    assert bm.allocate_slots(2, 6) == [2, 3, 1]  # evicts block 1, the tail of request 1
    assert bm.cached_prefix([1, 2, 3, 4, 5]).blocks == (0,)
    assert bm.num_cached_blocks == 1
    bm.check_integrity()


def test_reviving_cached_blocks_counts_against_capacity():
    bm = BlockManager(num_blocks=3, block_size=2, watermark_blocks=1)
    bm.allocate_slots(1, 4)
    bm.cache_full_blocks(1, [1, 2, 3, 4], 4)
    bm.free(1)
    prefix = bm.cached_prefix([1, 2, 3, 4, 9])
    assert (prefix.blocks, prefix.num_tokens) == ((0, 1), 4)
    # 1 new block + 2 revived from the free list = 3: over the watermark for an admission
    assert bm.allocate_slots(2, 5, admit=True, prefix=prefix) is None
    assert bm.num_free_blocks == 3 and bm.block_table(2) == []
    assert bm.allocate_slots(2, 5, prefix=prefix) == [2]
    bm.check_integrity()


def test_caching_off_finds_nothing():
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=False)
    bm.allocate_slots(1, 4)
    bm.cache_full_blocks(1, [1, 2, 3, 4], 4)
    assert bm.num_cached_blocks == 0 and bm.cached_prefix([1, 2, 3, 4, 5]).blocks == ()
