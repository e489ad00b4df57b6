"""The engine's parts without an engine (issue 51 step 1): the model host opens a session, the
governor turns a settings change into a new session around the same pool, and the host closes a
session; each built alone, with an outbox that records what they say."""
from kvchat.core.commands import Reconfigure
from kvchat.core.config import EngineConfig, Precision
from kvchat.core.events import Reconfigured
from kvchat.engine.governor import MemoryGovernor
from kvchat.engine.host import ModelHost
from kvchat.engine.load_order import LoadOrder
from kvchat.engine.memory_probe import ScriptedProbe
from kvchat.engine.model.loading import LoadedModel
from kvchat.engine.outbox import Outbox

GiB = 1 << 30


def recorded():
    out, said = Outbox(), []
    out.add_listener(said.append)
    return out, said


def opened(short_starter, **config):
    out, said = recorded()
    cfg = EngineConfig(**{"max_context": 512, "kv_precision": "fp16", **config})
    host = ModelHost(out, LoadOrder(), cfg, ScriptedProbe(total=8 * GiB, other=GiB), None)
    return host, host.open(cfg, LoadedModel(**vars(short_starter)), None), said


def test_the_host_opens_a_session_that_holds_what_the_load_made(short_starter):
    host, session, _ = opened(short_starter, max_context=100_000)
    trained = short_starter.model.config.max_position_embeddings
    assert session.config.max_context == trained == host.config.max_context  # capped, and the host knows it
    assert session.kvpool.precision == Precision.FP16 and session.settings()["precision"] == "fp16"
    assert session.context_limit() == trained
    assert session.weights_bytes == sum(t.numel() * t.element_size()
                                        for t in short_starter.model.state_dict().values())
    assert session.eos_ids and all(isinstance(t, int) for t in session.eos_ids)


def test_a_settings_change_is_a_new_session_around_the_same_pool_and_the_old_one_is_left_as_it_was(short_starter):
    _, session, _ = opened(short_starter)
    out, events = recorded()
    governor = MemoryGovernor(out)
    command = Reconfigure(1024, Precision.INT8, None)
    new = governor.control(session, command)
    assert new is not session and new.kvpool is session.kvpool  # rebuilt in place, not reallocated as a new pool
    assert (new.config.max_context, new.config.kv_precision, new.precision) == (1024, Precision.INT8, Precision.INT8)
    assert session.config.max_context == 512 and session.config.kv_precision == Precision.FP16
    assert command.future.result()["max_context"] == 1024
    assert [type(e) for e in events] == [Reconfigured]


def test_a_refused_settings_change_gives_back_the_session_it_was_given(short_starter):
    _, session, _ = opened(short_starter)
    out, said = recorded()
    governor = MemoryGovernor(out)
    command = Reconfigure(None, None, 64 * GiB)  # a headroom no machine here leaves room for
    assert governor.control(session, command) is session
    assert command.future.exception() is not None and session.config.headroom_bytes != 64 * GiB


def test_closing_a_session_lets_go_of_its_model_and_pool(short_starter):
    host, session, _ = opened(short_starter)
    pool = session.kvpool
    host.close(session)
    assert session.kvpool is session.loaded is session.formatter is None
    assert pool.kv.nbytes > 0  # what a caller still holds stays readable

