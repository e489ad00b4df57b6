"""Prefix reuse on the starter's first 4 layers: hits give the same greedy tokens as cold runs."""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.core.events import Request
from kvchat.engine.model.loading import LoadedModel
from kvchat.engine.kv.disk_tier import DiskTier
from kvchat.engine.kv.recent_window import RecentWindow

from tiny_models import as_loaded, tiny_model

PERSONA_A = {"role": "system", "content": "You are a concise geography teacher. Answer in one sentence. " * 6}
PERSONA_B = {"role": "system", "content": "You are a cheerful chef who loves soup and bread. " * 6}
GREEDY = dict(max_new_tokens=12, temperature=0)


def new_engine(short_starter, store=None, **config):
    e = Engine(EngineConfig(max_context=1024, **config), loaded=LoadedModel(**vars(short_starter)), disk_tier=store)
    e.wait_ready()
    return e


def cold(short_starter, messages):
    e = new_engine(short_starter)
    try:
        return e.generate(messages, **GREEDY)
    finally:
        e.close()


@pytest.fixture(scope="module")
def warm(short_starter):
    e = new_engine(short_starter)
    yield e
    e.close()


def reply(done):
    return {"role": "assistant", "content": done.text, "token_ids": done.token_ids}


def test_multi_turn_reuses_the_whole_history_and_matches_cold(short_starter, warm):
    messages = [PERSONA_A, {"role": "user", "content": "What is the capital of Peru?"}]
    first = warm.generate(messages, **GREEDY)
    messages += [reply(first), {"role": "user", "content": "And of Chile?"}]
    second = warm.generate(messages, **GREEDY)
    prompt = warm.session.formatter.encode(messages).token_ids
    history = warm.session.formatter.encode(messages[:3], add_generation_prompt=False).token_ids
    # every token the first turn computed: persona, question, the reply short of its last token,
    # its partly filled last block included
    assert second.stats.cached_tokens == first.stats.prompt_tokens + len(first.token_ids) - 1
    assert second.stats.cached_tokens > len(history) // 16 * 16
    assert prompt[:len(history)] == history
    assert second.token_ids == cold(short_starter, messages).token_ids


def test_persona_switch_and_back_stays_warm(short_starter, warm):
    q = {"role": "user", "content": "Tell me something nice."}
    a1 = warm.generate([PERSONA_A, q], **GREEDY)
    b1 = warm.generate([PERSONA_B, q], **GREEDY)
    a2 = warm.generate([PERSONA_A, {"role": "user", "content": "Another thing?"}], **GREEDY)
    b2 = warm.generate([PERSONA_B, {"role": "user", "content": "Another thing?"}], **GREEDY)
    persona_blocks = len(warm.session.formatter.encode([PERSONA_A], add_generation_prompt=False).token_ids) // 16
    assert a2.stats.cached_tokens >= persona_blocks * 16 and b2.stats.cached_tokens >= persona_blocks * 16
    assert b1.token_ids == cold(short_starter, [PERSONA_B, q]).token_ids
    assert a1.token_ids == cold(short_starter, [PERSONA_A, q]).token_ids


def test_regenerate_reuses_everything_before_the_reply(short_starter, warm):
    messages = [PERSONA_A, {"role": "user", "content": "Name a river in Africa."}]
    first = warm.generate(messages, **GREEDY)
    again = warm.generate(messages, **GREEDY)
    # all but the last token (its logits are needed), the partly filled last block included
    assert again.stats.cached_tokens == again.stats.prompt_tokens - 1
    assert again.token_ids == first.token_ids == cold(short_starter, messages).token_ids


def test_edit_reuses_everything_before_the_edited_message(short_starter, warm):
    base = [PERSONA_A, {"role": "user", "content": "Name a mountain."}]
    first = warm.generate(base, **GREEDY)
    convo = base + [reply(first), {"role": "user", "content": "How high is it?"}]
    warm.generate(convo, **GREEDY)
    edited = base + [reply(first), {"role": "user", "content": "Where is it?"}]
    done = warm.generate(edited, **GREEDY)
    before_edit = len(warm.session.formatter.encode(edited[:3], add_generation_prompt=False).token_ids)
    old, new = (warm.session.formatter.encode(m).token_ids for m in (convo, edited))
    shared_tokens = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    # up to the first token the edit changed, in the middle of a cached block (copied) or not
    assert done.stats.cached_tokens == shared_tokens >= before_edit
    assert done.token_ids == cold(short_starter, edited).token_ids


