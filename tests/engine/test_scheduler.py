"""Several requests at once on the starter's first 4 layers: they decode together, each as it
would alone; a cancel ends only its own; a pool too small for all of them makes one wait or
preempts the newest, and every reply still comes out as it would alone; two requests with the
same persona share its blocks; commands that change the pool wait for the replies to end."""
import pytest

from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.core.events import Finished, Request, TokenDelta
from kvchat.engine.engine import Engine

QUESTIONS = ["Name three rivers of Europe.", "What is a prime number?", "Write a haiku about rain.",
             "List four fruits."]
PERSONA = {"role": "system", "content": "You are Ada, a patient tutor of mathematics. " * 6}


def greedy(n: int = 24) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def ask(question: str, persona: bool = False) -> list[dict]:
    return ([PERSONA] if persona else []) + [{"role": "user", "content": question}]


def engine(lm, **kw) -> Engine:
    e = Engine(EngineConfig(**{"max_context": 512, "prefill_chunk": 64, "decode": "eager", **kw}), loaded=lm,
               disk_tier=None)
    e.wait_ready(60)
    return e


def one_by_one(lm, questions, n: int = 24, **kw) -> list[Finished]:
    e = engine(lm, max_running=1, **kw)
    try:
        return [e.submit(Request(messages=ask(q), sampling=greedy(n))).result() for q in questions]
    finally:
        e.close()


def no_leak(e: Engine) -> bool:
    pool = e.kvpool.blocks
    return pool.num_free == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


@pytest.fixture(scope="module")
def alone(short_starter):
    return one_by_one(short_starter, QUESTIONS)


def send_all(e: Engine, seen: type) -> tuple[list[Finished], list[int]]:
    """Every question at once: the replies, and which request each ``seen`` event came from."""
    order = []
    handles = [e.submit(Request(messages=ask(q), sampling=greedy()),
                        listener=lambda ev, i=i: isinstance(ev, seen) and order.append(i))
               for i, q in enumerate(QUESTIONS)]
    done = [h.result() for h in handles]
    e.close()
    return done, order


def test_requests_sent_together_stream_together_and_reply_as_alone(short_starter, alone):
    e = engine(short_starter)
    done, order = send_all(e, TokenDelta)
    assert [d.token_ids for d in done] == [d.token_ids for d in alone]
    # every request had its first token before any had its last: they ran in one batch
    firsts = [order.index(i) for i in range(len(QUESTIONS))]
    lasts = [len(order) - 1 - order[::-1].index(i) for i in range(len(QUESTIONS))]
    assert max(firsts) < min(lasts)
    assert no_leak(e)


def test_max_running_makes_the_rest_wait_in_order(short_starter, alone):
    done, order = send_all(engine(short_starter, max_running=2), Finished)
    assert [d.token_ids for d in done] == [d.token_ids for d in alone]
    assert sorted(order[:2]) == [0, 1] and sorted(order[2:]) == [2, 3]


def test_a_cancel_stops_only_its_own_reply_and_frees_its_blocks(short_starter, alone):
    e = engine(short_starter)
    handles = [e.submit(Request(messages=ask(q), sampling=greedy())) for q in QUESTIONS[:2]]
    for event in handles[0]:
        if isinstance(event, TokenDelta):
            break
    e.cancel(handles[0])
    cancelled, other = (h.result() for h in handles)
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 24
    assert other.finish_reason == "length" and other.token_ids == alone[1].token_ids
    e.close()
    assert no_leak(e)


def test_a_pool_too_small_for_all_makes_requests_wait_and_every_reply_is_as_alone(short_starter):
    """Room for 1.3 conversations (each 36 prompt tokens and 96 generated, 9 blocks of 12): the
    others wait or are preempted and computed again (3 preemptions, measured)."""
    n = 96
    alone = one_by_one(short_starter, QUESTIONS[:3], n)
    per_token = 2 * 4 * 3 * 64 * 4  # the 4 layers' K and V, 3 KV heads of 64, fp32
    tight = engine(short_starter, kv_budget_bytes=16 * 12 * per_token, ram_cache_bytes=0)  # 12 blocks
    handles = [tight.submit(Request(messages=ask(q), sampling=greedy(n))) for q in QUESTIONS[:3]]
    done = [h.result() for h in handles]
    tight.close()
    assert [d.finish_reason for d in done] == ["length"] * 3
    assert [d.token_ids for d in done] == [d.token_ids for d in alone]
    assert tight.scheduler.preempted >= 1
    assert no_leak(tight)


