"""The compiled (CPU) and captured (CUDA) decode step against the eager one: same logits within
1e-4 in fp32, same greedy tokens, in every KV precision and across a downshift."""
import copy
import threading

import pytest
import torch

from kvchat.engine.model.attention import StepMeta, running
from kvchat.bench.decode import IdTokenizer
from kvchat.core.config import EngineConfig, Precision, SamplingParams
from kvchat.engine.model.decode_step import DecodeStep, PinnedCopy
from kvchat.engine.engine import Engine
from kvchat.core.events import Notice, Request, TokenDelta
from kvchat.engine.kv.manager import Sequence
from kvchat.engine.kv.pool import KVPool
from kvchat.engine.model.runner import ModelRunner

from polling import wait_for
from tiny_models import ARCHS, as_loaded, tiny_model

pytestmark = pytest.mark.gpu  # runs on CUDA where there is one: make gpu-check's kernel step

TOL = 1e-4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request):
    lm = as_loaded(tiny_model(request.param), IdTokenizer(512), request.param)
    lm.model.to(DEVICE)
    lm.device = torch.device(DEVICE)
    return lm


def decode(lm, mode: str, precision: str, prompt: list[int], steps: int, downshift_at: int | None = None):
    """Greedy tokens and the logits of each step, through a pool of ``precision``."""
    pool = KVPool.for_tokens(lm, len(prompt) + steps + 1, Precision(precision))
    pool.runner = ModelRunner(lm.model, pool.kv, pool.manager, mode)
    if mode == "compiled":
        compiled_now(lm)
    seq = Sequence(list(prompt))
    pool.manager.reserve(seq, len(prompt))
    logits = pool.runner.forward(seq, len(prompt), want_logits=True)
    tokens, rows = [], []
    for i in range(steps):
        if i == downshift_at:
            assert pool.rebuild(Precision.INT8, pool.budget, [seq])
        token = int(logits.argmax())
        tokens.append(token)
        seq.token_ids.append(token)
        pool.manager.reserve(seq, len(seq))
        logits = pool.runner.forward(seq, len(seq), want_logits=True)
        rows.append(logits.cpu())
    return tokens, torch.stack(rows), pool.runner.step


def compiled_now(lm) -> None:
    """The model's compiled step ready for both kinds of pool (a downshift crosses from one to the
    other), so that every step after it runs compiled; the engine compiles them in the background."""
    step = ModelRunner(lm.model, KVPool.for_tokens(lm, 64, Precision.FP16).kv, None, "compiled").step
    for precision in (Precision.FP16, Precision.INT4):
        step.prepare(KVPool.for_tokens(lm, 64, precision).kv)
    assert step.background.wait(900) and step.fallback is None, step.fallback


