"""The KV tiers under the pool (host RAM, disk) on the starter's first 4 layers: a conversation
pushed out of the pool, or out of a closed engine, comes back from them with the greedy tokens of a
pool that never lost it, in every precision."""
import errno
import os
import random
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from kvchat.core.config import EngineConfig
from kvchat.core.events import Notice, Request
from kvchat.core.config import SamplingParams
from kvchat.core.kv_sizes import KVShape, bytes_per_token
from kvchat.engine.engine import Engine
from kvchat.engine.governor import snapshot
from kvchat.engine.kv.disk_tier import DiskTier
from kvchat.engine.kv.host_tier import HostTier, StoredBlock, copy_out
from kvchat.engine.model.loading import LoadedModel

GEN = 16
# 241 prompt tokens + 16 generated, less the last one (never computed): 256, sixteen full blocks
# and no partly filled one, so the pool's and the tiers' matches end at the same token
A = random.Random(1).choices(range(100, 10000), k=241)
OTHERS = [random.Random(seed).choices(range(100, 10000), k=300) for seed in (2, 3)]
QUESTION = random.Random(4).choices(range(100, 10000), k=20)


def engine(lm, precision: str, pool_tokens: int, ram=None, disk=None) -> Engine:
    per_token = bytes_per_token(KVShape.from_config(lm.model.config), precision, lm.dtype.itemsize)
    config = EngineConfig(max_context=1024, kv_precision=precision, kv_budget_bytes=int(pool_tokens * per_token),
                          ram_cache_bytes=ram, disk_cache_bytes=0 if disk is None else 1 << 30)
    e = Engine(config, loaded=LoadedModel(**vars(lm)), disk_tier=disk)
    e.wait_ready()
    return e


def ask(e: Engine, ids: list[int]):
    sampling = SamplingParams(max_new_tokens=GEN, temperature=0, ignore_eos=True)
    return e.submit(Request(prompt_ids=list(ids), sampling=sampling)).result()


def script(e: Engine, others=OTHERS):
    """A conversation, others that push it out of a small pool, then its next turn."""
    first = ask(e, A)
    for ids in others:
        ask(e, ids)
    return ask(e, A + first.token_ids + QUESTION)


@pytest.mark.parametrize("precision", ["fp16", "int8", "fp8", "k8v4", "int4"])
def test_the_tiers_give_the_tokens_of_a_pool_that_never_lost_the_conversation(short_starter, tmp_path, precision):
    """Pushed out of a small pool by two other chats, the conversation comes back from RAM; after a
    restart, from disk (with the full-precision sinks a quantized pool needs: the new engine has
    none of its own). Both times the next turn's greedy tokens are the reference's, whose pool
    never evicted it."""
    reference = engine(short_starter, precision, 4096, ram=0)
    tiered = engine(short_starter, precision, 384, ram=1 << 30)  # 24 blocks: the others evict the conversation
    try:
        want, from_ram = script(reference), script(tiered)
        tiers = snapshot(tiered.session, 64 << 30, 0).tiers  # what the memory panel and /metrics show
    finally:
        reference.close()
        tiered.close()
    assert tiers["ram_hits"] * 16 == from_ram.stats.ram_tokens and tiers["ram_capacity"] == 1 << 30
    assert tiers["ram_used"] >= tiers["ram_hits"] * 16 * bytes_per_token(
        KVShape.from_config(short_starter.model.config), precision, 4)
    first = engine(short_starter, precision, 4096, ram=0, disk=DiskTier(tmp_path))
    try:
        generated = ask(first, A).token_ids
    finally:
        first.close()
    assert len(list(tmp_path.glob("*.kvb"))) == 16
    restarted = engine(short_starter, precision, 4096, ram=0, disk=DiskTier(tmp_path))
    try:
        from_disk = ask(restarted, A + generated + QUESTION)
    finally:
        restarted.close()
    assert want.stats.cached_tokens == want.stats.pool_tokens == 256
    assert from_ram.stats.cached_tokens == 256 and from_ram.stats.ram_tokens > 0 and from_ram.stats.disk_tokens == 0
    assert from_disk.stats.cached_tokens == from_disk.stats.disk_tokens == 256
    assert from_ram.token_ids == want.token_ids
    assert from_disk.token_ids == want.token_ids


