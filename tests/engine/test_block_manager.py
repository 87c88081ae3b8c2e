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


def test_a_new_table_claims_room_to_grow_and_the_next_table_starts_after_it():
    """CPU attention reads a table's blocks in order: a request that will grow keeps the blocks after its
    prompt's, so the next request's prompt does not split its run."""
    m = BlockManager(num_blocks=12, block_size=4)
    a, b = [], []
    assert m.grow(a, 8, expected_tokens=16) == [0, 1]  # claims 2-3
    assert m.grow(b, 8, expected_tokens=12) == [4, 5]  # not 2: claims 6
    assert m.num_claimed_blocks == 3 and m.num_free_blocks == 12 - 4
    assert m.grow(a, 16, expected_tokens=16) == [2, 3]
    assert m.grow(b, 12, expected_tokens=12) == [6]
    assert m.num_claimed_blocks == 0
    m.check()


def test_once_the_pool_has_cycled_a_new_table_takes_a_long_enough_run_not_the_oldest_block():
    m = BlockManager(num_blocks=8, block_size=4)
    tables = [[] for _ in range(8)]
    for table in tables:  # one block each: 0-7
        m.grow(table, 4)
    for i in (2, 5, 6, 7):  # released oldest first: 2 (between held 1 and 3), then the run 5-7
        m.free(tables[i])
    new = []
    assert m.grow(new, 4, expected_tokens=12) == [5], "the oldest released block (2) has no room after it"
    assert m.grow(new, 12, expected_tokens=12) == [6, 7]
    m.check()


def test_claims_are_soft_and_end_with_their_table():
    m = BlockManager(num_blocks=6, block_size=4)
    a, b = [], []
    assert m.grow(a, 4, expected_tokens=16) == [0]  # claims 1-3
    assert m.grow(b, 8) == [4, 5]  # unclaimed blocks first
    c = []
    assert m.grow(c, 4) == [1], "with nothing else left, a claimed block is taken"
    m.check()
    assert m.grow(a, 8, expected_tokens=16) == [2], "its claim ended where another table took a block"
    m.free(a)  # releases 0 and 2, and its claim on 3
    assert m.num_claimed_blocks == 0 and m.num_free_blocks == 3
    m.check()