def test_persona_blocks_are_pinned_after_use(warm):
    warm.generate([PERSONA_B, {"role": "user", "content": "Hi"}], **GREEDY)
    n = len(warm.session.formatter.encode([PERSONA_B], add_generation_prompt=False).token_ids) // 16
    ids = warm.session.formatter.encode([PERSONA_B], add_generation_prompt=False).token_ids
    key = list(warm.kvpool.manager.chain(ids, n))[-1][1]  # the chained hash of its last full block
    pinned = [b for b, _ in warm.kvpool.personas.pinned[key]]
    assert len(pinned) == n and all(b.pinned and b.ref_cnt == 0 for b in pinned)
    assert all(b.id in warm.kvpool.blocks.pinned_queue for b in pinned)


def test_restart_restores_the_persona_from_disk(short_starter, tmp_path):
    messages = [PERSONA_A, {"role": "user", "content": "What is the longest river?"}]
    first = new_engine(short_starter, DiskTier(tmp_path))
    expected = first.generate(messages, **GREEDY)
    first.close()
    persona = len(first.session.formatter.encode([PERSONA_A], add_generation_prompt=False).token_ids)
    assert len(list(tmp_path.glob("*.pin"))) == persona // 16  # the persona's blocks, pinned in the disk tier
    assert DiskTier(tmp_path).clear() > 0 and len(list(tmp_path.glob("*.pin"))) == persona // 16  # the chat's went
    restarted = new_engine(short_starter, DiskTier(tmp_path))
    done = restarted.generate(messages, **GREEDY)
    restarted.close()
    assert done.stats.cached_tokens == persona // 16 * 16
    assert done.token_ids == expected.token_ids


class EngineMachine(RuleBasedStateMachine):
    """Requests over shared prefixes, cancels and evictions (a 12-block pool) on a tiny model:
    whatever the order, every block comes back and no block is both free and referenced."""

    loaded = None

    def __init__(self):
        super().__init__()
        self.engine = Engine(EngineConfig(max_context=160, kv_budget_bytes=12 * 16 * 2 * 2 * 2 * 64 * 4,
                                          prefill_chunk=24),
                             loaded=self.loaded, disk_tier=None)
        self.engine.wait_ready()
        self.handles = []

    @rule(prefix=st.sampled_from([[], list(range(10, 40)), list(range(10, 60))]),
          tail=st.lists(st.integers(3, 500), min_size=1, max_size=30), new=st.integers(1, 40),
          cancel=st.booleans())
    def request(self, prefix, tail, new, cancel):
        h = self.engine.submit(Request(prompt_ids=prefix + tail, sampling=SamplingParams(
            max_new_tokens=new, temperature=0, ignore_eos=True)))
        if cancel:
            h.cancel()
        self.handles.append(h)

    @rule()
    def drain(self):
        for h in self.handles:
            for _ in h:
                pass
        self.handles = []
        pool = self.engine.kvpool.blocks
        assert pool.num_free == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)

    @invariant()
    def engine_alive(self):
        assert self.engine.alive

    def teardown(self):
        self.drain()
        for b in self.engine.kvpool.blocks.blocks:
            assert (b.id in self.engine.kvpool.blocks.free_queue) != (b.id in self.engine.kvpool.blocks.pinned_queue)
        self.engine.close()


