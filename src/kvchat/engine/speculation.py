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
import weakref

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
    DECAY = 0.7  # of the older evidence at each new check: a reply copies in runs, then stops

    def __init__(self, prediction: list[int] | None = None):
        self.lookup = Lookup(prediction)
        self.proposed: list[int] = []  # what the planned check holds past the reply's own token
        self.saved = None  # (window, what its ring held where the check writes): ``take_back``
        # a client's own prediction is meant to be kept: the longest checks from the start
        self.k = STEPS[-1] if prediction else STEPS[1]
        self.wait = self.backoff = 0  # decode steps before the next proposal, after checks that paid nothing
        # how often a proposed token is kept, given the one before it was: kept and missed, decayed
        self.hits, self.misses = (9.0, 1.0) if prediction else (1.0, 1.0)
        self.unchecked: tuple[list[int], int] | None = None  # a proposal not checked, scored by what came

    @property
    def predicted(self) -> bool:
        """A client's prediction was given: its tokens are proposed first."""
        return self.lookup.prediction is not None

    def propose(self, token_ids: list[int], generated: int, room: int) -> list[int]:
        if self.unchecked is not None:
            self._score_unchecked(token_ids)
        if room < 1:
            return []
        if self.wait > 0:
            self.wait -= 1
            return []
        return self.lookup.propose(token_ids, generated, min(self.k, room))

    def expected(self, k: int) -> float:
        """Tokens a check of ``k`` proposals is expected to keep: each kept with the rate seen, the
        first miss ending the run."""
        rate = self.hits / (self.hits + self.misses)
        return sum(rate ** i for i in range(1, k + 1))

    def skip(self, proposed: list[int], length: int) -> None:
        """``proposed`` to follow a sequence of ``length`` was not checked (it would not pay now):
        the reply's next tokens still say how it would have fared."""
        self.unchecked = (proposed, length)

    def _score_unchecked(self, token_ids: list[int]) -> None:
        proposed, length = self.unchecked
        came = token_ids[length:]
        if not came:
            return
        self.unchecked = None
        n = min(len(proposed), len(came))
        kept = next((i for i in range(n) if proposed[i] != came[i]), n)
        self._score(kept, kept < n)

    def _score(self, kept: int, missed: bool) -> None:
        self.hits = self.DECAY * self.hits + kept
        self.misses = self.DECAY * self.misses + missed

    def checked(self, kept: int, proposed: int, stats) -> None:
        stats.accepted_prediction_tokens += kept
        stats.rejected_prediction_tokens += proposed - kept
        self._score(kept, kept < proposed)
        if kept == 0:
            self.backoff = min(max(2 * self.backoff, WAIT), WAIT_MAX)
            self.wait, self.k = self.backoff, STEPS[max(0, STEPS.index(self.k) - 1)]
        elif kept == proposed:
            self.backoff, self.k = 0, STEPS[min(len(STEPS) - 1, STEPS.index(self.k) + 1)]
        else:
            self.backoff, self.k = 0, next(k for k in STEPS if k > kept)


