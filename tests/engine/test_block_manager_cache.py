"""The block manager's prefix-cache index and the matching rule (prefix_cache.find), as pure host
accounting: a property test drives random add/finish/abort/preempt/evict sequences and checks the
invariants after every step; unit tests pin each rule of a match."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpserve.engine import prefix_cache
from mtpserve.engine.block_index import CachedKV
from mtpserve.engine.block_manager import BlockManager
from mtpserve.engine.prefix_cache import chain_hashes, find

BS = 4
ROOT = prefix_cache.salt("test")


def hashes_of(tokens) -> list[bytes]:
    return chain_hashes(np.asarray(tokens, np.int64), BS, ROOT, [])


def cache_prompt(blocks: BlockManager, tokens, num_mtp: int = 0) -> list[int]:
    """Hold blocks for `tokens`, register every full one as a finished prefill would; returns the table."""
    table: list[int] = []
    blocks.grow(table, len(tokens))
    seq = np.asarray(tokens, np.int64)
    for j, h in enumerate(hashes_of(tokens)):
        end = (j + 1) * BS
        blocks.register(table[j], h, CachedKV(tuple(seq[end:end + num_mtp].tolist()), num_mtp))
    return table


class Model:
    """What the manager must agree with: who holds which block, and which blocks are cached."""

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self.tables: dict[int, list[int]] = {}

    def check(self) -> None:
        self.blocks.check()
        held: dict[int, int] = {}
        for table in self.tables.values():
            assert len(set(table)) == len(table), "a table holds a block twice"
            for b in table:
                held[b] = held.get(b, 0) + 1
        for b in range(self.blocks.num_blocks):
            assert self.blocks.refs(b) == held.get(b, 0), f"block {b}: refs differ from the tables"
        assert self.blocks.num_used_blocks == len(held)


actions = st.lists(st.tuples(st.sampled_from(["add", "extend", "finish", "abort", "preempt", "evict", "reset"]),
                             st.integers(0, 7), st.integers(1, 22)), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(actions)
def test_random_sequences_keep_refs_free_list_and_index_consistent(steps):
    blocks = BlockManager(num_blocks=24, block_size=BS)
    model = Model(blocks)
    prefixes = [tuple(range(100 * p, 100 * p + 22)) for p in range(3)]
    next_id = 0
    for action, pick, length in steps:
        if action == "add":
            tokens = prefixes[pick % 3][:length] + (pick,)
            hit = find(blocks, hashes_of(tokens), np.asarray(tokens), num_mtp=pick % 3)
            table = list(hit.shared)
            missing = -(-len(tokens) // BS) - len(table)
            idle = sum(blocks.refs(b) == 0 for b in hit.shared)
            if missing + idle > blocks.num_free_blocks:
                continue  # admission waits
            blocks.share(table)
            blocks.grow(table, len(tokens), expected_tokens=len(tokens) + BS * (pick % 4))  # NOTE: claims room
            model.tables[next_id] = table
            for j, h in enumerate(hashes_of(tokens)[:len(table)]):
                blocks.register(table[j], h, CachedKV(None, 0) if pick % 2 else CachedKV((pick,), 1))
            next_id += 1
        elif action == "extend" and model.tables:
            table = model.tables[sorted(model.tables)[pick % len(model.tables)]]
            num_tokens = (len(table) + 1 + length % 3) * BS
            if blocks.can_grow(table, num_tokens):
                blocks.grow(table, num_tokens, expected_tokens=num_tokens + BS * (pick % 3))
        elif action in ("finish", "abort", "preempt") and model.tables:
            victim = sorted(model.tables)[pick % len(model.tables)]
            blocks.free(model.tables.pop(victim))
        elif action == "evict":
            for _ in range(min(3 * pick, blocks.num_free_blocks)):  # NOTE: up to every block, claimed ones too
                model.tables.setdefault(-1, []).append(blocks.take())
        elif action == "reset":
            blocks.reset_prefix_cache()
        model.check()


def test_a_match_stops_before_the_last_token_and_recomputes_k_positions():
    blocks = BlockManager(16, BS)
    cache_prompt(blocks, list(range(1, 14)), num_mtp=2)  # 3 full blocks cached
    tokens = np.arange(1, 14)  # the same prompt: its last token (position 12) must be computed
    hit = find(blocks, hashes_of(tokens), tokens, num_mtp=2)
    assert hit.num_computed == 3 * BS - 2
    assert len(hit.shared) == 2 and hit.copy_from is not None  # block 2 holds positions 10, 11
    plain = BlockManager(16, BS)
    cache_prompt(plain, list(range(1, 14)), num_mtp=0)
    k0 = find(plain, hashes_of(tokens), tokens, num_mtp=0)
    assert k0.num_computed == 3 * BS and k0.copy_from is None


def test_a_block_whose_mtp_kv_read_other_tokens_ends_the_match():
    blocks = BlockManager(16, BS)
    table = cache_prompt(blocks, list(range(1, 14)), num_mtp=1)
    other = np.asarray([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 99, 98])
    # NOTE: block 1's lookahead (token 9) is the request's, block 0's too: the match runs through
    # block 2, whose lookahead (13) differs; it ends the match as its last block
    assert find(blocks, hashes_of(other), other, num_mtp=1).num_computed == 3 * BS - 1
    blocks.free(table)
    blocks.reset_prefix_cache()
    t = cache_prompt(blocks, [1, 2, 3, 4, 50, 51, 52, 53, 54], num_mtp=1)  # block 0 read token 50
    # a block 1 with this request's tokens, cached by someone whose block 0 is not indexed
    mine: list[int] = []
    blocks.grow(mine, 8)
    blocks.register(mine[1], hashes_of([1, 2, 3, 4, 5, 6, 7, 8])[1], CachedKV((9,), 1))
    req = np.asarray([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    hit = find(blocks, hashes_of(req), req, num_mtp=1)
    assert hit.num_computed == 1 * BS - 1, "block 0 read token 50 at position 4: it must end the match"
    assert hit.copy_from == t[0]


def test_a_copy_continued_differently_is_found_beside_the_original():
    blocks = BlockManager(16, BS)
    a = cache_prompt(blocks, [1, 2, 3, 4, 5, 6, 7, 8, 9], num_mtp=1)
    b = cache_prompt(blocks, [1, 2, 3, 4, 7, 7, 7, 7, 9], num_mtp=1)  # its own block 0, lookahead 7
    assert blocks.num_cached_blocks == 4 and set(a).isdisjoint(b)
    req = np.asarray([1, 2, 3, 4, 7, 7, 7, 7, 1, 1])
    hit = find(blocks, hashes_of(req), req, num_mtp=1)
    assert hit.shared == (b[0],) and hit.copy_from == b[1] and hit.num_computed == 2 * BS - 1


def test_a_drafted_lookahead_gives_way_to_a_known_one_and_not_back():
    blocks = BlockManager(8, BS)
    h = hashes_of([1, 2, 3, 4])[0]
    first, second, third = blocks.take(), blocks.take(), blocks.take()
    assert blocks.register(first, h, CachedKV(None, 2))
    assert blocks.register(second, h, CachedKV((5, 6), 2))
    assert not blocks.register(third, h, CachedKV(None, 2))
    assert blocks.lookup(h, (9, 9)) == (second, CachedKV((5, 6), 2)) and blocks.num_cached_blocks == 1
    blocks.free([first, second, third])
    assert blocks.num_evictable_blocks == 1 and blocks.num_free_blocks == 8
    blocks.check()


def test_eviction_takes_never_held_blocks_first_then_the_least_recently_released():
    blocks = BlockManager(5, BS)
    old = cache_prompt(blocks, [1, 2, 3, 4, 5])  # blocks 0, 1: block 0 cached
    new = cache_prompt(blocks, [9, 9, 9, 9, 5])  # blocks 2, 3: block 2 cached
    blocks.free(old)  # NOTE: released last block first: 1, 0, then 3, 2
    blocks.free(new)
    assert blocks.num_evictable_blocks == 2 and blocks.num_free_blocks == 5
    taken = [blocks.take() for _ in range(4)]
    assert taken[0] == 4, "a block no table ever held goes first"
    assert taken[1:] == [1, 0, 3], "then released blocks in release order, cached or not"
    assert blocks.lookup(hashes_of([1, 2, 3, 4])[0], ()) is None
    assert blocks.lookup(hashes_of([9, 9, 9, 9])[0], ()) is not None
    assert blocks.num_evictable_blocks == 1
    blocks.check()


def test_a_table_takes_a_released_table_as_one_run_cached_blocks_and_uncached_alike():
    """A request's decode blocks are never cached with k >= 2 (their MTP KV read drafts): released beside its
    cached prompt blocks, the next table takes all of them as one run, as it would at k = 0."""
    blocks = BlockManager(6, BS)
    first = cache_prompt(blocks, list(range(1, 9)))  # blocks 0, 1 cached
    blocks.grow(first, 4 * BS)  # blocks 2, 3: its decode blocks, never registered
    blocks.grow([], 2 * BS)  # blocks 4, 5: another table's, held throughout
    blocks.free(first)
    assert blocks.num_evictable_blocks == 2 and blocks.num_free_blocks == 4
    table: list[int] = []
    assert blocks.grow(table, 4 * BS) == [0, 1, 2, 3], "one run, not the uncached blocks first"
    blocks.check()


def two_released_prompts(never_held: int = 0) -> tuple[BlockManager, list[int], list[int]]:
    """Prompts A (blocks 0, 1) and B (2, 3) of 8 tokens, both blocks of each cached, both released (A first):
    the release order holds 1, 0, 3, 2 (a table goes last block first). `never_held` more blocks are free."""
    blocks = BlockManager(4 + never_held, BS)
    a, b = list(range(1, 9)), list(range(20, 28))
    first, second = cache_prompt(blocks, a), cache_prompt(blocks, b)
    assert (first, second) == ([0, 1], [2, 3])
    blocks.free(first)
    blocks.free(second)
    return blocks, a, b


def test_a_growing_table_continues_into_the_old_cached_block_after_its_last():
    blocks, a, _ = two_released_prompts()
    table = [0]
    blocks.share(table)
    assert blocks.grow(table, 2 * BS) == [1], "block 1 follows block 0 and was released first: a run"
    assert blocks.lookup(hashes_of(a)[1], ()) is None, "it left the cache"
    assert blocks.num_free_blocks == 2
    blocks.check()


def test_no_cached_block_is_evicted_for_a_run_while_free_blocks_remain():
    blocks, a, _ = two_released_prompts(never_held=2)
    table = [0]
    blocks.share(table)
    assert blocks.grow(table, 2 * BS) == [4]
    assert blocks.lookup(hashes_of(a)[1], ()) is not None
    blocks.check()


def test_a_recently_released_block_is_not_taken_out_of_lru_order():
    blocks, _, b = two_released_prompts()
    table = [2]
    blocks.share(table)
    assert blocks.grow(table, 2 * BS) == [1], "block 3 was released in the newer half: the LRU's oldest instead"
    assert blocks.lookup(hashes_of(b)[1], ()) is not None
    blocks.check()


def test_a_held_block_after_the_last_is_never_taken():
    blocks = BlockManager(5, BS)
    holder = cache_prompt(blocks, list(range(1, 10)))  # blocks 0-2, 0 and 1 cached, all held
    blocks.free(cache_prompt(blocks, list(range(20, 28))))  # blocks 3, 4 cached, released: the LRU holds 4, 3
    table = [0]
    blocks.share(table)
    assert blocks.grow(table, 2 * BS) == [4], "block 1 is held: the LRU's oldest instead"
    assert blocks.refs(1) == 1 and holder == [0, 1, 2]
    blocks.check()


def released_run() -> tuple[BlockManager, list[int]]:
    """Four blocks: a 13-token prompt whose three full blocks (0-2) are cached, released (the LRU holds
    2, 1, 0: a table goes last block first); its partial block 3 is taken by another table."""
    blocks = BlockManager(4, BS)
    tokens = list(range(1, 14))
    blocks.free(cache_prompt(blocks, tokens))
    assert blocks.grow([], BS) == [3]
    return blocks, tokens


def test_a_table_that_takes_a_released_run_takes_it_in_ascending_order():
    """LRU order would hand the run out last block first (2, 1, 0); the same blocks ascending are a run."""
    blocks, tokens = released_run()
    table: list[int] = []
    assert blocks.grow(table, 3 * BS) == [0, 1, 2]
    assert all(blocks.lookup(h, ()) is None for h in hashes_of(tokens[:12])), "the same three left the cache"
    blocks.check()


def test_a_table_that_wants_fewer_blocks_than_the_run_takes_its_tail():
    """Only the blocks the table takes anyway move: with one wanted, the LRU's oldest (the run's last block)
    goes and the head, which a match could still use, stays."""
    blocks, tokens = released_run()
    assert blocks.grow([], BS) == [2]
    assert blocks.grow([], 2 * BS) == [0, 1]
    blocks.check()


def test_a_claimed_cached_block_is_still_matched_and_its_claim_gives_it_up():
    blocks = BlockManager(num_blocks=8, block_size=BS)
    other = []
    blocks.grow(other, BS)  # 0
    prompt = tuple(range(2 * BS))
    cached = cache_prompt(blocks, prompt)  # 1-2
    rest = []
    blocks.grow(rest, 5 * BS)  # 3-7
    for table in (other, cached, rest):
        blocks.free(table)
    new = []
    assert blocks.grow(new, BS, expected_tokens=3 * BS) == [0]  # claims 1-2, still cached
    assert blocks.num_claimed_blocks == 2 and blocks.num_evictable_blocks == 2
    tokens = prompt + (99,)
    hit = find(blocks, hashes_of(tokens), np.asarray(tokens), num_mtp=0)
    assert list(hit.shared) == [1, 2]
    blocks.share(list(hit.shared))
    assert blocks.num_claimed_blocks == 0 and blocks.refs(1) == blocks.refs(2) == 1
    assert blocks.grow(new, 2 * BS, expected_tokens=3 * BS) not in ([1], [2]), "a matched block is not taken"
    blocks.check()
