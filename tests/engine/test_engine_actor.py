"""The engine as one actor: model switches, shutdown, cancel and reconfigure on the starter's
first 4 layers, each command's future resolved whatever happens."""
import gc
import threading
import weakref

import pytest

from kvchat.engine import host as host_module
from kvchat.core.commands import Refused
from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.kv.forget import chat_blocks
from kvchat.core.events import EngineError, LoadFailed, ModelReady, Notice, Request, TokenDelta
from kvchat.engine.model.loading import load

from polling import wait_for
from tiny_models import as_loaded

STORY = [{"role": "user", "content": "Write a long story about a dragon."}]
LONG = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)


def small(**kw) -> EngineConfig:
    return EngineConfig(**{"max_context": 512, "prefill_chunk": 64, **kw})


@pytest.fixture
def engine(short_starter):
    e = Engine(small(), loaded=short_starter, disk_tier=None)
    e.wait_ready(60)
    yield e
    e.close()


@pytest.fixture
def own_engine(starter):
    """An engine on a model of its own, which nothing else holds: a switch must free it."""
    e = Engine(small(), loaded=as_loaded(starter.model, starter.tokenizer, "starter"), disk_tier=None)
    e.wait_ready(60)
    yield e
    e.close()


def events_of(e):
    seen = []
    e.add_listener(seen.append)
    return seen


def started(handle, tokens: int = 3):
    """Wait until the reply has streamed a few tokens."""
    n = 0
    for event in handle:
        if isinstance(event, TokenDelta) and event.token_id >= 0:
            n += 1
            if n == tokens:
                return


def no_leak(e):
    pool = e.kvpool.blocks
    return pool.num_free == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def greedy(e, n=6):
    return e.generate(STORY, max_new_tokens=n, temperature=0).token_ids


def test_every_command_after_shutdown_is_refused_at_once(engine):
    assert engine.close()
    futures = [engine.reconfigure(max_context=256), engine.load_model(small()), engine.shutdown(),
               engine.submit(Request(messages=STORY)).future]
    for future in futures:
        with pytest.raises(Refused, match="shut down"):
            future.result(timeout=1)
    assert list(engine.submit(Request(messages=STORY)))[-1].message == "the engine is shut down"


@pytest.mark.parametrize("max_running", [1, 2])
def test_quit_mid_reply_returns_within_two_seconds_with_the_partial_reply(short_starter, max_running):
    """Replies running end cancelled with what they had; a request still waiting is refused."""
    engine = Engine(small(max_running=max_running), loaded=short_starter, disk_tier=None)
    engine.wait_ready(60)
    running = [engine.submit(Request(messages=STORY, sampling=LONG)) for _ in range(max_running)]
    queued = engine.submit(Request(messages=STORY, sampling=LONG))
    for handle in running:
        started(handle)
    assert engine.close()  # its thread ended within close()'s two seconds
    for handle in running:
        done = handle.future.result(timeout=1)
        assert done.finish_reason == "cancelled" and 3 <= len(done.token_ids) < 400 and done.text
    with pytest.raises(EngineError, match="shut"):
        queued.future.result(timeout=1)


def test_switch_during_a_reply_cancels_it_and_frees_the_old_model(own_engine, starter):
    engine = own_engine
    old = weakref.ref(engine.loaded.model)
    handle = engine.submit(Request(messages=STORY, sampling=LONG))
    started(handle)
    settings = engine.load_model(small(kv_precision="int8")).result(timeout=120)
    assert handle.future.result(timeout=1).finish_reason == "cancelled"
    assert settings["model"] == "starter" and settings["precision"] == "int8"
    gc.collect()
    assert old() is None  # only ever one model
    assert engine.loaded.model is not starter.model and len(greedy(engine)) == 6 and no_leak(engine)


def test_a_second_switch_replaces_a_load_under_way(engine, monkeypatch):
    gate, entered, loads = threading.Event(), threading.Event(), []

    def slow_load(spec, *args, **kwargs):
        loads.append(spec)
        entered.set()
        gate.wait(30)
        return load(spec, *args, **kwargs)

    monkeypatch.setattr(host_module, "load", slow_load)
    seen = events_of(engine)
    first = engine.load_model(small(max_context=256))
    assert entered.wait(30)
    second = engine.load_model(small(max_context=384))
    gate.set()
    with pytest.raises(Refused, match="replaced"):
        first.result(timeout=120)
    assert second.result(timeout=120)["max_context"] == 384
    assert loads == ["starter", "starter"]
    assert [type(x) for x in seen if isinstance(x, (ModelReady, LoadFailed))] == [ModelReady]
    assert engine.ready.is_set() and engine.config.max_context == 384 and len(greedy(engine)) == 6


def test_two_switches_in_a_row_keep_one_model(engine):
    models = []
    for context in (256, 384):
        engine.load_model(small(max_context=context)).result(timeout=120)
        models.append(weakref.ref(engine.loaded.model))
    gc.collect()
    assert models[0]() is None and models[1]() is engine.loaded.model
    assert engine.config.max_context == 384 and len(greedy(engine)) == 6 and no_leak(engine)


