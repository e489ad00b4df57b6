import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvchat.engine.kv.block_pool import BlockPool, PoolExhausted
from kvchat.engine.kv.manager import KVCacheManager, Sequence

BS = 4


def manager(num_blocks=8):
    pool = BlockPool(num_blocks)
    return pool, KVCacheManager(pool, BS, "model|fp16")


def run(mgr, tokens):
    """Compute a whole sequence and return it, blocks still held."""
    seq = Sequence(list(tokens))
    mgr.match_prefix(seq)
    mgr.reserve(seq, len(seq))
    seq.num_computed = len(seq)
    mgr.commit(seq)
    return seq


def test_allocation_takes_blocks_in_order_with_one_reference():
    pool, mgr = manager()
    seq = run(mgr, range(10))
    assert [b.id for b in seq.blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in seq.blocks] == [1, 1, 1]
    assert pool.num_free == 5
    assert [b.hash is not None for b in seq.blocks] == [True, True, False]  # the tail is not full


def test_release_keeps_full_blocks_findable_tail_first_in_the_queue():
    pool, mgr = manager()
    seq = run(mgr, range(12))
    mgr.free(seq)
    assert pool.num_free == 8
    assert list(pool.free_queue) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert pool.num_reclaimable == 3


def test_prefix_hit_shares_blocks_and_counts_references():
    pool, mgr = manager()
    a = run(mgr, range(12))
    b = Sequence(list(range(8)) + [99, 98, 97])
    assert mgr.match_prefix(b) == 8
    assert [blk.id for blk in b.blocks] == [0, 1]
    assert [blk.ref_cnt for blk in a.blocks] == [2, 2, 1]
    mgr.free(a)
    assert [blk.ref_cnt for blk in b.blocks] == [1, 1]
    assert list(pool.free_queue) == [3, 4, 5, 6, 7, 2]


def test_the_last_prompt_token_is_always_computed():
    _, mgr = manager()
    mgr.free(run(mgr, range(8)))
    again = Sequence(list(range(8)))
    assert mgr.match_prefix(again) == 4  # the second block holds the last token: recomputed


