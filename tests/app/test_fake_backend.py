"""The fake backend (tests/support) against the real engine on the starter: the same commands give
the same events in the same order, with the same settings, from a thread of their own; so a GUI
test on the fake sees what the window would see on the engine."""
import threading

import pytest

from kvchat.core.backend import Backend
from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.core.events import Finished, LoadFailed, ModelReady, Notice, PrefillProgress, Refused, Request, TokenDelta
from kvchat.core.memory import MemorySnapshot

from kvchat.app.views.top_bar import model_name

from support.fake_backend import FakeBackend
from support.fake_model import STARTER_CONFIG, STARTER_LABEL

HELLO = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello"}]


def script(backend) -> dict:
    """One session of commands, and what came back: the listener's events (not the memory snapshots,
    which the engine gives about once a second), each request's events, the futures' answers."""
    said, threads = [], set()

    def listen(event):
        if said:  # the first may be the replay, given on the caller's thread when the load has ended
            threads.add(threading.get_ident())
        if not isinstance(event, MemorySnapshot):
            said.append(event)

    backend.add_listener(listen, replay=True)
    backend.wait_ready(60)
    out = {"ready": said[0]}
    handle = backend.submit(Request(messages=HELLO, sampling=SamplingParams(max_new_tokens=4, temperature=0,
                                                                             ignore_eos=True)))
    out["request"] = list(handle)
    stopped = backend.submit(Request(messages=HELLO, sampling=SamplingParams(max_new_tokens=400, ignore_eos=True)))
    backend.cancel(stopped).result(30)
    out["stopped"] = list(stopped)
    out["reconfigured"] = backend.reconfigure(max_context=1024, kv_precision="int8").result(60)
    out["capped"] = backend.reconfigure(max_context=100_000).result(60)
    failed = backend.load_model(EngineConfig(model="/no/such/model.gguf", max_context=512))
    out["failed"] = pytest.raises(Exception, failed.result, 60).value
    out["back"] = backend.submit(Request(messages=HELLO, sampling=SamplingParams(max_new_tokens=2))).result(60)
    assert backend.close()
    out["closed"] = pytest.raises(Refused, backend.reconfigure(max_context=512).result, 10).value
    out["said"], out["threads"] = said, threads
    return out


def test_the_fake_gives_the_engines_events_in_the_engines_order(engine_model):
    from kvchat.engine.engine import Engine
    from kvchat.engine.model.loading import LoadedModel

    engine = Engine(EngineConfig(max_context=512), loaded=LoadedModel(**vars(engine_model)), disk_tier=None)
    real, fake = script(engine), script(FakeBackend(EngineConfig(max_context=512)))
    assert isinstance(FakeBackend(EngineConfig()), Backend)
    for got in (real, fake):
        assert isinstance(got["ready"], ModelReady) and threading.get_ident() not in got["threads"]
        # the prompt's prefill (one chunk on both), then the reply
        assert [type(e) for e in got["request"]] == [PrefillProgress] * 2 + [TokenDelta] * 4 + [Finished]
        prompt = got["request"][-1].stats.prompt_tokens
        assert [(e.done, e.total) for e in got["request"][:2]] == [(0, prompt), (prompt, prompt)]
        assert got["request"][-1].finish_reason == "length" and got["request"][-1].stats.generated_tokens == 4
        assert isinstance(got["stopped"][-1], Finished) and got["stopped"][-1].finish_reason == "cancelled"
        assert got["capped"]["max_context"] == 8192  # the starter's trained context
        assert str(got["failed"]).endswith("; the previous model is back") and "no such model file" in str(got["failed"])
        assert got["back"].text
        assert "shut down" in str(got["closed"])
        kinds = [(type(e).__name__, getattr(e, "kind", None)) for e in got["said"]]
        assert kinds == [("ModelReady", None), ("Reconfigured", None), ("Notice", "context"), ("Reconfigured", None),
                         ("LoadFailed", None)], kinds
    # the suite's engine model is named "starter", the one loaded from disk as the fake names it
    assert model_name(real["ready"].label) == model_name(fake["ready"].label) == model_name(STARTER_LABEL)
    assert real["ready"].settings.keys() == fake["ready"].settings.keys()
    assert {k: v for k, v in real["ready"].generation.items() if k != "transformers_version"} == fake["ready"].generation
    assert {k: getattr(real["ready"].model_config, k) for k in STARTER_CONFIG} == STARTER_CONFIG
    assert real["reconfigured"] == {**fake["reconfigured"], "kv_budget": real["reconfigured"]["kv_budget"],
                                    "decode": real["reconfigured"]["decode"]}
    real_failed, fake_failed = (g["said"][-1] for g in (real, fake))
    assert isinstance(fake_failed, LoadFailed) and real_failed.message == fake_failed.message
    assert real_failed.settings.keys() == fake_failed.settings.keys()
    assert [type(e) for e in fake["said"]].count(Notice) == 1
