"""Random sequences of the engine's five commands on the starter's first 4 layers; after each step:
one model, no leaked block, every future resolved, and the database consistent. The engine owns
no database: the machine keeps the conversation in the app's own Store and records each reply as
the app does (a row made before the request, updated when it ends). Few, short examples: the
suite must stay fast."""
import gc
import queue
import tempfile
import weakref
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvchat.app.store import Store
from kvchat.core.commands import Refused
from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.core.events import EngineError, Error, Finished, Request, TokenDelta
from kvchat.engine.model.loading import LoadedModel


PERSONA = "You answer in one short sentence. " * 3
QUESTIONS = ["Name a mountain.", "And a river?", "Which is longer?"]
RESOLVE_S = 60  # a step's commands end well within this on two cores; a hang fails the example


class EngineMachine(RuleBasedStateMachine):
    shared = None  # the starter, loaded once for the whole module

    def __init__(self):
        super().__init__()
        self.futures, self.models, self.closed = [], [], False
        self.engine = Engine(EngineConfig(max_context=384, prefill_chunk=64), loaded=self.copy(),
                             disk_tier=None)
        self.engine.wait_ready(RESOLVE_S)
        self.folder = tempfile.TemporaryDirectory(prefix="kvchat-machine-")
        self.store = Store(Path(self.folder.name) / "chats.db")
        self.conversation = self.store.create_conversation(persona_id=None)
        self.reply = None  # (row id, handle) of the reply under way, as the app holds it
        self.replies: dict[int, object] = {}  # row id -> the request's last event

    def copy(self) -> LoadedModel:
        loaded = LoadedModel(**vars(self.shared))
        self.models.append(weakref.ref(loaded))
        return loaded

    @initialize()
    def first_turn(self):
        """Every example starts with a reply that runs to its end, so later prompts carry one."""
        self.send(QUESTIONS[0], 4, stop_after=None)

    @rule(tokens=st.integers(1, 6), question=st.sampled_from(QUESTIONS))
    def reply(self, tokens, question):
        self.send(question, tokens, stop_after=None)

    @rule(question=st.sampled_from(QUESTIONS), stop_after=st.sampled_from([0, 2]))
    def stopped_reply(self, question, stop_after):
        """Stop before the reply starts, or after its second token (the listener runs on the
        engine thread, so the stop lands mid-reply)."""
        self.send(question, 6, stop_after)

    def send(self, question: str, tokens: int, stop_after: int | None) -> None:
        """The app's Send: the previous reply has ended (the button is disabled until then); the
        user's row, the history as the store gives it, an empty reply row marked interrupted."""
        self.record_reply()
        self.store.add_message(self.conversation, "user", question)
        history = [{"role": "system", "content": PERSONA}]
        history += [m.for_engine() for m in self.store.messages(self.conversation)]
        row = self.store.add_message(self.conversation, "assistant", "", interrupted=True)
        seen = []

        def stop_mid_reply(event):
            seen.append(event)
            if stop_after and sum(isinstance(e, TokenDelta) for e in seen) == stop_after:
                handle.cancel()

        handle = self.engine.submit(Request(messages=history, sampling=SamplingParams(
            max_new_tokens=tokens, temperature=0, ignore_eos=stop_after is not None)), listener=stop_mid_reply)
        self.reply = (row, handle)
        if stop_after == 0:
            self.futures.append(self.engine.cancel(handle))
        self.futures.append(handle.future)

    def record_reply(self) -> None:
        """The app's on_finished / on_failed: the streamed text and ids, or the reply as finished."""
        if self.reply is None:
            return
        row, handle = self.reply
        self.reply = None
        handle.future.exception(timeout=RESOLVE_S)
        text, ids, last = "", [], None
        while True:
            try:
                event = handle.events.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, TokenDelta):
                text += event.text
                ids += [event.token_id] if event.token_id >= 0 else []
            elif isinstance(event, (Finished, Error)):
                last = event
        assert last is not None, "a request ended without its last event"
        self.replies[row] = last
        if isinstance(last, Finished) and last.finish_reason != "cancelled":
            self.store.update_message(row, last.text, last.token_ids, {"finish_reason": last.finish_reason})
        else:
            self.store.update_message(row, text or (f"*Error: {last.message}*" if isinstance(last, Error) else ""),
                                      ids, interrupted=True)

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
        alive = lambda: [ref() for ref in self.models if ref() is not None]
        if alive() != [self.engine.loaded]:
            gc.collect()  # only a cycle may hold a dropped copy now: a real leak outlives it (0.2 s a call)
        assert alive() == [self.engine.loaded]
        pool = self.engine.kvpool.blocks
        assert pool.num_free == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)

    @invariant()
    def the_database_holds_every_reply_once(self):
        """Each turn is a user row and one reply row; a reply is complete or marked interrupted;
        a complete one keeps the engine's token ids, which decode to its text and which the
        next prompt's encoding carries verbatim."""
        for future in self.futures:
            future.exception(timeout=RESOLVE_S)  # resolves, whatever the order of the invariants
        self.record_reply()
        rows = self.store.messages(self.conversation)
        assert [m.position for m in rows] == list(range(len(rows)))
        assert [m.role for m in rows] == ["user", "assistant"] * (len(rows) // 2)
        assert sorted(m.id for m in rows if m.role == "assistant") == sorted(self.replies)
        tokenizer = self.shared.tokenizer
        for m in rows[1::2]:
            last = self.replies[m.id]
            complete = isinstance(last, Finished) and last.finish_reason != "cancelled"
            assert m.interrupted != complete
            if complete:
                assert m.token_ids == last.token_ids and m.content == last.text
                assert m.stats == {"finish_reason": last.finish_reason}
            if m.token_ids:  # an interrupted reply may hold back half a character's bytes
                decoded = tokenizer.decode(m.token_ids, skip_special_tokens=True)
                assert decoded == m.content if complete else decoded.startswith(m.content)
        if self.engine.session is not None and rows:
            messages = [{"role": "system", "content": PERSONA}] + [m.for_engine() for m in rows]
            encoded = self.engine.session.formatter.encode(messages, add_generation_prompt=False)
            ends = encoded.message_starts[2:] + [len(encoded.token_ids)]
            for m, start, end in zip(rows, encoded.message_starts[1:], ends):
                if m.role == "assistant" and not m.interrupted and m.token_ids:
                    assert _contains(encoded.token_ids[start:end], _without_eos(m.token_ids, self.engine.session.eos_ids))

    def teardown(self):
        self.engine.close()
        self.store.close()
        self.folder.cleanup()


def _without_eos(ids: list[int], eos: set[int]) -> list[int]:
    """A reply that ended on an end-of-turn token shares it with the template's own."""
    return ids[:-1] if ids and ids[-1] in eos else ids


def _contains(whole: list[int], part: list[int]) -> bool:
    return any(whole[i:i + len(part)] == part for i in range(len(whole) - len(part) + 1))


@pytest.fixture(scope="module")
def machine_model(short_starter):
    EngineMachine.shared = short_starter
    yield
    EngineMachine.shared = None


def test_random_command_sequences_keep_the_engine_whole(machine_model):
    run = EngineMachine.TestCase
    run.settings = settings(max_examples=20, stateful_step_count=6, deadline=None, derandomize=True,
                            suppress_health_check=list(HealthCheck))
    run("runTest").runTest()
