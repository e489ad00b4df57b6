"""Which requests run in this engine step (vLLM v1's and nano-vllm's shape).

A step spends a budget of ``prefill_chunk`` tokens on one prompt still prefilling (the prompts
take turns: ``prefill.next_prompt``), then decodes one token of every running request in one
batched forward. Up to
``max_running`` requests run; the rest wait in order. A request that cannot get blocks while
others run gives its blocks back and waits (a prefill), or the newest other one is preempted (a
decode): its full blocks stay in the prefix cache, and it computes what they lost when it runs
again. A decoding reply's proposed tokens ride in the batch after its own (``speculation``).
Cancelled requests end at the next step. Nothing here survives a model switch: the engine runs a
switch, a reconfigure or a query only once no request runs."""
import logging
import threading
from collections import deque

from kvchat.core.config import ConfigError
from kvchat.core.events import EngineError, Error, Finished, Stats
from kvchat.core.memory_policy import StepDown
from kvchat.engine.chat import ChatError
from kvchat.engine.job import DECODE, DONE, NEW, PREFILL, Job
from kvchat.engine.kv.block_pool import PoolExhausted
from kvchat.engine.kv.rings import RingsExhausted
from kvchat.engine.model.step_plan import StepOutput, StepPlan
from kvchat.engine import prefill, speculation

log = logging.getLogger("kvchat.engine")