def test_the_ram_tier_is_on_by_default(short_starter):
    """No cap set (a quarter of the free RAM) and no disk tier: the conversation still comes back."""
    e = engine(short_starter, "fp16", 384)
    try:
        done = script(e)
    finally:
        e.close()
    assert done.stats.cached_tokens == 256 and done.stats.ram_tokens > 0


def test_without_tiers_the_same_conversation_is_computed_again(short_starter):
    """The scenario above evicts: with the tiers off, nothing of the conversation is left."""
    e = engine(short_starter, "fp16", 384, ram=0)
    try:
        done = script(e)
    finally:
        e.close()
    assert done.stats.cached_tokens == 0


def test_the_ram_tier_reuses_the_buffers_of_the_blocks_that_left_it():
    """Blocks evicted into a RAM tier of 3 blocks, 40 times: each copy holds its block's rows, and
    the buffers of a block pushed out (to disk), discarded or cleared serve the next, so the
    buffers made stay those of the blocks held at once (pinned memory on CUDA, asked of the OS at
    every eviction before)."""
    gen = torch.Generator().manual_seed(0)
    layers = [{"k": torch.randn(8, 16, 2, 4, generator=gen), "k_scale": torch.rand(8, 2, 4, generator=gen)}
              for _ in range(3)]
    one = sum(t[0].numel() * t.element_size() for t in layers[0].values()) * len(layers)
    tier = HostTier(cap_bytes=3 * one)
    seen = set()
    for i in range(40):
        stored = copy_out(layers, i % 8, tier.buffers)
        stored.token_ids = (i,)
        seen.add(stored.tensors["k"].data_ptr())
        for _, gone in tier.put(bytes([i]), stored):
            gone.release()
            assert gone.tensors == {}  # nothing reads a released block's buffers
        for n, t in layers[0].items():
            want = torch.stack([layer[n][i % 8] for layer in layers]).unsqueeze(1)
            assert torch.equal(tier.get(bytes([i]), (i,)).tensors[n], want)
        if i == 20:
            assert tier.discard(bytes([i]))
    assert len(tier) == 3 and tier.used == 3 * one
    assert tier.buffers.made == 2 * 4 and len(seen) == 4  # k and k_scale of 3 held blocks and the one arriving
    tier.clear()
    assert tier.buffers.free_bytes == 0 and tier.used == 0


# -- the disk tier's files, without a model --

KEY = "test:model|fp16|torch.float32"


def block(seed: int = 0, tokens=tuple(range(16)), parent=None) -> StoredBlock:
    gen = torch.Generator().manual_seed(seed)
    return StoredBlock(tuple(tokens), parent, {"k": torch.randn(2, 1, 16, 2, 8, generator=gen),
                                                "v": torch.randn(2, 1, 16, 2, 8, generator=gen)})


def same(a: StoredBlock, b: StoredBlock) -> bool:
    return a.token_ids == b.token_ids and a.parent == b.parent and a.tensors.keys() == b.tensors.keys() and all(
        torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


def test_a_block_file_reads_back_exactly_and_is_the_users_only(tmp_path):
    tier = DiskTier(tmp_path / "blocks")
    stored = block(1, parent=b"p" * 16)
    stored.sinks = (torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8))
    assert tier.save(b"h" * 16, KEY, stored)
    path = tier.path(b"h" * 16)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(tier.folder.stat().st_mode) == 0o700
    back = DiskTier(tmp_path / "blocks").load(b"h" * 16, KEY, range(16))
    assert same(back, stored) and all(torch.equal(a, b) for a, b in zip(back.sinks, stored.sinks))
    assert tier.used == path.stat().st_size


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "other tokens", "empty"])
def test_a_damaged_truncated_or_foreign_file_is_a_miss_and_is_deleted(tmp_path, damage):
    tier = DiskTier(tmp_path)
    tier.save(b"h" * 16, KEY, block())
    path = tier.path(b"h" * 16)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 1
    elif damage == "truncate":
        data = data[:len(data) - 100]
    elif damage == "empty":
        data = b""
    path.write_bytes(data)
    key, tokens = ("other:model|fp16|torch.float32", range(16)) if damage == "foreign" else (KEY, range(16))
    if damage == "other tokens":
        tokens = range(1, 17)
    assert tier.load(b"h" * 16, key, tokens) is None
    assert not path.exists()


