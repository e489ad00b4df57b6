"""Speculation from the conversation (engine/lookup.py, engine/speculation.py): tokens that
followed the reply's last few tokens earlier are proposed, checked in one forward pass, and kept
only where the model would have chosen them; greedy replies are the replies without it, sampled
ones keep their distribution, and the blocks of rejected tokens go back."""
from unittest import mock

import pytest
import torch

from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.core.events import Request
from kvchat.engine.engine import Engine
from kvchat.engine.lookup import Lookup, NgramIndex
from kvchat.engine.sampler import Sampler, filtered_probs

from tiny_models import WINDOW, as_loaded, tiny_model

CODE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i}" for i in range(6))
EDIT = [{"role": "user", "content": f"Copy this code exactly, then stop.\n\n{CODE}"}]
OPEN = [{"role": "user", "content": "Why is the sky blue?"}]


def test_the_longest_earlier_ngram_proposes_what_followed_it():
    index = NgramIndex([5, 1, 2, 3, 9, 4, 1, 2, 3, 6, 7, 8])
    assert index.follow([4, 1, 2, 3], 3) == [6, 7, 8]  # the 4-gram, where it ended
    assert index.follow([0, 1, 2, 3], 2) == [6, 7]  # "1 2 3" last ended before 6
    assert index.follow([5, 1, 2], 2) == [3, 9]  # "5 1 2" once
    assert index.follow([0, 1, 2], 2) == []  # "1 2" alone is too short a match to propose from
    assert index.follow([6, 6, 6], 2) == []


def test_a_reply_is_proposed_its_own_earlier_text_and_a_prediction_first():
    lookup = Lookup()
    tokens = [10, 11, 12, 13, 14, 20, 11, 12, 13]
    assert lookup.propose(tokens, 3, 4) == [14, 20, 11, 12]
    assert lookup.propose([1, 2, 3], 1, 4) == []  # its own suffix is no match
    predicted = Lookup([40, 41, 42, 43])
    assert predicted.propose([1, 2, 3], 0, 2) == [40, 41]  # the reply starts as its prediction
    assert predicted.propose([1, 2, 3, 40], 1, 2) == [41, 42]  # on track: no n-gram needed yet
    assert predicted.propose([1, 2, 3, 40, 41, 42, 43], 4, 2) == []  # past its end, nothing before
    assert predicted.propose([1, 2, 7, 40, 41, 42], 3, 2) == [43]  # off track: its n-grams still


def test_a_sampled_token_checked_against_a_proposal_keeps_the_samplers_distribution():
    """The rejection rule for a proposer sure of its token: keep it with its probability, else
    draw from the rest. 40,000 draws of each way at a fixed seed; a chi-square bound that fails
    for a rule that, say, keeps the proposal outright (its share would be 1)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    params = SamplingParams(temperature=0.8, top_k=5, seed=7)
    probs = filtered_probs(logits / params.temperature, params.top_k, params.top_p, params.min_p)
    sampler = Sampler(params)
    n = 40_000
    counts = torch.bincount(torch.tensor([sampler(logits, None, proposed=1) for _ in range(n)]), minlength=6)
    expected = probs * n
    live = expected > 0
    chi2 = float((((counts - expected)[live] ** 2) / expected[live]).sum())
    assert counts[~live].sum() == 0  # top-k's cut token is never drawn, proposed or not
    assert chi2 < 20.5  # 4 degrees of freedom: p = 0.0004


def run(config: EngineConfig, lm, messages, n=48, **sampling):
    engine = Engine(config, loaded=lm, disk_tier=None)
    try:
        engine.wait_ready(60)
        params = SamplingParams(max_new_tokens=n, ignore_eos=True, **{"temperature": 0, **sampling})
        done = engine.submit(Request(messages=messages, sampling=params)).result()
        pool = engine.kvpool.blocks
        leaked = pool.num_free != pool.num_blocks or any(b.ref_cnt for b in pool.blocks)
        return done, leaked
    finally:
        engine.close()


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"max_context": 1024, "prefill_chunk": 128, "decode": "eager", **kw})


@pytest.fixture
def every_check():
    """Each step checks every proposal: the gate (tested on its own below) chooses from timings
    measured as the steps run, so on a slow or busy machine it skipped the checks these tests
    are about (an int8 pool's reply checked once and rejected nothing)."""
    from kvchat.engine.speculation import CheckGate

    with mock.patch.object(CheckGate, "cap", lambda self, pool, sequences, offers: max(n for _, n in offers)):
        yield


def test_a_greedy_reply_is_the_reply_without_speculation_and_leaks_no_block(short_starter, every_check):
    plain, _ = run(config(speculate=False), short_starter, EDIT)
    fast, leaked = run(config(), short_starter, EDIT)
    assert fast.token_ids == plain.token_ids
    assert fast.stats.accepted_prediction_tokens > 0  # it proposed, and the model kept some
    assert plain.stats.accepted_prediction_tokens == plain.stats.rejected_prediction_tokens == 0
    assert not leaked


def predicted_reply(lm, prediction: str, n: int = 32, **config_overrides):
    engine = Engine(config(**config_overrides), loaded=lm, disk_tier=None)
    try:
        engine.wait_ready(60)
        params = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0)
        done = engine.submit(Request(messages=OPEN, sampling=params, prediction=prediction)).result()
        pool = engine.kvpool.blocks
        return done, pool.num_free != pool.num_blocks or any(b.ref_cnt for b in pool.blocks)
    finally:
        engine.close()


