"""Speculation for one reply decoding alone: tokens proposed after its own (``lookup``) are checked
in one forward pass, a chunk whose every row keeps its logits, and each row samples the reply's
next token with the proposal for its place (``Sampler``'s rejection rule); the first token that
differs from its proposal is the reply's own and ends the run. The sequence then ends at its last
kept token and the blocks reserved past it go back, which is exact only where a row's K/V is all
the pool keeps of it: a full-precision pool without rings (``fits``)."""
from kvchat.core.config import Precision
from kvchat.engine.kv.block_pool import PoolExhausted
from kvchat.engine.lookup import Lookup
from kvchat.engine.model.step_plan import Chunk

# tokens proposed a check: from K, doubled after a full match, down to what was kept + 1; after a
# check that kept none, no proposal for WAIT decode steps, doubling to WAIT_MAX
K, K_MIN, K_MAX = 4, 2, 16
WAIT, WAIT_MAX = 4, 64


def fits(precision: Precision, manager) -> bool:
    """A quantized pool's window and a windowed model's rings keep their own bookkeeping of the
    rows written, which dropping a check's rejected rows does not roll back."""
    return precision is Precision.FP16 and manager.rings is None


class Speculator:
    """One reply's proposals and how far to trust them, after what its checks kept."""

    def __init__(self, prediction: list[int] | None = None):
        self.lookup = Lookup(prediction)
        self.proposed: list[int] = []  # what the planned check holds past the reply's own token
        # a client's own prediction is meant to be kept: the longest checks from the start
        self.k = K_MAX if prediction else K
        self.wait = self.backoff = 0  # decode steps before the next proposal, after checks that paid nothing

    def propose(self, token_ids: list[int], generated: int, room: int) -> list[int]:
        if room < 1:
            return []
        if self.wait > 0:
            self.wait -= 1
            return []
        return self.lookup.propose(token_ids, generated, min(self.k, room))

    def checked(self, kept: int, proposed: int, stats) -> None:
        stats.accepted_prediction_tokens += kept
        stats.rejected_prediction_tokens += proposed - kept
        if kept == 0:
            self.backoff = min(max(2 * self.backoff, WAIT), WAIT_MAX)
            self.wait, self.k = self.backoff, max(K_MIN, self.k // 2)
        else:
            self.backoff = 0
            self.k = min(K_MAX, 2 * self.k) if kept == proposed else max(K_MIN, kept + 1)


def plan_check(manager, job) -> Chunk | None:
    """``job``'s own token and its proposals in one chunk, their blocks reserved; None where
    nothing is proposed or the pool has no room (a proposal never steps the pool down or preempts)."""
    seq, spec = job.seq, job.spec
    room = min(job.handle.request.sampling.max_new_tokens - len(job.generated), job.limit - len(seq)) - 1
    proposed = spec.propose(seq.token_ids, len(job.generated), room)
    if not proposed:
        return None
    seq.token_ids.extend(proposed)
    try:
        manager.reserve(seq, len(seq))
    except PoolExhausted:
        del seq.token_ids[-len(proposed):]
        return None
    spec.proposed = proposed
    return Chunk(seq, len(seq), want_logits="all")


def drop(job) -> None:
    """The check failed: the sequence ends at its own token again."""
    proposed, job.spec.proposed = job.spec.proposed, []
    del job.seq.token_ids[len(job.seq) - len(proposed):]


def take_checked(manager, job, logits) -> None:
    """The check's rows in order, each sampling the next token with the proposal for its place,
    until a token differs from its proposal or the reply stops; the blocks past its end go back."""
    seq, spec = job.seq, job.spec
    proposed, spec.proposed = spec.proposed, []
    before = len(seq) - len(proposed)  # its last token was the step's own input
    del seq.token_ids[before:]
    kept = 0
    try:
        for i, row in enumerate(logits):
            seq.num_computed = before + i  # the rows of the input and the kept proposals before it
            manager.commit(seq)
            token = job.take(row, proposed[i] if i < len(proposed) else None)
            if job.last is not None or i == len(proposed) or token != proposed[i]:
                break
            kept += 1
    finally:
        spec.checked(kept, len(proposed), job.stats)
        manager.shrink(seq)
