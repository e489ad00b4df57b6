"""The full-precision window's rows belong to the pool and each new sequence takes them over once
the last one's sequence ended: a captured CUDA graph reads them, so a new reply replays the graphs
the last one captured. While a sequence runs (a batch), a new one gets rows of its own. A window
whose rows were taken is stale: never handed to a next turn, replaced before its sequence decodes."""
import torch

from kvchat.core.config import Precision
from kvchat.core.kv_sizes import KVShape
from kvchat.engine.kv.block_pool import BlockPool
from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.convert import converted
from kvchat.engine.kv.manager import KVCacheManager, Sequence
from kvchat.engine.model.decode_step import BUCKETS, DecodeStep
from kvchat.engine.model.runner import ModelRunner

from tiny_models import tiny_model


def pool(model, precision="int4", blocks=64) -> KVCache:
    return KVCache(KVShape.from_config(model.config), blocks, 16, torch.float32, "cpu", precision)


def test_windows_take_the_pools_rows_in_turn_and_a_capture_only_borrows_them():
    kv = pool(tiny_model("llama"))
    first = kv.new_window()
    running = kv.new_window()  # while the first one's sequence runs: rows of its own
    assert running.k is not first.k and first.current and running.current
    first.released = True  # its sequence ended (KVCacheManager.free)
    second = kv.new_window()
    borrowed = kv.new_window(take=False)
    assert first.k is second.k is borrowed.k and first.v is second.v
    assert second.current and not first.current and not borrowed.current
    second.released = True
    new = converted(kv, Precision.INT8, 32)
    assert new.window_storage is kv.window_storage and new.new_window().k is first.k
    assert pool(tiny_model("llama"), "fp16").new_window() is None


def test_a_new_reply_replays_the_graphs_the_last_reply_captured(monkeypatch):
    """Captures per bucket, counted with the capture stubbed (no CUDA here): a second sequence's
    window on the same pool captures nothing; another pool captures again; buckets double."""
    model = tiny_model("llama")
    kv = pool(model)
    step = DecodeStep(model, "eager")
    captured = []
    monkeypatch.setattr(step, "_capture", lambda kv, window, position, bucket: captured.append(bucket) or ("graph", None))
    step._graph(kv, kv.new_window(), 3, 40)
    step._graph(kv, kv.new_window(), 3, 40)  # the next reply
    step._graph(kv, kv.new_window(), 33, 520)
    assert captured == [32, 64]
    other = converted(kv, Precision.INT8, 64)
    step._graph(other, other.new_window(), 3, 40)
    assert captured == [32, 64, 32]
    assert BUCKETS == (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def test_a_sequence_alone_on_its_own_rows_keeps_the_pools_graphs(monkeypatch):
    """A batch ends and its second sequence decodes alone on rows of its own (it began while the
    first ran): it captures its graphs, the pool's stay, and the next reply on the pool's rows
    replays them. Its graphs go when its rows do."""
    model = tiny_model("llama")
    kv = pool(model)
    step = DecodeStep(model, "eager")
    captured = []
    monkeypatch.setattr(step, "_capture", lambda kv, window, position, bucket: captured.append(bucket) or ("graph", None))
    first = kv.new_window()
    step._graph(kv, first, 3, 40)
    alone = kv.new_window()  # began while the first ran
    first.released = True
    step._graph(kv, alone, 3, 40)
    step._graph(kv, alone, 3, 41)
    step._graph(kv, kv.new_window(), 3, 40)  # the next reply, on the pool's rows
    assert captured == [32, 32] and len(step._graphs) == 2
    del alone
    assert len(step._graphs) == 1


def decode(runner, manager, seq, tokens) -> torch.Tensor:
    rows = []
    for token in tokens:
        seq.token_ids.append(token)
        manager.reserve(seq, len(seq))
        rows.append(runner.forward(seq, len(seq), want_logits=True))
    return torch.stack(rows)


def test_a_sequence_whose_window_was_taken_decodes_from_the_pool_not_from_the_new_rows():
    """Another sequence prefilled on the pool between two of a sequence's steps takes the rows
    (here forced: its window is marked released, as a model switch's leftovers could be); the first
    then reads its recent tokens back quantized (close to the exact result), never the other
    sequence's rows (which put it far off), and its window is not handed to a next turn."""
    model = tiny_model("llama")
    steps = (7, 11, 13, 17)
    results = {}
    for interrupted in (False, True):
        kv = pool(model)
        manager = KVCacheManager(BlockPool(64), 16, "test")
        runner = ModelRunner(model, kv, manager, "eager")
        seq = Sequence(list(range(3, 43)))
        manager.reserve(seq, len(seq))
        with torch.inference_mode():
            runner.forward(seq, len(seq), want_logits=False)
            first = decode(runner, manager, seq, steps[:2])
            if interrupted:
                stale = seq.window
                stale.released = True
                other = Sequence(list(range(100, 140)))
                manager.reserve(other, len(other))
                runner.forward(other, len(other), want_logits=False)
                assert not stale.current
            rest = decode(runner, manager, seq, steps[2:])
        results[interrupted] = torch.cat([first, rest])
        if interrupted:
            assert seq.window is not stale and seq.window.current
            manager.free(other)
            manager.free(seq, keep_tail=True)
            manager._last = (seq.token_ids[:seq.num_computed], stale)  # as if the stale one were the last
            nxt = Sequence(list(seq.token_ids))
            nxt.num_computed = seq.num_computed
            manager._hand_window(nxt)
            assert nxt.window is None
    exact, read_back = results[False], results[True]
    assert torch.equal(exact[:2], read_back[:2])
    probs = lambda x: x.log_softmax(-1)
    kl = (probs(exact).exp() * (probs(exact) - probs(read_back))).sum(-1)
    assert kl.max() < 3e-4, kl  # measured 1.3e-4; reading the other sequence's rows: 0.085


def test_a_checks_rows_taken_back_leave_the_window_as_a_plain_decode_left_it():
    """A window of 8 rows past 2 sinks: positions 0-18 written, then a check writes its own token
    (19) and four proposals (20-23), which overwrite the rows of 11-15. Kept through 20, or dropped
    whole (a failed step: its own token too), the rows it gives for every later read are those of a
    window that wrote only what was kept."""
    from kvchat.engine.kv.recent_window import RecentWindow

    gen = torch.Generator().manual_seed(0)
    rows = [(torch.randn(1, 1, 4, generator=gen), torch.randn(1, 1, 4, generator=gen)) for _ in range(24)]

    def written(upto: int) -> RecentWindow:
        window = RecentWindow(2, 1, 4, torch.float32, "cpu", size=8, sinks=2)
        for layer in range(2):
            for p in range(upto):
                window.store(layer, p, *rows[p])
        return window

    for kept_through in (21, 19):  # 21: own token and one proposal kept; 19: the step failed
        window = written(19)
        saved = window.save(19, 24)
        for layer in range(2):
            for p in range(19, 24):
                window.store(layer, p, *rows[p])
        window.restore(saved, kept_through)
        plain = written(kept_through)
        for layer in range(2):
            got, want = window.rows(layer, kept_through), plain.rows(layer, kept_through)
            assert got[:2] == want[:2] and torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