def test_the_cap_drops_the_least_recently_used_and_pinned_blocks_last(tmp_path):
    tier = DiskTier(tmp_path)
    for i in range(3):
        tier.save(bytes([i]) * 16, KEY, block(i))
    size = tier.path(bytes(16)).stat().st_size
    tier.pin(bytes([0]) * 16)  # the oldest, but a persona's
    now = time.time()
    for i, age in enumerate((300, 200, 100)):  # mtimes a second apart at least, oldest first
        os.utime(tier.find(bytes([i]) * 16), (now - age, now - age))
    assert tier.load(bytes([1]) * 16, KEY, range(16)) is not None  # used now: the newest
    tier.cap_bytes = 2 * size
    tier.trim()
    assert [tier.has(bytes([i]) * 16) for i in range(3)] == [True, True, False]
    assert tier.used == 2 * size
    tier.cap_bytes = size
    tier.trim()
    assert [tier.has(bytes([i]) * 16) for i in range(3)] == [True, False, False]


def test_a_full_disk_stops_the_writes_with_one_notice_and_the_chat_goes_on(short_starter, tmp_path, monkeypatch):
    class Full:
        def __init__(self, path):
            self.f = open(path, "xb")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvchat.engine.kv.disk_tier._create", Full)
    e = engine(short_starter, "fp16", 4096, ram=0, disk=DiskTier(tmp_path))
    notices = []
    e.add_listener(lambda event: notices.append(event) if isinstance(event, Notice) else None)
    try:
        first = ask(e, A)
        second = ask(e, A + first.token_ids + QUESTION)
    finally:
        e.close()
    assert first.finish_reason == second.finish_reason == "length" and len(second.token_ids) == GEN
    assert second.stats.pool_tokens == 256
    assert [n.kind for n in notices if n.kind == "disk-full"] == ["disk-full"]
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]  # no block, no temp file left


WRITER = """
import sys, torch
from kvchat.engine.kv.disk_tier import DiskTier
from kvchat.engine.kv.host_tier import StoredBlock
from kvchat.engine.kv.host_tier import StoredBlock
tier = DiskTier(sys.argv[1])
for i in range(1000):
    g = torch.Generator().manual_seed(i)
    tier.save(i.to_bytes(16, "little"), "k", StoredBlock(tuple(range(16)), None, {"k": torch.randn(4 << 20, generator=g)}))
    print(i, flush=True)
"""


def test_kill_9_mid_write_loses_nothing_written_and_leaves_no_half_file(tmp_path):
    """A writer killed at any point: every block it finished reads back exactly, no file under a
    block's name is partial, and the next start ignores (and later removes) the temp file."""
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    done = [int(child.stdout.readline()) for _ in range(3)]
    child.send_signal(signal.SIGKILL)
    child.wait()
    tier = DiskTier(tmp_path)
    names = sorted(p.name for p in tmp_path.glob("*.kvb"))
    assert len(names) >= len(done)
    for name in names:
        i = int.from_bytes(bytes.fromhex(name.removesuffix(".kvb")), "little")
        back = tier.load(i.to_bytes(16, "little"), "k", range(16))
        assert back is not None and torch.equal(back.tensors["k"], torch.randn(4 << 20, generator=torch.Generator().manual_seed(i)))
    assert all(tier.has(i.to_bytes(16, "little")) for i in done)
    for tmp in tmp_path.glob("*.tmp"):  # the write it was killed in, if it was in one
        assert not tier.has(bytes.fromhex(tmp.name.split(".")[0]))
        os.utime(tmp, (0, 0))
    tier.trim()
    assert list(tmp_path.glob("*.tmp")) == []