def test_a_failed_switch_brings_the_previous_model_back(engine):
    before = greedy(engine)
    seen = events_of(engine)
    with pytest.raises(EngineError, match="no such model file.*the previous model is back"):
        engine.load_model(small(model="/no/such/model.gguf")).result(timeout=120)
    failed = [x for x in seen if isinstance(x, LoadFailed)]
    assert len(failed) == 1 and failed[0].restored and failed[0].settings["model"] == "starter"
    assert engine.config.model == "starter" and engine.load_error is None
    assert greedy(engine) == before


def test_a_cancelled_load_brings_the_previous_model_back(engine, monkeypatch):
    gate = threading.Event()

    def slow_load(spec, *args, **kwargs):
        gate.wait(30)
        return load(spec, *args, **kwargs)

    monkeypatch.setattr(host_module, "load", slow_load)
    future = engine.load_model(small(max_context=256))
    engine.cancel_load()
    gate.set()
    with pytest.raises(EngineError, match="loading cancelled; the previous model is back"):
        future.result(timeout=120)
    assert engine.config.max_context == 512 and len(greedy(engine)) == 6


def test_reconfigure_while_a_load_is_queued_applies_to_the_new_model(engine):
    load = engine.load_model(small(max_context=256))
    change = engine.reconfigure(kv_precision="int4")
    assert load.result(timeout=120)["max_context"] == 256
    assert change.result(timeout=60)["kv_precision"] == "int4" and engine.session.precision.value == "int4"


def test_cancel_resolves_and_stops_the_request(engine):
    handle = engine.submit(Request(messages=STORY, sampling=LONG))
    started(handle)
    assert engine.cancel(handle).result(timeout=10) is True
    assert handle.future.result(timeout=10).finish_reason == "cancelled" and no_leak(engine)


def test_a_context_past_the_trained_length_is_capped_and_said(short_starter):
    from kvchat.engine.memory_probe import ScriptedProbe

    e = Engine(EngineConfig(max_context=100_000), loaded=short_starter,
               disk_tier=None, probe=ScriptedProbe(total=64 << 30))  # plenty: only the cap may limit
    seen = events_of(e)
    e.wait_ready(60)
    trained = short_starter.model.config.max_position_embeddings
    assert e.config.max_context == trained and e.session.context_limit() == trained
    assert e.kvpool.budget <= trained * 1.25 * e.kvpool.bytes_per_token() + 1
    assert any(isinstance(x, Notice) and "capped" in x.message for x in seen)
    huge = EngineConfig(max_context=10 ** 12, allow_long_context=True, kv_precision="fp16")
    with pytest.raises(EngineError, match="KV cache.*the previous model is back"):
        e.load_model(huge, loaded=e.loaded).result(timeout=60)
    assert e.config.max_context == trained
    e.close()


PERSONA = [{"role": "system", "content": "You are a calm travel guide for the Alps. " * 6},
           {"role": "user", "content": "Where should I hike?"}]


def fail_on_call(n: int, real):
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory (injected)")
        return real(*args, **kwargs)

    return failing


@pytest.mark.parametrize("stage", ["calibration", "allocation", "conversion"])
def test_a_rebuild_failing_at_any_stage_leaves_pool_and_config_as_they_were(engine, monkeypatch, stage):
    from kvchat.engine.kv import pool as kv_pool
    from kvchat.kernels import quant

    first = engine.generate(PERSONA, max_new_tokens=8, temperature=0)
    config, kv, blocks = engine.config, engine.kvpool.kv, engine.kvpool.blocks.num_blocks
    target = {"calibration": (kv_pool, "calibrate", 1), "allocation": (quant, "layer_tensors", 3),
              "conversion": (quant, "write", 3)}[stage]
    module, name, nth = target
    monkeypatch.setattr(module, name, fail_on_call(nth, getattr(module, name)))
    seen = events_of(engine)
    with pytest.raises(EngineError, match="could not be rebuilt.*unchanged"):
        engine.reconfigure(max_context=256, kv_precision="int8").result(timeout=60)
    monkeypatch.undo()
    assert any(isinstance(x, Notice) and "unchanged" in x.message for x in seen)
    assert engine.config == config and engine.kvpool.kv is kv and engine.kvpool.blocks.num_blocks == blocks
    assert engine.session.precision.value == "fp16" and all(t is not None for t in kv.layers)
    again = engine.generate(PERSONA, max_new_tokens=8, temperature=0)
    assert again.token_ids == first.token_ids and again.stats.cached_tokens > 0 and no_leak(engine)
    assert engine.reconfigure(max_context=256, kv_precision="int8").result(timeout=60)["kv_precision"] == "int8"


