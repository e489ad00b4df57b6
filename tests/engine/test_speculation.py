"""Speculation from the conversation (engine/lookup.py, engine/speculation.py): tokens that
followed the reply's last few tokens earlier are proposed, checked in one forward pass, and kept
only where the model would have chosen them; greedy replies are the replies without it, sampled
ones keep their distribution, and the blocks of rejected tokens go back."""
import torch

from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.core.events import Request
from kvchat.engine.engine import Engine
from kvchat.engine.lookup import Lookup, NgramIndex
from kvchat.engine.sampler import Sampler, filtered_probs

CODE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i}" for i in range(6))
EDIT = [{"role": "user", "content": f"Copy this code exactly, then stop.\n\n{CODE}"}]
OPEN = [{"role": "user", "content": "Why is the sky blue?"}]


def test_the_longest_earlier_ngram_proposes_what_followed_it():
    index = NgramIndex([5, 1, 2, 9, 1, 2, 3, 7, 8])
    assert index.follow([1, 2, 3], 3) == [7, 8]  # the 3-gram, not the later 2-gram "1 2" alone
    assert index.follow([4, 1, 2], 2) == [3, 7]  # "1 2" last ended before 3
    assert index.follow([6, 6], 2) == []


def test_a_reply_is_proposed_its_own_earlier_text_and_a_prediction_first():
    lookup = Lookup()
    tokens = [10, 11, 12, 13, 14, 20, 11, 12]
    assert lookup.propose(tokens, 3, 4) == [13, 14, 20, 11]
    assert lookup.propose([1, 2, 3], 1, 4) == []  # its own suffix is no match
    predicted = Lookup([40, 41, 42, 43])
    assert predicted.propose([1, 2, 3], 0, 2) == [40, 41]  # the reply starts as its prediction
    assert predicted.propose([1, 2, 3, 40], 1, 2) == [41, 42]  # on track: no n-gram needed yet
    assert predicted.propose([1, 2, 3, 40, 41, 42, 43], 4, 2) == []  # past its end, nothing before
    assert predicted.propose([1, 2, 40, 41], 2, 3) == [42, 43]


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
        pool = engine.kvpool.pool
        leaked = pool.num_free != pool.num_blocks or any(b.ref_cnt for b in pool.blocks)
        return done, leaked
    finally:
        engine.close()


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"max_context": 1024, "prefill_chunk": 128, "decode": "eager", **kw})


def test_a_greedy_reply_is_the_reply_without_speculation_and_leaks_no_block(short_starter):
    plain, _ = run(config(speculate=False), short_starter, EDIT)
    fast, leaked = run(config(), short_starter, EDIT)
    assert fast.token_ids == plain.token_ids
    assert fast.stats.accepted_prediction_tokens > 0  # it proposed, and the model kept some
    assert plain.stats.accepted_prediction_tokens == plain.stats.rejected_prediction_tokens == 0
    assert not leaked


def test_a_prediction_of_the_reply_is_kept_whole(short_starter):
    """OpenAI's Predicted Outputs: the expected text, proposed from the reply's start."""
    plain, _ = run(config(speculate=False), short_starter, OPEN, n=32)
    engine = Engine(config(), loaded=short_starter, disk_tier=None)
    try:
        engine.wait_ready(60)
        params = SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0)
        done = engine.submit(Request(messages=OPEN, sampling=params, prediction=plain.text)).result()
    finally:
        engine.close()
    assert done.token_ids == plain.token_ids
    stats = done.stats
    # the first token comes from the prompt's chunk, and each check's last row is the step's own
    # token (2 checks: 16 + 1, then 13 + 1), so 29 of the other 31 can be kept
    assert stats.accepted_prediction_tokens >= 0.9 * 31
    assert stats.rejected_prediction_tokens <= 2


def test_a_quantized_pool_does_not_speculate_and_replies_as_before(short_starter):
    plain, _ = run(config(speculate=False, kv_precision="int8"), short_starter, EDIT, n=24)
    same, leaked = run(config(kv_precision="int8"), short_starter, EDIT, n=24)
    assert same.token_ids == plain.token_ids and not leaked
    assert same.stats.accepted_prediction_tokens == same.stats.rejected_prediction_tokens == 0
