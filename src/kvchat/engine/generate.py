"""One request's life on the engine thread, a step at a time as the scheduler runs it: its prompt
fitted to the context, its cached prefix matched, the rest prefilled in chunks, then a token per
decode step, sampled and streamed until a stop. Every request ends with exactly one Finished or
Error, after its blocks went back (``Scheduler.retire``)."""
import time

from kvchat.core.events import Error, Finished, PrefillProgress, RequestHandle, Stats, TokenDelta
from kvchat.engine.chat import Stopped
from kvchat.engine.detok import StopChecker, StreamDetokenizer
from kvchat.engine.kv.manager import Sequence
from kvchat.engine.sampler import Sampler

NEW, PREFILL, DECODE, DONE = "new", "prefill", "decode", "done"


class Job:
    def __init__(self, engine, handle: RequestHandle):
        self.engine = engine  # a weak proxy (the scheduler's)
        self.handle = handle
        self.order = 0  # admission order, for choosing whom to preempt (set when admitted)
        self.phase = NEW
        self.seq: Sequence | None = None
        self.prompt_len = self.persona_len = self.target = self.limit = 0  # target: computed before a sample
        self.matched = False  # the cached prefix attached (at the first chunk: an earlier job's persona counts)
        self.stats = Stats()
        self.sampler = self.detok = self.stops = None
        self.text: list[str] = []
        self.generated: list[int] = []
        self.first_at: float | None = None
        self.last: Finished | Error | None = None
        self.requeued = False  # preempted at least once: its first match's figures stand
        self.wait_free: int | None = None  # gave its blocks back to wait: free blocks then
        self.evicted = 0  # cached blocks evicted while it ran, told when it ends

    def start(self) -> None:
        """Tokenize the prompt (no blocks yet). A request cancelled while it waited, or taken
        during a model switch, ends here untokenized."""
        e = self.engine
        if self.handle.cancelled or e.switching():
            return self.finish("cancelled")
        try:
            prompt, self.persona_len, trimmed = e.prompts.prompt_ids(self.handle.request,
                                                                     stop=lambda: self.handle.cancelled)
        except Stopped:
            return self.finish("cancelled")
        self.seq = Sequence(list(prompt))
        self.prompt_len = self.target = len(prompt)
        self.stats = Stats(prompt_tokens=len(prompt), trimmed_messages=trimmed)
        self.limit = e.prompts.context_limit()
        sampling = self.handle.request.sampling
        self.sampler = Sampler(sampling, device=e.loaded.device)
        self.detok, self.stops = StreamDetokenizer(e.loaded.tokenizer), StopChecker(sampling.stop)
        self.phase = PREFILL

    def prefill(self, budget: int) -> int:
        """Compute the next chunk, at most ``budget`` tokens; at the prompt's end, sample the first
        token. Returns the tokens computed; 0 when the job gave its blocks back to wait."""
        e, seq = self.engine, self.seq
        if not self.matched:
            self.matched = True
            ram, disk = e.kvpool.match(seq, self.persona_len)  # pool, RAM, disk
            if not self.requeued:
                self.stats.ram_tokens, self.stats.disk_tokens = ram, disk
                self.stats.cached_tokens = seq.num_computed
        start = seq.num_computed
        if start >= self.target:  # a preempted job whose context is all cached again
            self.phase = DECODE
            return 0
        first = not self.generated
        if first:
            self.handle.put(PrefillProgress(start, self.prompt_len))
        end = min(start + budget, self.target)
        persona = e.kvpool.ring_prefix.persona_end(seq, self.persona_len) if first else 0
        if start < persona < end:
            end = persona  # a windowed model's persona: its ring is copied there
        if not e.scheduler.reserve(self, end):  # may step the pool down: its runner is read after
            return 0
        logits = e.kvpool.runner.forward(seq, end, want_logits=first and end == self.target)
        e.kvpool.manager.commit(seq)
        if end == persona:
            e.kvpool.ring_prefix.persona_done(seq)
        if end == self.target:
            self.phase = DECODE
            if first:
                e.kvpool.ring_prefix.prompt_done(seq)
                self.handle.put(PrefillProgress(self.prompt_len, self.prompt_len))
                self.take(logits)
        return end - start

    def take(self, logits) -> None:
        """Sample the next token from ``logits`` and stream it; end the job at a stop."""
        seq, sampling = self.seq, self.handle.request.sampling
        token = self.sampler(logits, seq.token_ids)
        if self.first_at is None:
            self.first_at = time.perf_counter()
        seq.token_ids.append(token)
        self.generated.append(token)
        if token in self.engine.eos_ids and not sampling.ignore_eos:
            return self.finish("stop")
        delta = self.stops.feed(self.detok.add(token))
        self.text.append(delta)
        self.handle.put(TokenDelta(delta, token))
        if self.stops.stopped:
            return self.finish("stop")
        if len(self.generated) >= sampling.max_new_tokens or len(seq) >= self.limit:
            return self.finish("length")
        if self.handle.cancelled:
            self.finish("cancelled")

    def requeue(self) -> None:
        """Preempted: its blocks went back (their full ones stay findable in the prefix cache); it
        computes its context again when it runs next, and samples nothing until it has."""
        self.seq = Sequence(list(self.seq.token_ids))
        self.matched, self.phase, self.requeued = False, PREFILL, True
        self.target = len(self.seq) - 1 if self.generated else self.prompt_len

    def finish(self, reason: str) -> None:
        if self.stops is not None and not self.stops.stopped:
            tail = self.stops.flush()
            if tail:
                self.text.append(tail)
                self.handle.put(TokenDelta(tail, -1))
        stats, n = self.stats, len(self.generated)
        if self.first_at is not None:
            stats.ttft_ms = (self.first_at - self.handle.sent) * 1000
            stats.decode_tok_s = (n - 1) / (time.perf_counter() - self.first_at) if n > 1 else 0.0
        stats.generated_tokens = n
        stats.kv_precision = self.engine.precision.value
        self.end(Finished("".join(self.text), list(self.generated), reason, stats))

    def end(self, last: Finished | Error) -> None:
        self.last, self.phase = last, DONE