class Scheduler:
    def __init__(self, notice, prompts, switching):
        self.notice, self.prompts, self.switching = notice, prompts, switching  # the engine's, handed to jobs
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self._admitted = 0
        self._steps = 0
        self.preempted = 0  # jobs sent back to wait for blocks
        self.checks = speculation.CheckGate()
        self._lock = threading.Lock()  # the handles, which other threads cancel
        self._handles: set = set()

    def add(self, handle, session) -> None:
        with self._lock:
            self._handles.add(handle)
        self.waiting.append(Job(session, handle, self.prompts, self.switching))

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def handles(self) -> list:
        return [job.handle for job in self.running]

    def live(self) -> list:
        """The sequences holding blocks now (a pool rebuild keeps them)."""
        return [job.seq for job in self.running if job.seq is not None and job.seq.blocks]

    def cancel_all(self) -> None:
        """Any thread: each request ends at its next step."""
        with self._lock:
            handles = list(self._handles)
        for handle in handles:
            handle.cancel()

    def step(self, session) -> bool:
        """One step on ``session``'s pool; True when a token came (the engine then looks at memory
        and the compiles: after a first token, not before it)."""
        try:
            plan = self.schedule(session)
            if not plan.empty:
                self.postprocess(session, plan, session.kvpool.runner.execute(plan))
            return bool(plan.decode) or any(job.phase == DECODE for job in self.running)
        except Exception as error:  # a job's own failure ends that job (_guard); this is a last resort
            log.exception("engine step failed")
            for job in self.running:
                if job.last is None:
                    job.end(_error(error))
            self.retire()
            return False

    def schedule(self, session) -> StepPlan:
        """What this step computes, decided before anything runs: admissions, cancellations and
        every block the step writes (a full pool steps Auto down, preempts a newer reply or makes a
        prefill wait). The batch's blocks first, so a prefill that finds the pool full waits; the
        prefill's chunk runs before the batch's token: a request that comes while others decode
        waits for one forward less for its first token (bench api, 7 decoding: 2.10x an idle TTFT
        with the chunk after, 1.37x with it before), and the others still get a token a step."""
        s = session
        self._end_cancelled_waiting()
        self._admit(s)
        for job in self.running:
            if job.handle.cancelled and job.phase != DONE:
                self._guard(job, job.finish, "cancelled")
        self.retire()  # a reply that ended gives its blocks back before anyone asks for some
        decoding = [job for job in self.running if job.phase == DECODE]
        self._reserve_tokens(decoding)
        self.retire()  # one that could not fit even alone gives its blocks back before the prefill
        chunk = None
        self._steps += 1
        prefilling = prefill.next_prompt(self.running, self._steps)
        if prefilling is not None:
            planned = []
            self._guard(prefilling, lambda: planned.append(
                prefill.plan_chunk(s.kvpool, prefilling, s.config.prefill_chunk, self.reserve)))
            chunk = planned[0] if planned else None
            self.retire()
            self._reserve_tokens(decoding)  # kept by a rebuild the chunk's reservation made; a no-op
        decoding = [job for job in decoding if job.phase == DECODE and job in self.running]  # not preempted
        speculation.plan_checks(s.kvpool.manager, s.kvpool.runner, decoding, self.checks)
        return StepPlan(chunk, tuple(job.seq for job in decoding))

    def postprocess(self, session, plan: StepPlan, out: StepOutput) -> None:
        """The blocks the step filled become findable, a windowed persona's or prompt's ring is
        kept, and each job samples and streams its token; a failure ends its own job."""
        kvpool = session.kvpool
        owner = {id(job.seq): job for job in self.running if job.seq is not None}
        if plan.chunk is not None:
            job = owner[id(plan.chunk.seq)]
            if out.chunk_error is not None:
                job.end(_error(out.chunk_error))
            else:
                self._guard(job, prefill.prefilled, kvpool, job, plan.chunk, out.chunk_logits)
            self.retire()
        jobs = [owner[id(seq)] for seq in plan.decode]
        manager = kvpool.manager
        if out.decode_error is not None:
            for job in jobs:
                speculation.drop(manager, job)
            if len(jobs) == 1:
                jobs[0].end(_error(out.decode_error))
            else:  # one row's failure (a window the op refuses) must not end the others
                for job in jobs:
                    self._guard(job, self._decode_alone, job)
        elif jobs:
            at = 0
            for job in jobs:
                n = speculation.rows(job)
                logits, at = out.decode_logits[at:at + n], at + n
                if n > 1:
                    self._guard(job, speculation.take_checked, manager, job, logits)
                else:
                    manager.commit(job.seq)  # a block it filled is findable by the next request
                    self._guard(job, job.take, logits[0])
            if plan.chunk is None:  # a step with a prefill chunk is no measure of its rows
                self.checks.note(kvpool.kv, len(jobs), at, out.decode_seconds)
        self.retire()

    def _end_cancelled_waiting(self) -> None:
        for job in [job for job in self.waiting if job.handle.cancelled]:
            self.waiting.remove(job)
            if job.last is None:
                job.finish("cancelled")
            self._put_last(job)

    def _admit(self, session) -> None:
        pool = session.kvpool.blocks
        while self.waiting and len(self.running) < session.config.max_running:
            job = self.waiting[0]
            if job.wait_free is not None and self.running and pool.num_free <= job.wait_free:
                return  # it gave its blocks back to wait: until some more are free, it would only fail again
            self.waiting.popleft()
            job.wait_free = None
            self.running.append(job)  # first: a notice its prompt gives (a trim) reaches it
            if job.phase == NEW:
                self._admitted += 1
                job.order = self._admitted
                self._guard(job, job.start)

    def _reserve_tokens(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.phase == DECODE:  # not preempted for one before it
                self._guard(job, self.reserve, job, len(job.seq))

    def _decode_alone(self, job: Job) -> None:
        kvpool = job.session.kvpool
        out = kvpool.runner.execute(StepPlan(decode=(job.seq,)))
        if out.decode_error is not None:
            raise out.decode_error
        kvpool.manager.commit(job.seq)
        job.take(out.decode_logits[0])

    def reserve(self, job: Job, tokens: int) -> bool:
        """Blocks for ``job`` up to ``tokens``. When the pool is full (unreferenced cached blocks
        already evicted): Auto steps the precision down; else a prefilling job waits for the
        others, or the newest other running job is preempted for a decoding one. False when
        ``job`` itself went back to wait; PoolExhausted when it cannot fit even alone."""
        s = job.session
        kvpool = s.kvpool
        while True:
            try:
                kvpool.manager.reserve(job.seq, tokens)
                return True
            except PoolExhausted as full:
                old = kvpool.precision
                rings = isinstance(full, RingsExhausted)  # a lower precision frees no ring
                step = s.policy.when_full(old, rings, kvpool.kv.whole())
                if isinstance(step, StepDown) and kvpool.rebuild(step.precision, kvpool.budget, self.live()):
                    new = kvpool.precision
                    self.notice("downshift", f"KV cache full: {old.value} -> {new.value}, "
                                             f"room for {kvpool.tokens_for(new):,} tokens")
                    continue
                others = [j for j in self.running if j is not job and j.phase != DONE and j.seq is not None
                          and j.seq.blocks and (j.seq.ring or not rings)]  # only a ring frees a ring
                if not others:
                    raise
                victim = job if job.phase == PREFILL else max(others, key=lambda j: j.order)
                self._preempt(victim)
                if victim is job:
                    return False

    def _preempt(self, job: Job) -> None:
        kvpool = job.session.kvpool
        kvpool.manager.free(job.seq)
        self.preempted += 1
        job.requeue()
        job.wait_free = kvpool.blocks.num_free
        self.running.remove(job)
        self.waiting.appendleft(job)
        log.info("request %d waits for KV blocks (%d tokens to compute again)", job.order, len(job.seq) - 1)

    def retire(self) -> None:
        """Ended jobs leave: blocks released before the last event, so a caller that saw Finished
        or Error sees the pool as the engine leaves it."""
        for job in [job for job in self.running if job.phase == DONE]:
            self.running.remove(job)
            try:
                if job.seq is not None and job.seq.blocks:
                    job.session.kvpool.release(job.seq, job.persona_len)
            except Exception as error:  # its last event still goes out
                job.end(_error(error))
            finally:
                if job.evicted:
                    tokens = job.evicted * job.session.config.block_size
                    self.notice("evict", f"{job.evicted} cached block(s) ({tokens} tokens of "
                                         "earlier prefixes) evicted to make room")
                self._put_last(job)

    def _put_last(self, job: Job) -> None:
        with self._lock:
            self._handles.discard(job.handle)
        job.handle.put(job.last)

    def end_all(self, reason: str) -> None:
        """The engine is stopping: a request that never started is refused with ``reason``; one
        that did ends as cancelled, if nothing ended it."""
        self.refuse_waiting(reason)
        for job in (*self.running, *self.waiting):
            if job.last is None:
                job.end(Finished("", list(job.generated), "cancelled", Stats()))
            job.handle.put(job.last)
        self.running.clear()
        self.waiting.clear()
        with self._lock:
            self._handles.clear()

    def refuse_waiting(self, reason: str) -> None:
        """Requests that never started are refused (a shutdown), not ended as cancelled replies."""
        for job in [job for job in self.waiting if job.phase == NEW]:
            self.waiting.remove(job)
            with self._lock:
                self._handles.discard(job.handle)
            job.handle.refuse(reason)

    def _guard(self, job: Job, fn, *args) -> bool:
        """``fn(*args)`` for one job; a failure ends that job only. True when it ran through. The
        cached blocks its allocations evicted are counted on it, told once when it ends."""
        pool = job.session.kvpool.blocks
        evictions = pool.evictions
        try:
            fn(*args)
            return True
        except Exception as error:
            job.end(_error(error))
            return False
        finally:
            job.evicted += pool.evictions - evictions


def _error(error: Exception) -> Error:
    if isinstance(error, (ChatError, ConfigError, PoolExhausted, EngineError)):
        return Error(str(error))
    log.error("request failed", exc_info=error)
    return Error(f"internal error: {type(error).__name__}: {error}", internal=True)
