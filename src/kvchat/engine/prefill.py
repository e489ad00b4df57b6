"""A reply's prompt as the scheduler plans it, chunk by chunk: the cached prefix matched at the
first chunk (pool, RAM, disk; an earlier reply's persona counts), the rest in chunks of at most
the step's budget, a windowed model's persona ending a chunk (its ring is copied there), and the
first token sampled from the last chunk's logits. A client's prediction (OpenAI's Predicted
Outputs) rides in that last chunk: its first tokens are checked with the prompt's end, in the same
forward. Prompts take turns a chunk a step."""
from kvchat.engine import speculation
from kvchat.engine.job import DECODE, PREFILL
from kvchat.engine.model.step_plan import Chunk


def next_prompt(running: list, step: int):
    """The job whose prompt gets this step's chunk: the one whose last chunk ran longest ago, a new
    one before all. Prefilled oldest first to its end, a 6,400-token prompt held a short question
    back for all of its chunks: 13.4 s against 40 ms idle (starter, AVX-512)."""
    job = min((j for j in running if j.phase == PREFILL), key=lambda j: (j.chunked_at, j.order), default=None)
    if job is not None:
        job.chunked_at = step
    return job


def plan_chunk(kvpool, job, budget: int, reserve) -> Chunk | None:
    """The next chunk of ``job``'s prompt, its blocks reserved by ``reserve(job, end)`` (the
    scheduler's: it may step the pool down, preempt, or make ``job`` wait: False); None when
    there is nothing to compute or it went back to wait."""
    seq = job.seq
    if not job.matched:
        job.matched = True
        ram, disk = kvpool.match(seq, job.persona_len)
        if not job.requeued:
            job.stats.ram_tokens, job.stats.disk_tokens = ram, disk
            job.stats.cached_tokens = seq.num_computed
    start = seq.num_computed
    if start >= job.target:  # a preempted job whose context is all cached again
        job.phase = DECODE
        return None
    first = not job.generated
    if first:
        job.progress(start)
    end = min(start + budget, job.target)
    job.persona_end = kvpool.ring_prefix.persona_end(seq, job.persona_len) if first else 0
    if start < job.persona_end < end:
        end = job.persona_end
    if not reserve(job, end):
        return None
    last = first and end == job.target
    checked = predicted(kvpool, job) if last else 0
    return Chunk(seq, end + checked, want_logits=checked + 1 if checked else last)


def predicted(kvpool, job) -> int:
    """The prediction's first tokens appended to the prompt, their blocks reserved, to be checked
    in its last chunk; how many (0: none). Only where the pool keeps no full-precision window and
    no rings, whose rows a rejected token would overwrite (there the first check comes a step later,
    in the decode batch, which saves and restores them)."""
    spec = job.spec
    if spec is None or not spec.predicted or kvpool.kv.format.quantized or kvpool.rings is not None:
        return 0
    proposed = speculation.propose(job, speculation.STEPS[-1])
    if proposed:
        speculation.plan_check(kvpool.manager, job, proposed)
    return len(spec.proposed)


def prefilled(kvpool, job, chunk: Chunk, logits) -> None:
    """The chunk was computed: its full blocks findable, a persona's or prompt's ring kept, and
    at the prompt's end the first token, and the predicted tokens after it that the model agrees with."""
    seq = job.seq
    checked = chunk.want_logits - 1 if type(chunk.want_logits) is int else 0  # predicted tokens in it
    seq.num_computed -= checked  # the prompt's rows; a predicted one counts once it is kept
    kvpool.manager.commit(seq)
    end = chunk.end - checked
    if end == job.persona_end:
        kvpool.ring_prefix.persona_done(seq)
    if end == job.target:
        job.phase = DECODE
        if chunk.want_logits:
            kvpool.ring_prefix.prompt_done(seq)
            job.progress(job.prompt_len)
            if checked:
                speculation.take_checked(kvpool.manager, job, logits)
            else:
                job.take(logits)