def test_a_prediction_of_the_reply_is_kept_whole(short_starter, every_check):
    """OpenAI's Predicted Outputs: the expected text, proposed from the reply's start. Its first
    15 tokens ride in the prompt's last chunk, checked with the prompt's end in one forward: 16
    tokens come from it (the 15 and the model's own after them), 16 from the next step's check of
    15, so 30 of the 32 are kept proposals (the prompt's chunk gave 1 token and the checks began at
    the next step: 29 of 31 could be kept)."""
    plain, _ = run(config(speculate=False), short_starter, OPEN, n=32)
    done, leaked = predicted_reply(short_starter, plain.text)
    assert done.token_ids == plain.token_ids and not leaked
    stats = done.stats
    assert stats.accepted_prediction_tokens == 30 and stats.rejected_prediction_tokens == 0


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_wrong_prediction_changes_nothing_in_the_reply(short_starter, precision, every_check):
    """A prediction that is not the reply: the prompt's chunk checks its first tokens (fp16) or the
    decode batch does (int8, whose full-precision window the prompt's chunk must not overwrite);
    the reply is the one without a prediction, and every block comes back."""
    plain, _ = run(config(speculate=False, kv_precision=precision), short_starter, OPEN, n=32)
    wrong = "Because of the way the ocean reflects it, said nobody who studied optics in any detail at all."
    done, leaked = predicted_reply(short_starter, wrong, kv_precision=precision)
    assert done.token_ids == plain.token_ids and not leaked
    assert done.stats.rejected_prediction_tokens > 0


@pytest.mark.parametrize("precision", ["int8", "fp8", "k8v4", "int4"])
def test_a_quantized_pool_speculates_and_replies_as_without(short_starter, precision, every_check):
    """The check's rejected rows overwrote ring rows of the full-precision window, which come
    back; an int4 block's statistics that they joined are made again from the block's first row:
    the greedy reply is the one without speculation, token for token."""
    plain, _ = run(config(speculate=False, kv_precision=precision), short_starter, EDIT)
    fast, leaked = run(config(kv_precision=precision), short_starter, EDIT)
    assert fast.token_ids == plain.token_ids and not leaked
    assert fast.stats.accepted_prediction_tokens > 0 and fast.stats.rejected_prediction_tokens > 0


@pytest.mark.parametrize("precision", ["fp16", "int4"])
@pytest.mark.parametrize("arch", ["mistral-window", "gemma2"])
def test_a_windowed_model_speculates_past_its_window_and_replies_as_without(tokenizer, arch, precision, every_check):
    """Rings (every layer windowed; local and global layers alternating), past the window of 64:
    checks of the reply's expected text with every 10th token wrong, some kept, some not, give the
    greedy reply of the engine without speculation, and at fp16 generate's."""
    model = tiny_model(arch)
    ids = list(range(300, 320))
    new = WINDOW + 64
    expected = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(ids):]
    predicted = [t if i % 10 != 9 else (t + 1) % model.config.vocab_size for i, t in enumerate(expected.tolist())]
    replies = {}
    for speculate in (False, True):
        engine = Engine(config(max_context=256, prefill_chunk=8, kv_precision=precision, speculate=speculate),
                        loaded=as_loaded(model, tokenizer))
        try:
            engine.wait_ready(60)
            with mock.patch.object(engine.loaded.tokenizer, "encode", lambda text, **kw: predicted):
                replies[speculate] = engine.submit(Request(prompt_ids=ids, prediction="the reply", sampling=SamplingParams(
                    max_new_tokens=new, temperature=0, ignore_eos=True))).result()
            pool = engine.kvpool.blocks
            assert pool.num_free == pool.num_blocks and not any(b.ref_cnt for b in pool.blocks)
        finally:
            engine.close()
    assert replies[True].token_ids == replies[False].token_ids
    if precision == "fp16":
        assert replies[True].token_ids == expected.tolist()
    stats = replies[True].stats
    assert stats.accepted_prediction_tokens >= 19 and stats.rejected_prediction_tokens > 0  # 38 and 106 kept


