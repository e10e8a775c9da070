import pytest

from scheduler_svc.block_manager import BlockManager


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


def test_free_returns_blocks_in_table_order_to_the_back():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate_slots(1, 4)  # [0, 1]
    bm.allocate_slots(2, 2)  # [2]
    bm.free(1)
    assert bm.num_free_blocks == 5
    # free list is now 3, 4, 5, 0, 1
    assert bm.allocate_slots(3, 8) == [3, 4, 5, 0]
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