@pytest.mark.parametrize("layout", ["one run", "two runs", "scattered"])
def test_prefill_reads_the_context_in_place_as_the_gathered_path_does(layout):
    """A chunk of 37 after 512 cached tokens: views of the runs plus its own K/V, merged, equal the
    masked attention over a gathered copy; more runs than MAX_RUNS are gathered."""
    from kvchat.kernels import quant, reference

    torch.manual_seed(0)
    fmt, bs, context, t = quant.FORMATS["fp16"], 16, 549, 37
    tensors = quant.layer_tensors(fmt, 64, bs, 3, 32, torch.float32, "cpu")
    tensors["k"].normal_(), tensors["v"].normal_()
    need = -(-context // bs)
    ids = {"one run": list(range(5, 5 + need)), "two runs": list(range(need // 2)) + list(range(40, 40 + need - need // 2)),
           "scattered": torch.randperm(64)[:need].tolist()}[layout]
    table, query = torch.tensor(ids), torch.randn(t, 9, 32)
    assert reference.in_place(query, fmt, context)
    rows = [quant.read(tensors, fmt, n, table, context, None, torch.float32).transpose(0, 1)[None] for n in "kv"]
    expected = reference.causal_attention(query.transpose(0, 1)[None], *rows, 0.2)[0].transpose(0, 1)
    got = reference.prefill_in_place(query, tensors, table, context, 0.2)
    assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("parts", [2, 3])
def test_a_few_new_tokens_attend_to_the_context_in_equal_parts(monkeypatch, parts):
    """7 new tokens after 2,000 cached: the context cut into ``parts`` equal parts, one batched
    call (and a call for the rows left over), equals the masked attention over a gathered copy."""
    from kvchat.kernels import quant, reference

    torch.manual_seed(0)
    fmt, bs, context, t = quant.FORMATS["fp16"], 16, 2007, 7
    tensors = quant.layer_tensors(fmt, 130, bs, 3, 32, torch.float32, "cpu")
    tensors["k"].normal_(), tensors["v"].normal_()
    table, query = torch.arange(3, 3 + -(-context // bs)), torch.randn(t, 9, 32)
    rows = [quant.read(tensors, fmt, n, table, context, None, torch.float32).transpose(0, 1)[None] for n in "kv"]
    expected = reference.causal_attention(query.transpose(0, 1)[None], *rows, 0.2)[0].transpose(0, 1)
    batches, flash = [], reference._FLASH
    monkeypatch.setattr(reference, "_FLASH", lambda q, *a, **k: batches.append(q.shape[0]) or flash(q, *a, **k))
    monkeypatch.setattr(reference, "_splits", lambda kv_heads, rows: parts)
    got = reference.prefill_in_place(query, tensors, table, context, 0.2)
    assert parts in batches and torch.allclose(got, expected, atol=1e-5)


def test_the_context_is_cut_so_that_every_thread_has_work(monkeypatch):
    """3 KV heads: 7 new tokens (21 folded rows, one block of the kernel's) on 2 threads in 2
    parts; 18 (54 rows, two blocks) already share out evenly; 4 heads on 16 threads in 4."""
    from kvchat.kernels import reference

    monkeypatch.setattr(reference.torch, "get_num_threads", lambda: 2)
    assert (reference._splits(3, 21), reference._splits(3, 54)) == (2, 1)
    monkeypatch.setattr(reference.torch, "get_num_threads", lambda: 16)
    assert reference._splits(4, 21) == 4


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("context, chunk, window, scattered",
                         [(600, 40, True, False), (600, 40, False, False), (70, 60, True, False), (600, 40, True, True)])
def test_quantized_prefill_split_equals_the_masked_path(monkeypatch, precision, context, chunk, window, scattered):
    """The earlier context dequantized in pieces (a view of each run of blocks; gathered when the
    blocks are scattered), the window's rows as their own piece (70 tokens: the window reaches into
    the chunk), the chunk's own K/V exact: as one masked attention over a dequantized copy with the
    window substituted and the chunk's rows in place."""
    from kvchat.kernels import quant, reference

    torch.manual_seed(0)
    fmt, bs = quant.FORMATS[precision], 16
    tensors = quant.layer_tensors(fmt, 64, bs, 3, 64, torch.float32, "cpu")
    rotation = quant.hadamard(64, "cpu")
    table = torch.tensor((list(range(3, 23)) + list(range(30, 64)))[:-(-context // bs)])
    if scattered:
        table = torch.randperm(64)[:len(table)]
    slots = table[torch.arange(context) // bs] * bs + torch.arange(context) % bs
    rows = []
    quant.write(tensors, fmt, torch.randn(context, 3, 64), torch.randn(context, 3, 64), slots, rotation,
                keep_rows=lambda k, v: rows.append((k, v)))
    k, v = rows[0]
    recent = None
    if window:
        ring = RecentWindow(1, 3, 64, torch.float32, "cpu")
        ring.store(0, 0, k, v)
        recent = ring.rows(0, context)
    query, fresh = torch.randn(chunk, 9, 64), (k[-chunk:], v[-chunk:])
    attend = lambda: reference.paged_attention(query, tensors, fmt, table, context, 0.125, None, rotation, None,
                                               recent, fresh)
    assert reference.in_place(query, fmt, context, fresh)
    got = attend()
    monkeypatch.setattr(reference, "in_place", lambda *a: False)
    assert torch.allclose(got, attend(), atol=1e-5)


def test_a_new_turn_grows_into_the_block_after_its_cached_prefix():
    """Turn 2 takes turn 1's released partial block, not the free queue's front: its K/V stay
    one run. A block that holds a cached prefix is never taken out of LRU order for that."""
    from kvchat.engine.kv.block_pool import BlockPool
    from kvchat.engine.kv.manager import KVCacheManager, Sequence

    manager = KVCacheManager(BlockPool(8), 4, "m")
    first = Sequence(list(range(10)))
    manager.reserve(first, 10)
    first.num_computed = 10
    manager.commit(first)
    manager.free(first)  # blocks 0, 1 cached; 2 (tokens 8, 9) free and empty
    second = Sequence(list(range(8)) + [50, 51, 52, 53, 54])
    assert manager.match_prefix(second) == 8
    manager.reserve(second, len(second))
    assert [b.id for b in second.blocks] == [0, 1, 2, 3]
    second.num_computed = len(second)
    manager.commit(second)
    manager.free(second)
    third = Sequence(list(range(4)) + [9] * 5)
    assert manager.match_prefix(third) == 4
    manager.reserve(third, len(third))  # block 1, after its prefix, is free but cached: left alone
    assert [b.id for b in third.blocks][1] != 1 and manager.pool.blocks[1].hash is not None


def test_a_new_turn_takes_the_rows_it_shares_with_the_last_turns_partly_filled_block():
    """Turn 1 computed 10 tokens (blocks of 4): its third block holds tokens 8, 9. Turn 2, the same
    up to token 8, takes that block and computes from token 9 on; a turn that differs right after
    the full blocks finds it empty and grows into it; a tail evicted meanwhile is not served."""
    from kvchat.engine.kv.block_pool import BlockPool
    from kvchat.engine.kv.manager import KVCacheManager, Sequence

    manager = KVCacheManager(BlockPool(8), 4, "m")

    def turn(ids, computed=None):
        seq = Sequence(list(ids))
        served = manager.match_prefix(seq) + manager.match_tail(seq)
        manager.reserve(seq, len(seq))
        seq.num_computed = len(seq) if computed is None else computed
        manager.commit(seq)
        return seq, served

    first, _ = turn(range(12), computed=10)  # the 11th and 12th tokens sampled, not computed
    tail = first.blocks[2]
    manager.free(first, keep_tail=True)
    second, served = turn(list(range(9)) + [70, 71, 72])
    assert served == 9 and second.blocks[2] is tail and second.num_computed == 12
    manager.free(second, keep_tail=True)  # its third block is full now: cached as a whole, no tail
    again = Sequence(list(range(9)) + [70, 71, 72, 5])
    assert manager.match_prefix(again) == 12 and manager.match_tail(again) == 0
    manager.free(again)

    third, _ = turn(list(range(4)) + [40, 41, 42, 43, 44, 45, 46], computed=10)  # tail: 44, 45
    block = third.blocks[2]
    assert [b.id for b in third.blocks[1:]] == [block.id - 1, block.id]
    manager.free(third, keep_tail=True)
    fourth, served = turn(list(range(4)) + [40, 41, 42, 43, 99, 98, 97])
    assert served == 8 and fourth.blocks[2] is block and block.hash is None  # grown into, not served
    manager.free(fourth)

    fifth, _ = turn(list(range(4)) + [40, 41, 42, 43, 44, 45, 46, 47, 48])  # 44..47: a full block
    full = fifth.blocks[2]
    manager.free(fifth)
    copies = []
    edited = Sequence(list(range(4)) + [40, 41, 42, 43, 44, 45, 77, 78])  # the last message edited
    assert manager.match_prefix(edited) == 8
    assert manager.match_tail(edited, copy=lambda src, dst: copies.append((src, dst))) == 2
    assert copies == [(full.id, edited.blocks[2].id)] and full.id != edited.blocks[2].id
    assert full.hash is not None and full.ref_cnt == 0  # still cached for others
    manager.free(edited)

    small = KVCacheManager(BlockPool(3), 4, "m")
    sixth = Sequence(list(range(10)))
    small.reserve(sixth, 10)
    sixth.num_computed = 10
    small.commit(sixth)
    small.free(sixth, keep_tail=True)
    small.pool.release([small.pool.allocate()])  # the LRU front, the tail, evicted to serve it
    seventh = Sequence(list(range(9)) + [70])
    assert small.match_prefix(seventh) == 8 and small.match_tail(seventh) == 0 and seventh.num_computed == 8


def test_the_next_turn_keeps_the_last_turns_full_precision_rows():
    """Quantized modes: a turn that shares the last one's computed tokens goes on with its window
    (rewound to where they part), so the newest shared rows stay exact; another turn gets none."""
    from kvchat.engine.kv.block_pool import BlockPool
    from kvchat.engine.kv.manager import KVCacheManager, Sequence

    window = RecentWindow(1, 1, 2, torch.float32, "cpu", size=8, sinks=2)
    rows = torch.arange(20.0).view(20, 1, 1).expand(20, 1, 2)
    window.store(0, 0, rows, rows)  # positions 0..19: the ring holds 12..19
    manager = KVCacheManager(BlockPool(8), 4, "m")
    first = Sequence(list(range(20)), window=window)
    manager.reserve(first, 20)
    first.num_computed = 20
    manager.commit(first)
    manager.free(first, keep_tail=True)
    other = Sequence(list(range(50, 59)))
    manager.match_prefix(other), manager.match_tail(other)
    assert other.window is None  # and the window is gone: it went with the last turn only
    manager.free(other)

    first = Sequence(list(range(20)), window=window)
    manager.match_prefix(first)
    first.num_computed = 20
    manager.free(first, keep_tail=True)
    second = Sequence(list(range(15)) + [70, 71])
    served = manager.match_prefix(second) + manager.match_tail(second, copy=lambda src, dst: None)
    assert served == 15 and second.window is window
    s, held, k, _ = window.rows(0, 15)
    assert (s, held) == (2, 12) and k[:, 0, 0].tolist() == [0, 1, 12, 13, 14]
    window.store(0, 15, rows[:2] + 100, rows[:2] + 100)  # the new turn's positions 15, 16
    assert window.rows(0, 17)[2][:, 0, 0].tolist() == [0, 1, 12, 13, 14, 100, 101]
    window.rewind(30)  # past what it held: sinks only
    assert window.bounds(0, 30) == (2, 30)


def test_engine_state_machine(tokenizer):
    EngineMachine.loaded = as_loaded(tiny_model("llama"), tokenizer)
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(EngineMachine, settings=settings(
        max_examples=15, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)))


def test_the_default_disk_tier_takes_the_place_of_the_old_persona_folder(short_starter, tmp_path, monkeypatch):
    """Earlier versions kept personas in a second store, ``persona-kv/``: a persona's KV is its
    text in another form, so the folder nothing reads any more goes at the first start."""
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    old = tmp_path / "cache" / "persona-kv"
    old.mkdir(parents=True)
    (old / ("ab" * 16 + ".safetensors")).write_bytes(b"\0" * 64)
    e = Engine(EngineConfig(max_context=512), loaded=LoadedModel(**vars(short_starter)))
    try:
        e.wait_ready()
        e.generate([PERSONA_A, {"role": "user", "content": "Hi"}], max_new_tokens=2, temperature=0)
    finally:
        e.close()
    persona = len(e.session.formatter.encode([PERSONA_A], add_generation_prompt=False).token_ids) // 16
    assert not old.exists() and len(list((tmp_path / "cache" / "kv-blocks").glob("*.pin"))) == persona