def test_a_hit_needs_the_same_chain_not_just_the_same_block():
    _, mgr = manager()
    mgr.free(run(mgr, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = Sequence([0, 0, 0, 0, 5, 6, 7, 8, 9])
    assert mgr.match_prefix(other) == 0


def test_a_different_extra_key_misses():
    pool, mgr = manager()
    mgr.free(run(mgr, range(9)))
    int4 = KVCacheManager(pool, BS, "model|int4")
    assert int4.match_prefix(Sequence(list(range(9)))) == 0


def test_hash_collision_is_checked_against_token_ids():
    pool, mgr = manager()
    seq = run(mgr, range(9))
    h = seq.hashes[0]
    assert pool.lookup(h, (0, 1, 2, 3)) is seq.blocks[0]
    assert pool.lookup(h, (0, 1, 2, 4)) is None


def test_eviction_takes_least_recent_and_tail_blocks_first():
    pool, mgr = manager(num_blocks=6)
    a = run(mgr, range(0, 8))        # blocks 0, 1
    b = run(mgr, range(100, 108))    # blocks 2, 3
    mgr.free(a)
    mgr.free(b)
    assert list(pool.free_queue) == [4, 5, 1, 0, 3, 2]
    c = run(mgr, range(200, 216))  # needs 4 blocks: 4, 5, then a's tail, then a's head
    assert [blk.id for blk in c.blocks] == [4, 5, 1, 0]
    assert pool.evictions == 2
    assert mgr.match_prefix(Sequence(list(range(0, 8)))) == 0
    assert mgr.match_prefix(Sequence(list(range(100, 108)) + [1])) == 8


def test_pinned_blocks_are_evicted_last():
    pool, mgr = manager(num_blocks=4)
    persona = run(mgr, range(8))
    for blk in persona.blocks:
        pool.set_pinned(blk, True)
    mgr.free(persona)
    other = run(mgr, range(50, 58))
    mgr.free(other)
    assert list(pool.pinned_queue) == [1, 0]
    fresh = run(mgr, range(60, 68))
    assert {blk.id for blk in fresh.blocks} == {2, 3}  # the unpinned ones went
    assert mgr.match_prefix(Sequence(list(range(8)) + [1])) == 8


def test_exhaustion_raises_and_leaks_nothing():
    pool, mgr = manager(num_blocks=2)
    seq = Sequence(list(range(12)))
    with pytest.raises(PoolExhausted):
        mgr.reserve(seq, 12)
    mgr.free(seq)
    assert pool.num_free == 2


def test_compaction_gives_in_use_blocks_low_ids_so_a_shrink_can_go_ahead():
    pool = BlockPool(8)
    blocks = [pool.allocate() for _ in range(6)]
    pool.cache(blocks[2], b"h2", (1, 2))
    pool.release(blocks[:3])  # free queue: 6, 7, then 2, 1, 0 (tail first)
    assert not pool.shrink(4)  # 4 and 5 are in use
    assert pool.compact(2) is None and pool.num_blocks == 8  # two to move, only 0 and 1 free below 2
    moved = blocks[4], blocks[5]
    assert pool.compact(4) == {4: 2, 5: 1}
    assert [b.id for b in moved] == [2, 1] and pool.blocks[2] is moved[0] and pool.blocks[1] is moved[1]
    assert pool.lookup(b"h2", (1, 2)) is None and pool.evictions == 1  # the spot's prefix is gone
    assert pool.shrink(4) and pool.num_blocks == 4
    assert list(pool.free_queue) == [0] and [b.ref_cnt for b in pool.blocks] == [0, 1, 1, 1]


def test_double_free_is_refused():
    pool, mgr = manager()
    seq = run(mgr, range(4))
    blocks = list(seq.blocks)
    mgr.free(seq)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(blocks)


class PoolMachine(RuleBasedStateMachine):
    """Requests with shared prefixes start, grow, finish or get cancelled in any order; pinning
    and eviction happen on the way. No block may leak or be both free and referenced."""

    def __init__(self):
        super().__init__()
        self.pool, self.mgr = manager(num_blocks=10)
        self.running: list[Sequence] = []

    @rule(prefix=st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8)]),
          tail=st.lists(st.integers(0, 5), min_size=1, max_size=9))
    def start(self, prefix, tail):
        seq = Sequence(list(prefix) + tail)
        self.mgr.match_prefix(seq)
        try:
            self.mgr.reserve(seq, len(seq))
        except PoolExhausted:
            self.mgr.free(seq)  # what the engine does on an error
            return
        seq.num_computed = len(seq)
        self.mgr.commit(seq)
        self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 20), n=st.integers(1, 6))
    def grow(self, i, n):
        seq = self.running[i % len(self.running)]
        seq.token_ids += [7] * n
        try:
            self.mgr.reserve(seq, len(seq))
        except PoolExhausted:
            seq.token_ids = seq.token_ids[:-n]
            return
        seq.num_computed = len(seq)
        self.mgr.commit(seq)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 20))
    def finish_or_cancel(self, i):
        self.mgr.free(self.running.pop(i % len(self.running)))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 20), pinned=st.booleans())
    def pin(self, i, pinned):
        for blk in self.running[i % len(self.running)].blocks:
            self.pool.set_pinned(blk, pinned)

    @rule(n=st.integers(1, 12))
    def resize(self, n):
        """A shrink, compacting when it must (the data move is the KV cache's job), or a growth."""
        if n >= self.pool.num_blocks:
            self.pool.grow(n)
        elif not self.pool.shrink(n) and self.pool.compact(n) is not None:
            assert self.pool.shrink(n)
        assert all(b.id == i for i, b in enumerate(self.pool.blocks))

    @invariant()
    def references_match_the_running_sequences(self):
        held = {}
        for seq in self.running:
            for blk in seq.blocks:
                held[blk.id] = held.get(blk.id, 0) + 1
        for blk in self.pool.blocks:
            assert blk.ref_cnt == held.get(blk.id, 0)
            in_queue = blk.id in self.pool.free_queue or blk.id in self.pool.pinned_queue
            assert in_queue == (blk.ref_cnt == 0), f"block {blk.id} free={in_queue} refs={blk.ref_cnt}"
        assert not set(self.pool.free_queue) & set(self.pool.pinned_queue)

    @invariant()
    def cache_map_points_at_hashed_blocks(self):
        for h, blk in self.pool.cached.items():
            assert blk.hash == h

    def teardown(self):
        for seq in self.running:
            self.mgr.free(seq)
        assert self.pool.num_free == self.pool.num_blocks


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
