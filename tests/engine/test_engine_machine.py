"""Random sequences of the engine's five commands on the starter model; after each step: one
model, no leaked block, every future resolved. Few, short examples: the suite must stay fast."""
import gc
import weakref

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvchat.engine.commands import Refused
from kvchat.engine.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.events import EngineError, Request
from kvchat.engine.models import LoadedModel

from tiny_models import as_loaded

MESSAGES = [{"role": "system", "content": "You answer in one short sentence. " * 3},
            {"role": "user", "content": "Name a mountain."}]
RESOLVE_S = 60  # a step's commands end well within this on two cores; a hang fails the example


class EngineMachine(RuleBasedStateMachine):
    shared = None  # the starter, loaded once for the whole module

    def __init__(self):
        super().__init__()
        self.futures, self.models, self.closed = [], [], False
        self.engine = Engine(EngineConfig(max_context=384, prefill_chunk=64), loaded=self.copy(),
                             persona_store=None)
        self.engine.wait_ready(RESOLVE_S)

    def copy(self) -> LoadedModel:
        loaded = LoadedModel(**vars(self.shared))
        self.models.append(weakref.ref(loaded))
        return loaded

    @rule(tokens=st.integers(1, 6), cancel=st.booleans())
    def submit(self, tokens, cancel):
        handle = self.engine.submit(Request(messages=MESSAGES, sampling=SamplingParams(max_new_tokens=tokens,
                                                                                        temperature=0)))
        if cancel:
            self.futures.append(self.engine.cancel(handle))
        self.futures.append(handle.future)

    @rule(context=st.sampled_from([None, 256, 384]), precision=st.sampled_from([None, "fp16", "int8", "int4"]))
    def reconfigure(self, context, precision):
        self.futures.append(self.engine.reconfigure(max_context=context, kv_precision=precision))

    @rule(context=st.sampled_from([256, 384]), fails=st.booleans())
    def load_model(self, context, fails):
        model = "/no/such/model.gguf" if fails else "starter"
        self.futures.append(self.engine.load_model(EngineConfig(model=model, max_context=context, prefill_chunk=64),
                                                   loaded=None if fails else self.copy()))

    @precondition(lambda self: not self.closed)
    @rule()
    def shutdown(self):
        self.closed = True
        assert self.engine.close()
        self.futures.append(self.engine.shutdown())

    @invariant()
    def every_future_resolves(self):
        for future in self.futures:
            try:
                future.result(timeout=RESOLVE_S)
            except (Refused, EngineError):
                pass  # refused or failed, with a reason: resolved
        self.futures = []

    @invariant()
    def one_model_and_no_leaked_block(self):
        if self.closed or self.engine.kvpool is None:
            return
        self.engine.ready.wait(RESOLVE_S)
        gc.collect()
        alive = [ref() for ref in self.models if ref() is not None]
        assert alive == [self.engine.loaded]
        pool = self.engine.pool
        assert pool.num_free == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)

    def teardown(self):
        self.engine.close()


@pytest.fixture(scope="module")
def machine_model(starter):
    EngineMachine.shared = as_loaded(starter.model, starter.tokenizer, "starter")
    yield
    EngineMachine.shared = None


def test_random_command_sequences_keep_the_engine_whole(machine_model):
    run = EngineMachine.TestCase
    run.settings = settings(max_examples=6, stateful_step_count=6, deadline=None, derandomize=True,
                            suppress_health_check=list(HealthCheck))
    run("runTest").runTest()
