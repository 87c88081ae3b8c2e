import pytest

from mtpserve.engine.block_manager import BlockManager, blocks_for


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_grow_and_free_return_to_baseline():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = [], []
    assert bm.grow(a, 5) == a and len(a) == 2
    assert bm.grow(a, 8) == []  # already covered
    bm.grow(b, 13)
    assert len(b) == 4 and bm.num_free_blocks == 4
    assert not set(a) & set(b)
    bm.free(a)
    bm.free(b)
    assert a == [] and b == [] and bm.num_free_blocks == 10 and bm.num_used_blocks == 0


def test_grow_beyond_capacity_raises_and_takes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    table: list[int] = []
    assert not bm.can_grow(table, 13)
    with pytest.raises(MemoryError):
        bm.grow(table, 13)
    assert table == [] and bm.num_free_blocks == 3


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=3, block_size=4)
    table: list[int] = []
    bm.grow(table, 4)
    copy = list(table)
    bm.free(table)
    with pytest.raises(ValueError):
        bm.free(copy)


def test_lowest_free_ids_first_then_released_tables_so_tables_stay_in_runs():
    """A PD KV read costs one copy per run of consecutive blocks, and CPU attention reads a table's blocks
    in order: hand out the lowest ids no table held first, then released tables as runs."""
    m = BlockManager(num_blocks=12, block_size=4)
    a, b, c = [], [], []
    for table, num_tokens in ((a, 12), (b, 8), (c, 12)):  # a: 0-2, b: 3-4, c: 5-7
        m.grow(table, num_tokens)
    m.free(c)
    m.free(a)
    d = []
    m.grow(d, 24)  # 6 blocks: 8-11 never held, then c's last two, in ascending order
    assert d == [8, 9, 10, 11, 6, 7]
    m.check()


def test_a_growing_table_takes_the_free_block_after_its_last_before_a_lower_one():
    """CPU attention reads a table's blocks in order: the free block right after the table's last one
    continues its run, even while a lower id is free."""
    m = BlockManager(num_blocks=8, block_size=4)
    a, b, c = [], [], []
    for table, num_tokens in ((a, 8), (b, 4), (c, 4)):  # a: 0-1, b: 2, c: 3
        m.grow(table, num_tokens)
    m.free(b)
    m.reset_prefix_cache()  # NOTE: released blocks go back to the free heap: free 2, 4-7
    assert m.grow(c, 8) == [4], "block 4 continues c; the lowest free id (2) would not"
    d = []
    assert m.grow(d, 8) == [2, 5], "a new table starts at the lowest free id"
    m.check()