def test_two_requests_with_the_same_persona_share_its_blocks(short_starter):
    e = engine(short_starter)
    handles = [e.submit(Request(messages=ask(q, persona=True), sampling=greedy(8))) for q in QUESTIONS[:2]]
    first, second = (h.result() for h in handles)
    persona_len = e.session.formatter.encode([PERSONA, {"role": "user", "content": "x"}]).message_starts[1]
    e.close()
    assert first.stats.cached_tokens == 0
    assert second.stats.cached_tokens >= persona_len // 16 * 16 > 0


def test_a_reconfigure_waits_for_the_running_replies_and_a_later_request_for_it(short_starter):
    e = engine(short_starter)
    ended = []
    handles = [e.submit(Request(messages=ask(q), sampling=greedy()), listener=lambda ev: isinstance(
        ev, Finished) and ended.append("reply")) for q in QUESTIONS[:2]]
    change = e.reconfigure(kv_precision="int8")
    change.add_done_callback(lambda _: ended.append("reconfigure"))
    after = e.submit(Request(messages=ask(QUESTIONS[2]), sampling=greedy(4)))
    assert [h.result().finish_reason for h in handles] == ["length", "length"]
    assert change.result(timeout=60)["precision"] == "int8"
    assert after.result().stats.kv_precision == "int8"
    e.close()
    assert ended == ["reply", "reply", "reconfigure"]


def test_each_step_is_a_plan_the_runner_executes_with_its_blocks_reserved_before(short_starter, monkeypatch):
    """schedule -> execute -> postprocess: what the runner gets is plain data (a chunk, a batch of
    sequences one token short), every block it writes already reserved, even where the pool is
    tight enough to preempt; a request's prefill chunk and the others' batch share steps. A
    sequence's rows past its own token are proposals, within the batch's largest step."""
    from kvchat.core.config import MAX_RUNNING
    from kvchat.engine.model.runner import ModelRunner
    from kvchat.engine.model.step_plan import StepPlan

    seen = []
    real = ModelRunner.execute

    def checked(self, plan):
        assert isinstance(plan, StepPlan) and not plan.empty
        writes = ([(plan.chunk.seq, plan.chunk.end)] if plan.chunk else []) + [(s, len(s)) for s in plan.decode]
        seen.append((plan.chunk is not None, len(plan.decode),
                     all(len(seq.blocks) >= self.manager.blocks_needed(end) for seq, end in writes),
                     all(len(seq) > seq.num_computed for seq in plan.decode)
                     and sum(len(seq) - seq.num_computed for seq in plan.decode) <= MAX_RUNNING,
                     plan.chunk is None or plan.chunk.seq not in plan.decode))
        return real(self, plan)

    monkeypatch.setattr(ModelRunner, "execute", checked)
    n = 96
    alone = one_by_one(short_starter, QUESTIONS[:3], n)
    seen.clear()
    per_token = 2 * 4 * 3 * 64 * 4
    tight = engine(short_starter, kv_budget_bytes=16 * 12 * per_token, ram_cache_bytes=0)
    handles = [tight.submit(Request(messages=ask(q), sampling=greedy(n))) for q in QUESTIONS[:3]]
    done = [h.result() for h in handles]
    tight.close()
    assert [d.token_ids for d in done] == [d.token_ids for d in alone]
    assert tight.scheduler.preempted >= 1
    assert all(reserved and rows and apart for _, _, reserved, rows, apart in seen)
    assert any(chunk and batch for chunk, batch, *_ in seen)  # a chunk and a batch in one step
    assert max(batch for _, batch, *_ in seen) >= 2


def test_a_short_request_does_not_wait_for_a_long_prompts_every_chunk(short_starter, monkeypatch):
    """Prompts take turns a chunk at a time, a new one first: a short question sent with a long
    prompt gets its first token after a chunk or two, before the long prompt's 16 chunks are done
    (it waited for all of them when the oldest prompt was prefilled to its end first)."""
    from kvchat.engine.job import Job

    firsts, real = [], Job.take

    def take(job, *args):
        if not job.generated:
            firsts.append(job.handle)
        return real(job, *args)

    monkeypatch.setattr(Job, "take", take)
    e = engine(short_starter, max_context=2048, prefill_chunk=32)
    long = e.submit(Request(messages=ask("Summarise: " + "the cat sat on the mat. " * 80), sampling=greedy(1)))
    short = e.submit(Request(messages=ask(QUESTIONS[1]), sampling=greedy(1)))
    long_done, short_done = long.result(), short.result()
    e.close()
    assert long_done.stats.prompt_tokens > 16 * 32 and short_done.stats.prompt_tokens <= 2 * 32
    assert firsts == [short, long]