def test_metrics_show_each_tiers_bytes_capacity_hits_and_tokens():
    from prometheus_client import CollectorRegistry, generate_latest

    from kvchat.core.events import Finished, Stats
    from kvchat.core.memory import MemorySnapshot
    from kvchat.serve.metrics import Counters, MetricsCollector
    from kvchat.serve.server import EngineState

    state, counters = EngineState(), Counters()
    state(MemorySnapshot("cpu", 1, 0, 0, 0, 0, 0, 0, 0, "fp16", {}, True, tiers={
        "ram_used": 300, "ram_capacity": 1000, "ram_hits": 7, "disk_used": 50, "disk_capacity": 4000, "disk_hits": 2}))
    counters.count(Finished("", [], "stop", Stats(prompt_tokens=100, cached_tokens=80, ram_tokens=32, disk_tokens=16)))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsCollector(state, counters))
    text = generate_latest(registry).decode()
    for line in ('kvchat:kv_tier_bytes_used{tier="ram"} 300.0', 'kvchat:kv_tier_bytes_capacity{tier="disk"} 4000.0',
                 'kvchat:kv_tier_hits_total{tier="ram"} 7.0', 'kvchat:kv_tier_hits_total{tier="disk"} 2.0',
                 'kvchat:kv_tier_prompt_tokens_total{tier="ram"} 32.0',
                 'kvchat:kv_tier_prompt_tokens_total{tier="disk"} 16.0'):
        assert line in text


def test_a_restore_whose_own_reservation_pushes_its_blocks_out_of_ram_still_restores_them():
    """A conversation's 4 blocks in a RAM tier of 4 blocks, the pool full of another's cached
    blocks: reserving room for the restore evicts 5 of those into RAM, which pushes the very blocks
    being restored out of it. Their buffers must stay theirs until they are written back (once
    released to the next evicted block, the restore found empty blocks and computed it all)."""
    from tiny_models import as_loaded, tiny_model

    from kvchat.bench.decode import IdTokenizer
    from kvchat.core.config import Precision
    from kvchat.engine.kv.manager import Sequence
    from kvchat.engine.kv.pool import KVPool

    lm = as_loaded(tiny_model("llama"), IdTokenizer(512), name="restore-evicts")
    pool = KVPool.for_tokens(lm, 128, Precision.FP16)  # 8 blocks of 16
    one = sum(t[0].numel() * t.element_size() for t in pool.kv.layers[0].values()) * len(pool.kv.layers)
    pool.tiers.host.cap_bytes = 4 * one
    pool.blocks.on_evict = pool.tiers.evicted

    def computed(ids: list[int]) -> Sequence:
        seq = Sequence(list(ids))
        pool.manager.reserve(seq, len(seq))
        seq.num_computed = len(seq)
        pool.manager.commit(seq)
        return seq

    talk = list(range(100, 164))
    for layer in pool.kv.layers:  # rows to tell the blocks apart: nothing is computed here
        layer["k"].normal_()
    first = computed(talk)
    rows = {b.id: [layer["k"][b.id].clone() for layer in pool.kv.layers] for b in first.blocks}
    first_ids = [b.id for b in first.blocks]
    pool.manager.free(first)
    other = computed(list(range(200, 328)))  # all 8 blocks: the conversation's 4 go to RAM
    pool.manager.free(other)
    assert len(pool.tiers.host) == 4 and pool.blocks.num_reclaimable == 8
    again = Sequence(talk + [7])
    ram, _ = pool.match(again)
    assert ram == 64 and again.num_computed == 64  # restored, though pushed out of RAM meanwhile
    for i, block in enumerate(again.blocks[:4]):
        for layer, want in zip(pool.kv.layers, rows[first_ids[i]]):
            assert torch.equal(layer["k"][block.id], want)