class CheckGate:
    """How many proposals a step checks: the most tokens a second, from the tokens each reply's
    proposals are expected to keep (``Speculator.expected``) and what the rows cost here, measured
    as the steps run: seconds per shape of step (``(sequences, rows)``; a plain step has a row per
    sequence), a running mean, forgotten when the pool changes; a shape not run yet costs the plain
    step plus its extra rows at the mean cost of a row measured beside it (before any, a fifth of a
    step: an optimistic guess that the first check corrects). A row beside the first costs a fifth
    of a step on the CPU's compiled fp16 step, but nearly a whole one (0.65-0.85 measured) in a
    quantized pool on the CPU, where each row reads the sequence's K/V again: there a check pays
    only where its proposals are near certain (a client's prediction, a copied run)."""
    WEIGHT = 0.25  # of the newest step in a running mean
    FIRST_ROW_GUESS = 0.2
    EXPLORE = 32  # skipped steps before a check of one proposal runs anyway: a row's cost measured again

    def __init__(self):
        self.pool = lambda: None  # a weak reference: a closed session's pool must not outlive it
        self.seconds: dict[tuple[int, int], float] = {}
        self.skipped = 0

    def cap(self, pool, sequences: int, offers: list) -> int:
        """The most proposals each sequence checks this step (0: none), ``offers`` holding each
        proposing sequence's ``(expected, proposed)``: its ``Speculator.expected`` and how many it
        proposes."""
        self._same_pool(pool)
        plain = self.seconds.get((sequences, sequences))
        if plain is None:
            return max(n for _, n in offers)  # nothing measured yet: run it and see
        best, best_rate = 0, sequences / plain
        for cap in sorted({min(n, s) for _, n in offers for s in STEPS} | {n for _, n in offers}):
            rows = sequences + sum(min(n, cap) for _, n in offers)
            tokens = sequences + sum(expected(min(n, cap)) for expected, n in offers)
            rate = tokens / self.cost(sequences, rows)
            if rate > best_rate:
                best, best_rate = cap, rate
        if best == 0:  # one slow measure (a longer context since) must not stop checks for good
            self.skipped += 1
            best = 1 if self.skipped % self.EXPLORE == 0 else 0
        return best

    def cost(self, sequences: int, rows: int) -> float:
        plain = self.seconds[(sequences, sequences)]
        if (sequences, rows) in self.seconds:
            return self.seconds[(sequences, rows)]
        extra = [(s - plain) / (r - b) for (b, r), s in self.seconds.items() if b == sequences and r > b]
        row = sum(extra) / len(extra) if extra else self.FIRST_ROW_GUESS * plain
        return plain + max(0.0, row) * (rows - sequences)

    def note(self, pool, sequences: int, rows: int, seconds: float) -> None:
        self._same_pool(pool)
        shape = (sequences, rows)
        old = self.seconds.get(shape)
        self.seconds[shape] = seconds if old is None else old + self.WEIGHT * (seconds - old)

    def _same_pool(self, pool) -> None:
        if pool is not self.pool():
            self.pool, self.seconds = weakref.ref(pool), {}


def plan_checks(manager, runner, jobs: list, gate: CheckGate) -> None:
    """Proposals for the decoding ``jobs``, in turn, within the rows the batch runs compiled,
    as many of each checked as pays (``CheckGate``); what is not checked is scored by what comes."""
    if not fits(manager):
        return
    want = len(jobs) + sum(job.spec.k for job in jobs if job.spec is not None)
    rows = runner.check_rows(want) - len(jobs)  # a row each is taken
    offers = []
    for job in jobs:
        if job.spec is not None and rows > 0:
            proposed = propose(job, rows)
            if proposed:
                offers.append((job, proposed))
                rows -= len(proposed)
    if not offers:
        return
    cap = gate.cap(runner.kv, len(jobs), [(job.spec.expected, len(proposed)) for job, proposed in offers])
    for job, proposed in offers:
        if cap:
            plan_check(manager, job, proposed[:cap])
        else:
            job.spec.skip(proposed, len(job.seq))


def propose(job, rows: int) -> list[int]:
    """Up to ``rows`` tokens proposed to follow ``job``'s own, within its reply's room."""
    room = min(job.handle.request.sampling.max_new_tokens - len(job.generated), job.limit - len(job.seq)) - 1
    return job.spec.propose(job.seq.token_ids, len(job.generated), min(room, rows))


def plan_check(manager, job, proposed: list[int]) -> None:
    """``proposed`` appended to ``job``'s sequence and their blocks reserved; nothing where the
    pool has no room (a proposal never steps the pool down or preempts)."""
    seq, spec = job.seq, job.spec
    seq.token_ids.extend(proposed)
    try:
        manager.reserve(seq, len(seq))
    except PoolExhausted:
        del seq.token_ids[-len(proposed):]
        manager.shrink(seq)
        return
    spec.proposed = proposed
    window = seq.window
    # from the reply's own token: a failed step (``drop``) takes its row back too
    spec.saved = (window, window.save(len(seq) - len(proposed) - 1, len(seq))) if window is not None else None


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
