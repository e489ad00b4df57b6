"""The batched decode step against the single-sequence step: three sequences of different lengths
decoded together give each sequence the logits it gets alone, within 1e-4 in fp32, in every KV
precision, eager and compiled (a batch of 3 padded to its bucket of 4)."""
import pytest
import torch

from kvchat.bench.decode import IdTokenizer
from kvchat.core.config import Precision
from kvchat.engine.kv.pool import KVPool
from kvchat.engine.kv.manager import Sequence
from kvchat.engine.model.batch_step import BUCKETS, bucket_for
from kvchat.engine.model.runner import ModelRunner

from tiny_models import as_loaded, tiny_model

TOL = 1e-4
PROMPTS = [list(range(5, 45)), list(range(100, 117)), list(range(200, 271))]  # 40, 17 and 71 tokens
STEPS = 6


@pytest.fixture(scope="module")
def tiny():
    return as_loaded(tiny_model("qwen3"), IdTokenizer(512), "qwen3")


def fresh_pool(lm, precision: str, mode: str) -> KVPool:
    pool = KVPool.for_tokens(lm, 4 * 128, Precision(precision))
    pool.runner = ModelRunner(lm.model, pool.kv, pool.manager, mode)
    return pool


def prefill(pool: KVPool, prompt: list[int]) -> tuple[Sequence, torch.Tensor]:
    seq = Sequence(list(prompt))
    pool.manager.reserve(seq, len(seq))
    return seq, pool.runner.forward(seq, len(seq), want_logits=True)


def alone(lm, precision: str, prompt: list[int]) -> torch.Tensor:
    """The logits of each greedy step of one sequence, decoded by itself."""
    pool = fresh_pool(lm, precision, "eager")
    seq, logits = prefill(pool, prompt)
    rows = []
    for _ in range(STEPS):
        seq.token_ids.append(int(logits.argmax()))
        pool.manager.reserve(seq, len(seq))
        logits = pool.runner.forward(seq, len(seq), want_logits=True)
        rows.append(logits)
    return torch.stack(rows)


def together(lm, precision: str, mode: str) -> tuple[torch.Tensor, list[Sequence]]:
    """The same, the three sequences decoded as one batch each step: ``[sequences, steps, vocab]``."""
    pool = fresh_pool(lm, precision, mode)
    seqs, logits = zip(*(prefill(pool, p) for p in PROMPTS))
    logits, rows = torch.stack(logits), []
    for _ in range(STEPS):
        for seq, row in zip(seqs, logits):
            seq.token_ids.append(int(row.argmax()))
            pool.manager.reserve(seq, len(seq))
        logits = pool.runner.decode(list(seqs))
        rows.append(logits)
    return torch.stack(rows, 1), seqs


@pytest.mark.parametrize("precision", ["fp16", "int8", "fp8", "k8v4", "int4"])
def test_a_batch_decodes_each_sequence_as_it_decodes_alone(tiny, precision):
    got, seqs = together(tiny, precision, "eager")
    for i, prompt in enumerate(PROMPTS):
        want = alone(tiny, precision, prompt)
        assert (got[i] - want).abs().max() < TOL, (precision, i)
        assert torch.equal(got[i].argmax(-1), want.argmax(-1))
    if precision != "fp16":  # each running sequence kept rows of its own: none took another's
        windows = [seq.window for seq in seqs]
        assert all(w.current for w in windows) and len({id(w.k) for w in windows}) == len(seqs)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_compiled_batch_padded_to_its_bucket_decodes_as_eager(tiny, precision):
    """fp16 pools trace their attention into the graph, quantized ones call the op: one of each."""
    pool = fresh_pool(tiny, precision, "compiled")
    batch = pool.runner.batch
    batch.wanted.add(bucket_for(len(PROMPTS)))
    pool.runner.step.prepare(pool.kv)
    assert pool.runner.step.background.wait(900)
    assert batch.prepare(pool.kv) and pool.runner.step.background.wait(900)
    assert pool.runner.step.fallback is None
    replays = batch.replays
    got, _ = together(tiny, precision, "compiled")
    want, _ = together(tiny, precision, "eager")
    assert batch.replays - replays == STEPS  # every step ran the compiled graph
    assert (got - want).abs().max() < TOL
    assert bucket_for(3) == 4 and BUCKETS == (2, 4, 8, 16)


def test_a_check_is_one_compiled_batch_whose_rows_are_the_tokens_decoded_one_by_one(tiny):
    """A sequence's own token and 3 proposed after it (a speculative check) run as the rows of one
    compiled batch of 4, each reading what the rows before it wrote: every row has the logits of
    decoding the tokens one at a time. A check is offered only the buckets already compiled."""
    pool = fresh_pool(tiny, "fp16", "compiled")
    batch = pool.runner.batch
    assert batch.compiled_rows(pool.kv, 16) < 16 and 16 in batch.wanted  # never compiled: not offered
    batch.compiled_rows(pool.kv, 4)
    pool.runner.step.prepare(pool.kv)
    assert pool.runner.step.background.wait(900)
    batch.prepare(pool.kv)
    assert pool.runner.step.background.wait(900) and batch.compiled_rows(pool.kv, 4) >= 4
    tokens = [7, 8, 9, 10]
    seq, _ = prefill(pool, PROMPTS[0])
    seq.token_ids += tokens
    pool.manager.reserve(seq, len(seq))
    replays = batch.replays
    got = pool.runner.decode([seq])
    assert batch.replays == replays + 1 and seq.num_computed == len(seq)
    ref = fresh_pool(tiny, "fp16", "eager")
    one, _ = prefill(ref, PROMPTS[0])
    want = []
    for token in tokens:
        one.token_ids.append(token)
        ref.manager.reserve(one, len(one))
        want.append(ref.runner.decode([one])[0])
    assert got.shape == (4, want[0].shape[0]) and (got - torch.stack(want)).abs().max() < TOL
