"""Speculation: the tokens proposed to follow a reply's own (``lookup``) ride in the step's decode
batch as rows of their own after it (``ModelRunner.decode``: each row reads the K/V the rows before
it wrote), so one forward pass checks them all for the price of about one token: the weights are
read once. Each row samples the reply's next token with the proposal for its place (``Sampler``'s
rejection rule); the first token that differs from its proposal is the reply's own and ends the
run. The sequence then ends at its last kept token, and what the rejected rows wrote is taken back:
- the pool's rows past the sequence's end are never read (an int4 block's statistics, which they
  joined, are computed again from the block's first row at its next write, from the window);
- a quantized pool's full-precision window gets back the ring rows they overwrote (``save`` before
  the check, ``restore`` after), so the newest positions it holds are those it held without them;
- a windowed model's rings lose nothing a later query reads: a ring holds ``W - 1 + block_size``
  positions at least, and a check writes fewer than a block past its own token (``STEPS``), so the
  rows it overwrites fell out of every window already. Its top moves to the newest block written.
Blocks reserved past the end go back, but a ring's (they follow the sequence).
"""
from kvchat.engine.kv.block_pool import PoolExhausted
from kvchat.engine.lookup import Lookup

# tokens proposed a check: with the reply's own, 2, 4, 8 or 16 rows, a compiled batch bucket filled
# (a check of 3 cost 1.6 single steps, of 7: 2.7, of 15: 4; starter, depth 700, AVX-512). From 3,
# a step up after a check that kept all, down to the least that holds what was kept after one that
# kept some; after one that kept none, no proposal for WAIT decode steps, doubling to WAIT_MAX
STEPS = (1, 3, 7, 15)
WAIT, WAIT_MAX = 4, 64


def fits(manager) -> bool:
    """A check's rows stay within a block past its own token, which a ring never needs (above)."""
    return manager.rings is None or STEPS[-1] < manager.block_size


class Speculator:
    """One reply's proposals and how far to trust them, after what its checks kept."""

    def __init__(self, prediction: list[int] | None = None):
        self.lookup = Lookup(prediction)
        self.proposed: list[int] = []  # what the planned check holds past the reply's own token
        self.saved = None  # (window, what its ring held where the check writes): ``take_back``
        # a client's own prediction is meant to be kept: the longest checks from the start
        self.k = STEPS[-1] if prediction else STEPS[1]
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
            self.wait, self.k = self.backoff, STEPS[max(0, STEPS.index(self.k) - 1)]
        elif kept == proposed:
            self.backoff, self.k = 0, STEPS[min(len(STEPS) - 1, STEPS.index(self.k) + 1)]
        else:
            self.backoff, self.k = 0, next(k for k in STEPS if k > kept)


def plan_checks(manager, runner, jobs: list) -> None:
    """Proposals for the decoding ``jobs``, in turn, within the rows the batch runs compiled."""
    if not fits(manager):
        return
    want = len(jobs) + sum(job.spec.k for job in jobs if job.spec is not None)
    rows = runner.check_rows(want) - len(jobs)  # a row each is taken
    for job in jobs:
        if job.spec is not None and rows > 0:
            rows -= plan_check(manager, job, rows)


def plan_check(manager, job, rows: int) -> int:
    """Up to ``rows`` tokens proposed after ``job``'s own, appended to its sequence and their
    blocks reserved; returns how many (0 where nothing is proposed or the pool has no room: a
    proposal never steps the pool down or preempts)."""
    seq, spec = job.seq, job.spec
    room = min(job.handle.request.sampling.max_new_tokens - len(job.generated), job.limit - len(seq)) - 1
    proposed = spec.propose(seq.token_ids, len(job.generated), min(room, rows))
    if not proposed:
        return 0
    seq.token_ids.extend(proposed)
    try:
        manager.reserve(seq, len(seq))
    except PoolExhausted:
        del seq.token_ids[-len(proposed):]
        manager.shrink(seq)
        return 0
    spec.proposed = proposed
    window = seq.window
    spec.saved = (window, window.save(len(seq) - len(proposed), len(seq))) if window is not None else None
    return len(proposed)


def rows(job) -> int:
    """The rows ``job`` has in the step's decode batch."""
    return 1 + (len(job.spec.proposed) if job.spec is not None else 0)


def drop(manager, job) -> None:
    """The check failed: the sequence ends at its own token again, its blocks with it."""
    if job.spec is not None and job.spec.proposed:
        proposed, job.spec.proposed = job.spec.proposed, []
        del job.seq.token_ids[len(job.seq) - len(proposed):]
        take_back(manager, job.seq, job.spec, len(proposed), len(job.seq))


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
        take_back(manager, seq, spec, len(proposed), before)


def take_back(manager, seq, spec, proposed: int, before: int) -> None:
    """What a check wrote past ``seq``'s computed tokens (its own token's row at ``before - 1``
    and ``proposed`` rows after) no longer counts: the window's overwritten ring rows come back,
    a ring's top moves to the newest block written, the blocks past the end go back."""
    window, saved = spec.saved or (None, None)
    spec.saved = None
    if seq.window is not None and seq.window.current:
        if seq.window is window:
            seq.window.restore(saved, seq.num_computed)
        else:  # made at the check's start (``ModelRunner._ready``): it holds nothing older to put back
            seq.window.rewind(seq.num_computed)
    if manager.rings is not None:
        seq.ring_top = max(seq.ring_top, (before - 1 + proposed) // manager.block_size)
    manager.shrink(seq)
