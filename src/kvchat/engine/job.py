"""One request's life on the engine thread, a step at a time as the scheduler runs it: its prompt
fitted to the context; the scheduler plans its chunks and decode tokens (its cached prefix matched
first), the runner computes them, and the job samples and streams each token until a stop. Every
request ends with exactly one Finished or Error, after its blocks went back (``Scheduler.retire``)."""
import time

from kvchat.core.events import Error, Finished, PrefillProgress, RequestHandle, Stats, TokenDelta
from kvchat.engine.chat import Stopped
from kvchat.engine.detok import StopChecker, StreamDetokenizer
from kvchat.engine.kv.manager import Sequence
from kvchat.engine.sampler import Sampler
from kvchat.engine.speculation import Speculator

NEW, PREFILL, DECODE, DONE = "new", "prefill", "decode", "done"


class Job:
    def __init__(self, session, handle: RequestHandle, prompts, switching):
        self.session = session  # what it runs on: a session is swapped only while no request runs
        self.prompts = prompts  # the engine's PromptBuilder
        self.switching = switching  # () -> True when a shutdown or another model is on its way
        self.handle = handle
        self.order = 0  # admission order, for choosing whom to preempt (set when admitted)
        self.phase = NEW
        self.seq: Sequence | None = None
        self.prompt_len = self.persona_len = self.target = self.limit = 0  # target: computed before a sample
        self.matched = False  # the cached prefix attached (at the first chunk: an earlier job's persona counts)
        self.persona_end = 0  # where the planned chunk's windowed persona ends (0: none in it)
        self.chunked_at = 0  # the scheduler's step when its prompt's last chunk was planned (prefill.next_prompt)
        self.stats = Stats()
        self.sampler = self.detok = self.stops = None
        self.text: list[str] = []
        self.generated: list[int] = []
        self.first_at: float | None = None
        self.last: Finished | Error | None = None
        self.requeued = False  # preempted at least once: its first match's figures stand
        self.wait_free: int | None = None  # gave its blocks back to wait: free blocks then
        self.evicted = 0  # cached blocks evicted while it ran, told when it ends
        self.spec: Speculator | None = None  # where speculation is on

    def start(self) -> None:
        """Tokenize the prompt (no blocks yet). A request cancelled while it waited, or taken
        during a model switch, ends here untokenized."""
        s = self.session
        if self.handle.cancelled or self.switching():
            return self.finish("cancelled")
        try:
            prompt, self.persona_len, trimmed = self.prompts.prompt_ids(s, self.handle.request,
                                                                        stop=lambda: self.handle.cancelled)
        except Stopped:
            return self.finish("cancelled")
        self.seq = Sequence(list(prompt))
        self.prompt_len = self.target = len(prompt)
        self.stats = Stats(prompt_tokens=len(prompt), trimmed_messages=trimmed)
        self.limit = s.context_limit()
        sampling = self.handle.request.sampling
        self.sampler = Sampler(sampling, device=s.loaded.device)
        self.detok, self.stops = StreamDetokenizer(s.loaded.tokenizer), StopChecker(sampling.stop)
        if s.config.speculate and sampling.speculate:
            text = self.handle.request.prediction
            predicted = s.loaded.tokenizer.encode(text, add_special_tokens=False) if text else None
            self.spec = Speculator(predicted[:sampling.max_new_tokens] if predicted else None)
        self.phase = PREFILL

    def progress(self, computed: int) -> None:
        self.handle.put(PrefillProgress(computed, self.prompt_len))

    def take(self, logits, proposed: int | None = None) -> int:
        """Sample the next token from ``logits`` (``proposed``: the token proposed for this place)
        and stream it; end the job at a stop. Returns the token."""
        seq, sampling = self.seq, self.handle.request.sampling
        token = self.sampler(logits, seq.token_ids, proposed)
        if self.first_at is None:
            self.first_at = time.perf_counter()
        seq.token_ids.append(token)
        self.generated.append(token)
        if token in self.session.eos_ids and not sampling.ignore_eos:
            self.finish("stop")
            return token
        delta = self.stops.feed(self.detok.add(token))
        self.text.append(delta)
        self.handle.put(TokenDelta(delta, token))
        if self.stops.stopped:
            self.finish("stop")
        elif len(self.generated) >= sampling.max_new_tokens or len(seq) >= self.limit:
            self.finish("length")
        elif self.handle.cancelled:
            self.finish("cancelled")
        return token

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
        stats.kv_precision = self.session.precision.value
        self.end(Finished("".join(self.text), list(self.generated), reason, stats))

    def end(self, last: Finished | Error) -> None:
        self.last, self.phase = last, DONE