def test_a_shrink_that_cannot_fit_next_to_the_old_pool_is_refused_with_the_figure(short_starter):
    from kvchat.engine.memory_probe import ScriptedProbe

    gib = 1 << 30
    probe = ScriptedProbe(total=8 * gib)
    e = Engine(small(kv_precision="auto", headroom_bytes=0), loaded=short_starter,
               disk_tier=None, probe=probe)
    e.wait_ready(60)
    seen = events_of(e)
    kv, budget = e.kvpool.kv, e.kvpool.budget
    probe._own = e.session.weights_bytes + e.session.activations + kv.nbytes
    probe.other = 8 * gib - probe._own + budget // 2  # the pool must halve, and nothing is free to build it in
    assert wait_for(lambda: any(isinstance(x, Notice) for x in seen))
    notice = next(x for x in seen if isinstance(x, Notice))
    assert notice.kind == "pressure" and "MiB are free" in notice.message
    assert e.kvpool.kv is kv and e.kvpool.budget == budget
    e.close()


def test_the_persona_badges_question_is_answered_on_the_engine_thread(engine, monkeypatch):
    """The badge asked from a thread of its own and read the pool's dicts there, mid-rebuild too;
    now the engine thread answers, between requests."""
    from kvchat.engine import engine as engine_module

    threads = []
    answer = engine_module.answer_persona_query
    monkeypatch.setattr(engine_module, "answer_persona_query",
                        lambda e, command: threads.append(threading.current_thread().name) or answer(e, command))
    persona = "You are Marlowe, a patient reference librarian in a small harbour town. Answer in full sentences."
    assert engine.persona_state(persona, 30) == "cold"
    engine.generate([{"role": "system", "content": persona}, {"role": "user", "content": "Hello"}],
                    max_new_tokens=2, temperature=0)
    assert engine.persona_state(persona, 30) == "warm"
    assert engine.persona_state("Be brief.", 30) == "short"
    assert threads == ["kvchat-engine"] * 3


def test_a_persona_question_while_a_reply_runs_is_answered_at_once_and_holds_no_request_back(engine):
    """The app asks each time a chat opens. Held until no reply ran, the question made a message
    sent after it, in another chat, wait for every running reply to end."""
    persona = "You are Marlowe, a patient reference librarian in a small harbour town. Answer in full sentences."
    long = engine.submit(Request(messages=STORY, sampling=LONG))
    started(long)
    assert engine.persona_state(persona, 30) == "cold"
    second = engine.submit(Request(messages=[{"role": "user", "content": "Hello"}], sampling=SamplingParams(
        max_new_tokens=4, temperature=0, ignore_eos=True)))
    assert len(second.result(timeout=60).token_ids) == 4
    assert not long.future.done(), "the long reply ended first: the question held the next request back"
    engine.cancel(long)


LIGHTHOUSES = [{"role": "user", "content": "Tell me about the lighthouses of the northern coast: who kept them, how "
                "their lamps were lit, and why so many of them were built on bare rock. Then tell me which of "
                "them still stand, which can be visited, and what a keeper's ordinary day was like in the long "
                "winters, when the supply boats could not land for weeks."}]


def lighthouse_chat(e) -> tuple[list[dict], callable]:
    """The chat, answered, and how many of its blocks the pool has cached."""
    done = e.generate(LIGHTHOUSES, max_new_tokens=8, temperature=0)
    chat = LIGHTHOUSES + [{"role": "assistant", "content": done.text, "token_ids": done.token_ids}]
    hashes = chat_blocks(e.session.formatter, e.kvpool.manager, chat)[1]
    return chat, lambda: sum(h in e.kvpool.blocks.cached for h in hashes)


def test_deleting_a_chat_while_another_replies_is_done_at_once_but_waits_for_a_reply_using_its_blocks(engine):
    """Held until no reply ran, a deleted chat's Forget made every later message wait. It waits now
    only for a reply that holds the chat's blocks: dropped under it, they would come back as it ends."""
    chat, cached = lighthouse_chat(engine)
    assert cached() >= 3
    long = engine.submit(Request(messages=STORY, sampling=LONG))
    started(long)
    assert engine.forget(chat).result(timeout=60) >= 3
    assert cached() == 0
    assert not long.future.done(), "the long reply ended first: the Forget waited for it"
    engine.cancel(long).result(timeout=60)

    running = engine.submit(Request(messages=LIGHTHOUSES, sampling=LONG))  # its prompt's blocks are the chat's
    started(running)
    in_use = engine.forget(LIGHTHOUSES)
    started(running, 5)  # several steps later
    assert not in_use.done()
    assert cached() >= 3
    engine.cancel(running)
    assert in_use.result(timeout=60) >= 3
    assert cached() == 0


def test_a_deleted_chats_forget_waits_for_a_queued_request_that_continues_the_chat(short_starter):
    """A request waiting its turn holds no block yet, but computes the chat's again when it runs."""
    e = Engine(small(max_running=1), loaded=short_starter, disk_tier=None)
    try:
        e.wait_ready(60)
        chat, cached = lighthouse_chat(e)
        long = e.submit(Request(messages=STORY, sampling=LONG))
        started(long)
        queued = e.submit(Request(messages=chat + [{"role": "user", "content": "And the keepers?"}],
                                  sampling=SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)))
        gone = e.forget(chat)
        started(long, 5)
        assert not gone.done() and not queued.future.done()
        e.cancel(long)
        assert len(queued.result(timeout=60).token_ids) == 4
        assert gone.result(timeout=60) >= 3
        assert cached() == 0
    finally:
        e.close()