def test_random_replies_with_proposals_leak_no_block_over_a_thousand_steps(short_starter):
    """Hypothesis draws batches of replies that repeat text (so proposals are made and some
    kept), greedy and sampled, some cancelled mid-reply, through a pool small enough to preempt;
    after each batch every block is free and unreferenced, and the engine goes on. Runs until
    the engine has taken 1,000 steps."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    engine = Engine(config(max_running=4, kv_budget_bytes=16 * 40 * 2 * 4 * 3 * 64 * 4, ram_cache_bytes=0),
                    loaded=short_starter, disk_tier=None)
    engine.wait_ready(60)
    steps = {"n": 0, "kept": 0, "dropped": 0}
    real = engine.scheduler.step

    def counted(session):
        steps["n"] += 1
        return real(session)

    engine.scheduler.step = counted
    reply = st.fixed_dictionaries({
        "words": st.lists(st.sampled_from(["alpha", "beta", "gamma", "delta", "x = x + 1", "return x"]),
                          min_size=3, max_size=12),
        "repeat": st.integers(1, 4), "n": st.integers(1, 40), "temperature": st.sampled_from([0.0, 0.8]),
        "seed": st.integers(0, 1000), "cancel": st.booleans()})

    @settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(reply, min_size=1, max_size=5))
    def batch(replies):
        if steps["n"] >= 1000:
            return
        handles = []
        for r in replies:
            text = " ".join(r["words"] * r["repeat"])
            params = SamplingParams(max_new_tokens=r["n"], temperature=r["temperature"], seed=r["seed"])
            handles.append((engine.submit(Request(messages=[{"role": "user", "content": f"Repeat: {text}"}],
                                                  sampling=params)), r["cancel"]))
        for handle, cancel in handles:
            if cancel:
                handle.cancel()
        for handle, _ in handles:
            stats = handle.result().stats
            steps["kept"] += stats.accepted_prediction_tokens
            steps["dropped"] += stats.rejected_prediction_tokens
        pool = engine.kvpool.blocks
        assert pool.num_free == pool.num_blocks and not any(b.ref_cnt for b in pool.blocks)

    try:
        batch()
        assert steps["n"] >= 1000 and engine.alive
        assert steps["kept"] > 0 and steps["dropped"] > 0  # checks kept some proposals and dropped others
    finally:
        engine.close()


class Stand:
    """A pool as the gate sees it: something it can hold weakly."""


def test_the_gate_lets_go_of_a_pool_it_measured():
    """The scheduler outlives every session: a strong reference kept a closed model's KV cache
    allocated while the next model measured what memory was free."""
    import weakref

    from kvchat.engine.speculation import CheckGate

    gate, pool = CheckGate(), Stand()
    gate.note(pool, 1, 1, 0.010)
    kept = weakref.ref(pool)
    del pool
    assert kept() is None


def test_a_step_checks_as_many_proposals_as_give_the_most_tokens_a_second():
    """Measured: a plain step of one sequence 10 ms, a check of 4 rows 40 ms (10 ms a row beside
    the first, as a quantized pool on the CPU costs): proposals kept half the time do not pay at
    any size; near-certain ones pay where rows are cheap (25 ms for 4: 5 ms a row), there at the
    size that gives the most tokens a second. Nothing measured: all run. Another pool starts over."""
    from kvchat.engine.speculation import CheckGate

    half, sure = (lambda k: 0.5 * k), (lambda k: 0.95 * k)
    gate, pool = CheckGate(), Stand()
    assert gate.cap(pool, 1, [(half, 7)]) == 7  # nothing measured: run it and see
    gate.note(pool, 1, 1, 0.010)
    assert gate.cost(1, 8) == 0.010 + 7 * 0.002  # before any check: a fifth of a step a row
    gate.note(pool, 1, 4, 0.040)
    assert gate.cost(1, 8) == 0.040 + 4 * 0.010 and gate.cost(1, 2) == 0.020
    assert gate.cap(pool, 1, [(half, 3)]) == 0 and gate.cap(pool, 1, [(sure, 3)]) == 0
    gate.seconds[(1, 4)] = 0.025
    assert gate.cap(pool, 1, [(sure, 3)]) == 3  # 3.85 tokens in 25 ms, against 1.95 in 15 and 1 in 10
    assert gate.cap(pool, 1, [(half, 3)]) == 0  # 2.5 in 25 ms, 1.5 in 15: no better than 1 in 10
    assert gate.cap(Stand(), 1, [(half, 3)]) == 3 and gate.seconds == {}


def test_a_proposal_not_checked_is_scored_by_the_tokens_that_came():
    """How often a proposed token is kept (decayed counts), from checks and from proposals the
    gate skipped alike; a client's prediction starts trusted."""
    from kvchat.engine.speculation import Speculator

    spec = Speculator()
    assert spec.expected(3) == 0.5 + 0.25 + 0.125  # no evidence: a rate of 1/2
    spec.skip([5, 6, 7], 10)
    spec.propose(list(range(10)) + [5, 6, 9], 3, 0)  # two came as proposed, then another
    assert (spec.hits, spec.misses) == (0.7 + 2, 0.7 + 1) and spec.unchecked is None
    spec.skip([8], 13)
    spec.propose(list(range(10)) + [5, 6, 9], 3, 0)  # nothing came yet: still waiting
    assert spec.unchecked == ([8], 13)
    assert Speculator(prediction=[1, 2]).expected(1) == 0.9