def prompt_ids(n=40, vocab=512, seed=0):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_decode_forward_traces_without_a_graph_break(tiny):
    pool = KVPool.for_tokens(tiny, 64, Precision.INT4)
    step = ModelRunner(tiny.model, pool.kv, pool.manager, "eager").step
    seq = Sequence(prompt_ids(20))
    pool.manager.reserve(seq, 21)
    meta = StepMeta(kv=pool.kv, slots=torch.tensor([20], device=DEVICE), block_table=torch.tensor(
        [b.id for b in seq.blocks], dtype=torch.int32, device=DEVICE), context_len=21,
        window=pool.kv.new_window())
    with running(meta), torch.inference_mode():
        explained = torch._dynamo.explain(step.forward)(step.ids, step.positions)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_the_cpu_decode_forward_with_traced_attention_has_no_graph_break(tiny):
    """The CPU's compiled step passes the step's tensors down to attention instead of the op."""
    pool = KVPool.for_tokens(tiny, 64, Precision.FP16)
    step = ModelRunner(tiny.model, pool.kv, pool.manager, "eager").step
    seq = Sequence(prompt_ids(20))
    pool.manager.reserve(seq, 21)
    with torch.inference_mode():
        inputs = step.traced_inputs(pool.kv, [b.id for b in seq.blocks])
        explained = torch._dynamo.explain(step.forward)(step.ids, step.positions, inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("precision", ["fp16", "int8", "fp8", "k8v4", "int4"])
def test_compiled_decode_equals_eager(tiny, precision):
    prompt = prompt_ids()
    want_tokens, want, _ = decode(tiny, "eager", precision, prompt, 64)
    replays = tiny.model.__dict__.get("_kvchat_decode_steps", {}).get("compiled")
    replays = replays.replays if replays else 0
    got_tokens, got, step = decode(tiny, "compiled", precision, prompt, 64)
    assert step.fallback is None and step.captured
    assert step.replays - replays == 64  # every step ran the compiled or captured graph, none eagerly
    assert got_tokens == want_tokens
    assert (got - want).abs().max().item() <= TOL


def test_compiled_decode_equals_eager_across_a_downshift(tiny):
    prompt = prompt_ids(seed=3)
    want_tokens, want, _ = decode(tiny, "eager", "fp16", prompt, 64, downshift_at=20)
    got_tokens, got, _ = decode(tiny, "compiled", "fp16", prompt, 64, downshift_at=20)
    assert got_tokens == want_tokens
    assert (got - want).abs().max().item() <= TOL


@pytest.fixture(scope="module")
def own_starter(starter):
    """A copy (runners switch a model's attention to kvchat's, and other tests call the session's
    starter through transformers' own) cut to its first 4 of 30 layers: the starter's shapes (9
    query heads over 3 KV heads, head_dim 64), weights and vocabulary, at a seventh of the compile
    (all 30 layers: 55 s from the disk cache, 145 s cold, in every run of the suite)."""
    lm = copy.copy(starter)
    lm.model = copy.deepcopy(starter.model)
    lm.model.model.layers = lm.model.model.layers[:4]
    lm.model.config.num_hidden_layers = 4
    return lm


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_compiled_decode_equals_eager_on_the_starter(own_starter, precision):
    lm = own_starter
    prompt = lm.tokenizer("The lighthouse keeper wrote in his log that the storm", add_special_tokens=False)["input_ids"]
    want_tokens, want, _ = decode(lm, "eager", precision, prompt, 64)
    got_tokens, got, step = decode(lm, "compiled", precision, prompt, 64)
    assert step.fallback is None
    assert got_tokens == want_tokens
    assert (got - want).abs().max().item() <= TOL


def test_steps_of_two_models_compiled_one_after_the_other_keep_their_own_code():
    """Every step's forward is the same code object and the weights are not guarded: without
    isolation the second model would run the first one's compiled graph."""
    prompt = prompt_ids(seed=5)
    for arch in ("llama", "qwen3"):
        lm = as_loaded(tiny_model(arch, seed=7), IdTokenizer(512), arch)
        lm.model.to(DEVICE)
        lm.device = torch.device(DEVICE)
        want_tokens, want, _ = decode(lm, "eager", "fp16", prompt, 8)
        got_tokens, got, step = decode(lm, "compiled", "fp16", prompt, 8)
        assert step.fallback is None and got_tokens == want_tokens, arch
        assert (got - want).abs().max().item() <= TOL, arch


def test_a_step_that_cannot_compile_falls_back_to_eager_and_says_so_once(starter, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    lm = copy.copy(starter)
    lm.model = copy.deepcopy(starter.model)  # a fresh step, not one another test compiled
    engine = Engine(EngineConfig(decode="compiled", max_context=512), loaded=lm, disk_tier=None)
    notices = []
    engine.add_listener(lambda e: notices.append(e) if isinstance(e, Notice) else None)
    engine.wait_ready(60)
    hello = [{"role": "user", "content": "Hello"}]
    first = engine.generate(hello, max_new_tokens=8, temperature=0)
    second = engine.generate(hello, max_new_tokens=8, temperature=0)
    assert wait_for(lambda: len(notices) == 2)  # the failure is told between tokens or in an idle second
    engine.close()
    assert first.token_ids == second.token_ids and len(first.token_ids) == 8
    assert [n.kind for n in notices] == ["warm-up", "eager"]  # preparing, then why not: no "ready"
    assert "preparing fast decoding" in notices[0].message and "no C++ compiler found" in notices[1].message


def held_compiles(monkeypatch) -> threading.Event:
    """Background compiles wait for the returned event before they start."""
    gate = threading.Event()
    compile_now = DecodeStep._compile

    def held(step, kind, layers):
        assert gate.wait(120)
        compile_now(step, kind, layers)

    monkeypatch.setattr(DecodeStep, "_compile", held)
    return gate


@pytest.fixture
def compiled_on():
    """The thread of every compile dynamo starts while the test runs."""
    threads = []
    on_start = lambda args: threads.append(threading.current_thread().name)
    torch._dynamo.callback.callback_handler.register_start_callback(on_start)
    yield threads
    torch._dynamo.callback.callback_handler.remove_start_callback(on_start)


@pytest.mark.slow
@pytest.mark.skipif(DEVICE == "cuda", reason="CUDA captures on the engine thread: no background compile")
def test_a_reply_starts_eagerly_while_the_step_compiles_and_moves_to_it_between_two_tokens(monkeypatch, compiled_on):
    """The first reply of a first start no longer waits for the compile (90-350 s a new user saw):
    its first token comes before the compile starts (they share the GIL), it decodes eagerly, and from the token after the compile ends it runs compiled, with the same
    greedy tokens as a reply decoded eagerly throughout; the switch is said once. A context change
    then needs no compile (the pool's size is a dynamic dimension; every compile dynamo starts is
    on the compile thread, none on the engine's),
    and a quantized precision compiles its own graph in the background again."""
    prompt = prompt_ids(30, seed=9)
    sampling = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    eager = Engine(EngineConfig(decode="eager", max_context=256, kv_precision="fp16"),
                   loaded=as_loaded(tiny_model("llama", seed=11), IdTokenizer(512), "llama"), disk_tier=None)
    want = eager.submit(Request(prompt_ids=prompt, sampling=sampling)).result()
    assert eager.close()

    gate = held_compiles(monkeypatch)
    lm = as_loaded(tiny_model("llama", seed=11), IdTokenizer(512), "llama")
    engine = Engine(EngineConfig(decode="compiled", max_context=256, kv_precision="fp16"), loaded=lm,
                    disk_tier=None)
    notices = []
    engine.add_listener(lambda e: notices.append(e.message) if isinstance(e, Notice) and e.kind == "warm-up" else None)
    engine.wait_ready(60)
    step = engine.kvpool.runner.step
    events = []

    def listener(event):  # on the engine thread, between two tokens
        events.append(event)
        if sum(isinstance(e, TokenDelta) for e in events) == 4 and not gate.is_set():
            gate.set()
            assert step.background.wait(600)

    got = engine.submit(Request(prompt_ids=prompt, sampling=sampling), listener).result()
    assert got.token_ids == want.token_ids
    assert step.replays == 20  # 23 decode steps: the 3 before the compile ended eager, the rest compiled
    assert len(notices) == 2 and notices[0].startswith("preparing fast decoding")
    deltas = [i for i, e in enumerate(events) if isinstance(e, TokenDelta)]
    told = [i for i, e in enumerate(events) if isinstance(e, Notice)]
    assert len(told) == 2 and deltas[0] < told[0] < deltas[1]  # the compile starts after the first token
    ready = told[1:]
    assert deltas[3] < ready[0] < deltas[4]  # said once, where the switch is
    assert events[ready[0]].message == notices[1] and notices[1].startswith("fast decoding ready")

    assert engine.reconfigure(max_context=128).result(60)["max_context"] == 128
    again = engine.submit(Request(prompt_ids=prompt, sampling=sampling)).result()
    cached_to_last = again.stats.cached_tokens == len(prompt) - 1  # the prompt's last token is then a decode step
    assert again.token_ids == want.token_ids and step.replays == 20 + 23 + cached_to_last

    engine.reconfigure(kv_precision="int8").result(60)
    assert wait_for(lambda: len(notices) == 4, timeout=600)
    assert notices[2].startswith("preparing fast decoding") and notices[3].startswith("fast decoding ready")
    replays = step.replays
    third = engine.submit(Request(prompt_ids=prompt, sampling=sampling)).result()
    assert step.replays - replays == 23 + (third.stats.cached_tokens == len(prompt) - 1)
    assert engine.close()
    assert compiled_on and set(compiled_on) == {"kvchat-compile"}, compiled_on


def test_the_step_block_table_holds_exactly_the_ids_it_was_given():
    """Only changed ids are written: growing by a block, a new sequence, a block moved mid-table,
    a shorter table, and growth past the buffer (which then doubles)."""
    step = DecodeStep(tiny_model("llama"), "eager")
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(500, generator=g)[:3].tolist()
    for change in range(120):
        if change == 40:
            ids = torch.randperm(500, generator=g)[:len(ids)].tolist()  # another sequence
        elif change % 13 == 5:
            ids[len(ids) // 2] = 999  # a moved block
        elif change == 60:
            ids = ids[:len(ids) // 2]  # shorter
        else:
            ids = ids + [int(torch.randint(500, (1,), generator=g))]
        assert step._device_table(ids).tolist() == ids, change
    assert len(ids) > 64  # past the first buffer


def test_the_window_bounds_go_through_two_pinned_buffers_in_turn(monkeypatch):
    """A captured step copies the window's bounds from pinned memory without waiting; the buffer
    it rewrites is the one whose copy was recorded two steps before, and it waits for that copy's
    event first, never for the one just queued."""
    from unittest import mock

    events = []

    class Event:
        def __init__(self):
            self.synced = 0
            events.append(self)

        def record(self):
            pass

        def synchronize(self):
            self.synced += 1

    monkeypatch.setattr(torch.cuda, "Event", Event)
    target = torch.full((3,), -1, dtype=torch.int32)
    buffers = []
    real = target.copy_
    wrapped = mock.Mock(wraps=target)
    wrapped.copy_.side_effect = lambda src, non_blocking=False: (buffers.append(src), real(src))[1]
    bounds = PinnedCopy(target)
    bounds.target = wrapped
    for n in range(4):
        bounds.copy((n, 10 + n, 20 + n))
    assert target.tolist() == [3, 13, 23]
    assert buffers[0] is buffers[2] and buffers[1] is buffers[3] and buffers[0] is not buffers[1]
    assert len(events) == 2 and [e.synced for e in events] == [1, 1]  # steps 3 and 4 waited on 1 and 2


class CaptureStub:
    """``DecodeStep._capture`` as CUDA would run it: fails as often as told, then gives a graph."""

    def __init__(self, failures: int):
        self.failures, self.buckets = failures, []

    def __call__(self, kv, window, position, bucket):
        self.buckets.append(bucket)
        if self.failures:
            self.failures -= 1
            raise RuntimeError("CUDA error: out of memory\nmore lines")
        return ("graph", bucket), torch.zeros(1, 8)


def cuda_like_step(monkeypatch, failures: int) -> tuple[DecodeStep, CaptureStub]:
    step = DecodeStep(tiny_model("llama"), "compiled")
    step.fallback = None  # CUDA compiles nothing on the CPU's side: captured, as on a GPU
    capture = CaptureStub(failures)
    monkeypatch.setattr(step, "_capture", capture)
    monkeypatch.setattr(step, "device", torch.device("cuda"))  # warm_up's guard; no tensor is made
    return step, capture


class NoWindowPool:
    def new_window(self, take=True):
        return None


def test_a_failed_capture_decodes_eagerly_until_idle_then_is_tried_once_more(monkeypatch):
    step, capture = cuda_like_step(monkeypatch, failures=1)
    kv = NoWindowPool()
    assert step._graph(kv, None, 20, 0) is None  # 20 blocks: the bucket of 32
    assert step.capture_failed == "RuntimeError: CUDA error: out of memory" and step.fallback is None
    assert step._graph(kv, None, 20, 0) is None and capture.buckets == [32]  # not again during the reply
    assert step.retry_capture(kv) == "RuntimeError: CUDA error: out of memory"
    assert capture.buckets == [32, 32]  # the bucket that failed, captured in the idle moment
    assert step._graph(kv, None, 20, 0)[0] == ("graph", 32) and step.captured
    assert step.retry_capture(kv) is None  # nothing left to retry


def test_a_capture_that_fails_twice_falls_back_for_good_and_says_why(monkeypatch):
    step, capture = cuda_like_step(monkeypatch, failures=2)
    kv = NoWindowPool()
    assert step._graph(kv, None, 100, 0) is None and step.captured  # the bucket of 128
    step.retry_capture(kv)
    assert not step.captured and "out of memory" in step.fallback  # the host tells it once
    assert step.retry_capture(kv) is None and capture.buckets == [128, 128]
