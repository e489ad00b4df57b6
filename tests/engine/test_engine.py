"""The engine thread on the starter model: events, cancel, stop, errors, and no leaked blocks."""
import pytest

from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.core.events import EngineError, Error, Finished, PrefillProgress, Request, TokenDelta

from tiny_models import as_loaded

HELLO = [{"role": "user", "content": "Write a long story about a dragon."}]


@pytest.fixture(scope="module")
def engine(starter):
    e = Engine(EngineConfig(max_context=256, prefill_chunk=64), loaded=as_loaded(starter.model, starter.tokenizer,
                                                                                  "starter"))
    e.wait_ready()
    yield e
    e.close()


def no_leak(engine):
    pool = engine.kvpool.blocks
    return pool.num_free == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def test_events_stream_deltas_then_finished_with_stats(engine):
    handle = engine.submit(Request(messages=HELLO, sampling=SamplingParams(max_new_tokens=12, temperature=0)))
    events = list(handle)
    prefill = [i for i, e in enumerate(events) if isinstance(e, PrefillProgress)]
    assert prefill == list(range(len(prefill))) and (events[prefill[-1]].done, events[prefill[-1]].total) == (
        len(engine.session.formatter.encode(HELLO).token_ids),) * 2  # the prompt read, then the tokens
    deltas, done = events[len(prefill):-1], events[-1]
    assert all(isinstance(e, TokenDelta) for e in deltas) and isinstance(done, Finished)
    assert "".join(d.text for d in deltas) == done.text
    assert [d.token_id for d in deltas if d.token_id >= 0] == done.token_ids
    s = done.stats
    assert (s.prompt_tokens, s.generated_tokens, done.finish_reason) == (len(engine.session.formatter.encode(HELLO).token_ids),
                                                                          12, "length")
    assert s.ttft_ms > 0 and s.decode_tok_s > 0
    assert no_leak(engine)


def test_second_identical_request_hits_the_prefix_cache(engine):
    sp = SamplingParams(max_new_tokens=4, temperature=0)
    messages = [{"role": "system", "content": "You are a careful assistant. " * 8}] + HELLO
    first = engine.submit(Request(messages=messages, sampling=sp)).result()
    second = engine.submit(Request(messages=messages, sampling=sp)).result()
    assert second.stats.cached_tokens == second.stats.prompt_tokens - 1  # all but the token whose logits are needed
    assert second.token_ids == first.token_ids


def test_stop_on_eos_is_reported_as_stop(engine):
    done = engine.generate([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=64, temperature=0)
    assert done.finish_reason == "stop"
    assert done.token_ids[-1] in engine.session.eos_ids
    assert "<|im_end|>" not in done.text


def test_stop_string_cuts_the_text(engine):
    full = engine.generate(HELLO, max_new_tokens=30, temperature=0)
    word = full.text.split()[3]
    done = engine.generate(HELLO, max_new_tokens=30, temperature=0, stop=[word])
    assert done.finish_reason == "stop"
    assert done.text == full.text[:full.text.index(word)]


def test_cancel_mid_generation_frees_blocks(engine):
    handle = engine.submit(Request(messages=HELLO, sampling=SamplingParams(max_new_tokens=200, temperature=0)))
    for event in handle:
        if isinstance(event, TokenDelta) and event.token_id >= 0:
            handle.cancel()
            break
    done = handle.result(timeout=60)
    assert done.finish_reason == "cancelled"
    assert done.stats.generated_tokens < 200
    assert no_leak(engine)


def test_cancel_before_start_does_no_work(engine):
    blocker = engine.submit(Request(messages=HELLO, sampling=SamplingParams(max_new_tokens=20, temperature=0)))
    queued = engine.submit(Request(messages=HELLO, sampling=SamplingParams(max_new_tokens=20, temperature=0)))
    queued.cancel()
    blocker.result()
    done = queued.result(timeout=60)
    assert done.finish_reason == "cancelled" and done.token_ids == []
    assert no_leak(engine)


@pytest.mark.parametrize("request_, message", [
    (Request(messages=[]), "non-empty list"),
    (Request(messages=[{"role": "user", "content": "   "}]), "no non-empty user message"),
    (Request(messages=[{"role": "user", "content": "word " * 400}]), "longer than the context"),
    (Request(prompt_ids=[1, 2, 10 ** 9]), "token ids below"),
])
def test_bad_requests_get_an_error_and_the_engine_survives(engine, request_, message):
    handle = engine.submit(request_)
    events = list(handle)
    assert len(events) == 1 and isinstance(events[0], Error) and message in events[0].message
    assert engine.alive and no_leak(engine)
    assert engine.generate(HELLO, max_new_tokens=2, temperature=0).stats.generated_tokens == 2


def test_internal_failure_is_an_error_event_and_frees_blocks(engine, monkeypatch):
    calls = {"n": 0}
    real = engine.kvpool.runner.forward

    def flaky(seq, end, want_logits):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real(seq, end, want_logits)

    monkeypatch.setattr(engine.kvpool.runner, "forward", flaky)
    with pytest.raises(EngineError, match="simulated device failure"):
        engine.generate(HELLO, max_new_tokens=10, temperature=0)
    monkeypatch.undo()
    assert engine.alive and no_leak(engine)
    assert engine.generate(HELLO, max_new_tokens=2, temperature=0).finish_reason == "length"


def test_generation_stops_at_the_context_limit(short_starter):
    engine = Engine(EngineConfig(max_context=256, prefill_chunk=64), loaded=short_starter)
    try:
        done = engine.generate(HELLO, max_new_tokens=1000, temperature=0, ignore_eos=True)
    finally:
        engine.close()
    assert done.finish_reason == "length"
    assert done.stats.prompt_tokens + done.stats.generated_tokens == 256


def test_a_broken_model_reports_its_load_error_to_every_request():
    e = Engine(EngineConfig(model="/no/such/model.gguf"))
    with pytest.raises(EngineError, match="no such model file"):
        e.wait_ready(timeout=60)
    with pytest.raises(EngineError, match="no such model file"):
        e.generate(HELLO)
    e.close()
