"""The Engine: one background thread owns the model and the KV pool and serves queued requests."""
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import replace

import torch

from .block_pool import PoolExhausted
from .chat import ChatError, ChatFormatter
from .config import ConfigError, EngineConfig, Precision, SamplingParams
from .detok import StopChecker, StreamDetokenizer
from .events import EngineError, Error, Finished, LoadProgress, Notice, Request, RequestHandle, Stats, TokenDelta
from .kv_cache import KVShape, bytes_per_token
from .kv_manager import Sequence
from .kv_pool import KVPool, kv_dtype
from .memory import PREFIX_RESERVE, PRECISIONS, MemoryProbe, MemorySnapshot, activations_bytes
from .models import LoadedModel, ModelError, load
from .persona_store import PersonaStore
from .sampler import Sampler

log = logging.getLogger("kvchat.engine")
PRESSURE_SLACK = 256 << 20  # short by less (or an eighth of the pool): a module loaded late, not a program
SNAPSHOT_PERIOD = 1.0  # seconds between memory snapshots


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 persona_store: PersonaStore | None | bool = True, probe=None):
        self.config = config or EngineConfig()
        self.loaded = loaded
        self._store_arg = persona_store
        self.probe = probe
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.last_snapshot: MemorySnapshot | None = None
        self._listeners: list = []
        self._next_snapshot = 0.0
        self._handle: RequestHandle | None = None
        self._requests: queue.Queue = queue.Queue()
        self._cancel_load = threading.Event()
        self._warmed = self._fallback_told = False  # the decode step compiled once; its fallback told once
        self._thread = threading.Thread(target=self._main, name="kvchat-engine", daemon=True)
        self._thread.start()

    # -- public API, any thread --

    def submit(self, request: Request) -> RequestHandle:
        handle = RequestHandle(request)
        self._requests.put(handle)
        return handle

    def generate(self, messages: list[dict], **sampling) -> Finished:
        return self.submit(Request(messages=messages, sampling=SamplingParams(**sampling))).result()

    def reconfigure(self, max_context: int | None = None, kv_precision: str | None = None,
                    headroom_bytes: int | None = None) -> Future:
        """Change the context length, the KV precision or the memory headroom without reloading the
        weights: the pool is rebuilt and its cached blocks converted. Applied between requests, on
        the engine thread."""
        future = Future()
        self._requests.put((future, max_context, kv_precision, headroom_bytes))
        return future

    def add_listener(self, callback) -> None:
        """``callback(event)`` with MemorySnapshot (about once a second) and Notice events. It runs
        on the engine thread: it must only hand the event on (a queue, a queued Qt signal)."""
        self._listeners.append(callback)

    def cancel_load(self) -> None:
        """Stop a model download in progress; loading then fails with "download cancelled"."""
        self._cancel_load.set()

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self.ready.wait(timeout):
            raise EngineError("the model is still loading")
        if self.load_error:
            raise EngineError(self.load_error)

    def close(self) -> None:
        self._requests.put(None)
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def precision(self) -> Precision:
        return self.kvpool.precision

    pool = property(lambda self: self.kvpool.pool)
    manager = property(lambda self: self.kvpool.manager)
    kv = property(lambda self: self.kvpool.kv)
    runner = property(lambda self: self.kvpool.runner)
    personas = property(lambda self: self.kvpool.personas)

    # -- the engine thread --

    def _main(self) -> None:
        try:
            self._setup()
        except (ModelError, ConfigError, EngineError) as e:
            self.load_error = str(e)
        except Exception as e:  # never leave callers waiting on a thread that died
            log.exception("model load failed")
            self.load_error = f"model load failed: {e}"
        self.ready.set()
        while True:
            try:
                item = self._requests.get(timeout=SNAPSHOT_PERIOD)
            except queue.Empty:
                self._warm_decode()
                self._tick()
                continue
            if item is None:
                return
            if self.load_error:
                _fail(item, self.load_error)
            elif isinstance(item, tuple):
                self._control(*item)
            else:
                self._serve(item)
                self._report_fallback()
            self._tick()

    def _setup(self) -> None:
        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if self.loaded is None:
            self.loaded = load(cfg.model, cfg.device, cfg.dtype, cfg.weights, progress=self._load_progress,
                               decode=cfg.decode)
        if self._cancel_load.is_set():
            raise ModelError("loading cancelled")
        lm = self.loaded
        self.formatter = ChatFormatter(lm.tokenizer)
        self.eos_ids = eos_token_ids(lm)
        self.probe = self.probe or MemoryProbe(lm.device)
        self.weights_bytes = sum(t.numel() * t.element_size() for t in lm.model.state_dict().values())
        self.activations = activations_bytes(lm.model.config, cfg.prefill_chunk, lm.dtype.itemsize, cfg.max_context)
        self.auto = cfg.kv_precision == Precision.AUTO
        store = PersonaStore() if self._store_arg is True else (self._store_arg or None)
        precision, budget = self._initial_layout()
        self.kvpool = KVPool(lm, cfg.block_size, precision, budget, store, cfg.decode)

    def _initial_layout(self) -> tuple[Precision, int]:
        """The pool's precision and bytes. Auto starts at fp16, the best quality, in at most the bytes a
        full fp16 context needs, and steps down only when the conversation outgrows them (the
        planner's Auto pick is the forecast for a full context)."""
        cfg = self.config
        shape = KVShape.from_config(self.loaded.model.config)
        full = kv_dtype(self.loaded).itemsize
        precision = Precision.FP16 if self.auto else cfg.kv_precision
        if cfg.kv_budget_bytes is not None:
            return precision, cfg.kv_budget_bytes
        total, used = self.probe.totals()
        available = total - used - self.activations - cfg.headroom_bytes
        want = int(cfg.max_context * (1 + PREFIX_RESERVE) * bytes_per_token(shape, precision, full)) + 1
        if available <= 0:
            raise ConfigError("not enough free memory for a KV cache; lower the context or free memory")
        return precision, min(want, available)

    def _warm_decode(self) -> None:
        """Compile (or capture) the decode step in the first idle second, not in the first reply."""
        if self.load_error or self._warmed or not hasattr(self, "kvpool"):
            return
        self._warmed = True
        started = time.perf_counter()
        try:
            self.runner.step.warm_up(self.kv)
        except Exception:
            log.exception("warming up the decode step failed")
        log.info("decode step ready (%s) in %.1f s", self.runner.step.mode, time.perf_counter() - started)
        self._report_fallback()

    def _report_fallback(self) -> None:
        reason = self.runner.step.fallback
        if reason and not self._fallback_told:
            self._fallback_told = True
            self._notice("eager", reason)

    def _load_progress(self, done: int, total: int) -> None:
        """Called from the download's progress bars; raising here is how a download stops."""
        if self._cancel_load.is_set():
            raise ModelError("download cancelled")
        self._emit(LoadProgress(done, total))

    # -- memory: snapshots, pressure, reconfiguration --

    def _tick(self, live: list[Sequence] = ()) -> None:
        """About once a second: relieve memory pressure, then tell the listeners where memory goes."""
        now = time.monotonic()
        if now < self._next_snapshot or not hasattr(self, "kvpool"):
            return
        self._next_snapshot = now + SNAPSHOT_PERIOD
        try:
            total, used = self.probe.totals()
            other = max(0, used - self.probe.own())
            self._relieve_pressure(total, other, list(live))
            self.last_snapshot = snap = self._snapshot(total, other)
        except Exception:  # a probe failing must never stop the engine
            log.exception("memory probe failed")
            return
        self._emit(snap)

    def _kv_room(self, total: int, other: int) -> int:
        """Bytes the KV pool may take: what the device has, less everything else and the headroom."""
        return total - other - self.weights_bytes - self.activations - self.config.headroom_bytes

    def _snapshot(self, total: int, other: int) -> MemorySnapshot:
        pool = self.kvpool
        usage = pool.usage()
        kv_room = self._kv_room(total, other)
        free = kv_room + self.config.headroom_bytes - usage["kv_total"]
        room = max(usage["kv_total"], kv_room)  # what the pool could grow to now
        device = self.loaded.device
        return MemorySnapshot(
            device=str(device), total=total, other_processes=other, weights=self.weights_bytes,
            activations_reserve=self.activations, free=max(0, free), precision=pool.precision.value,
            max_context={p.value: pool.tokens_for(p, room) for p in PRECISIONS},
            on_cpu=device.type == "cpu", **usage)

    def _relieve_pressure(self, total: int, other: int, live: list[Sequence]) -> None:
        """Another process took memory: shrink the pool to give it back, stepping the precision down
        (Auto) so that what is in use still fits. Unreferenced cached blocks go first."""
        pool = self.kvpool
        allowed = self._kv_room(total, other)
        if allowed >= pool.budget - min(PRESSURE_SLACK, pool.budget // 8):
            return
        needed = (pool.pool.num_blocks - pool.pool.num_free) * pool.block_size
        old = pool.precision
        options = [p for p in PRECISIONS if PRECISIONS.index(p) >= PRECISIONS.index(old)] if self.auto else [old]
        fits = [p for p in options if allowed > 0 and pool.tokens_for(p, allowed) >= needed]
        # Auto keeps the context the user asked for when a lower precision can; else the most room
        full = [p for p in fits if pool.tokens_for(p, allowed) >= self.config.max_context]
        choice = full[0] if full else (fits[-1] if fits else None)
        if choice is not None and pool.rebuild(choice, allowed, live):
            if self.loaded.device.type == "cuda":
                torch.cuda.empty_cache()
            self._notice("shrink" if choice == old else "downshift",
                         f"another program took memory: KV cache now {allowed / 2**20:.0f} MiB"
                         + (f", {old.value} -> {choice.value}" if choice != old else ""))
            return
        self._notice("pressure", "memory is short and the KV cache cannot shrink further right now")

    def _control(self, future: Future, max_context, kv_precision, headroom_bytes) -> None:
        try:
            future.set_result(self._reconfigure(max_context, kv_precision, headroom_bytes))
        except (ConfigError, ValueError) as e:
            future.set_exception(ConfigError(str(e)))
        except Exception as e:
            log.exception("reconfigure failed")
            future.set_exception(EngineError(f"reconfigure failed: {e}"))

    def _reconfigure(self, max_context, kv_precision, headroom_bytes) -> dict:
        cfg, pool = self.config, self.kvpool
        new_cfg = replace(cfg, max_context=max_context or cfg.max_context,
                          kv_precision=kv_precision or cfg.kv_precision,
                          headroom_bytes=cfg.headroom_bytes if headroom_bytes is None else headroom_bytes)
        old_cfg, self.config = self.config, new_cfg
        self.auto = new_cfg.kv_precision == Precision.AUTO
        try:
            precision, budget = self._initial_layout()
        except ConfigError:
            self.config, self.auto = old_cfg, old_cfg.kv_precision == Precision.AUTO
            raise
        upward = PRECISIONS.index(precision) < PRECISIONS.index(pool.precision)
        if upward:
            pool.pool.clear_cache()  # lossy blocks must not pass for full-precision ones
        if not pool.rebuild(precision, budget):
            raise EngineError("the KV cache is in use and cannot be rebuilt now")
        self._next_snapshot = 0.0
        return {"kv_precision": precision.value, "max_context": new_cfg.max_context, "kv_budget": budget}

    def _notice(self, kind: str, message: str) -> None:
        notice = Notice(kind, message)
        log.info("%s: %s", kind, message)
        if self._handle is not None:
            self._handle.events.put(notice)
        self._emit(notice)

    def _emit(self, event) -> None:
        for callback in list(self._listeners):
            try:
                callback(event)
            except Exception:
                log.exception("an engine listener failed")

    def _serve(self, handle: RequestHandle) -> None:
        """Run one request; its blocks are released before the last event, so a caller that saw
        Finished or Error sees the pool as the engine leaves it."""
        seq, persona_len = None, 0
        self._handle = handle
        evictions = self.pool.evictions
        try:
            if handle.cancelled:  # cancelled while queued: not even tokenized
                last = Finished("", [], "cancelled", Stats(kv_precision=self.precision.value))
            else:
                prompt, persona_len, trimmed = self._prompt_ids(handle.request)
                seq = Sequence(list(prompt))
                last = self._generate(handle, seq, len(prompt), persona_len)
                last.stats.trimmed_messages = trimmed
        except (ChatError, ConfigError, PoolExhausted, EngineError) as e:
            last = Error(str(e))
        except Exception as e:
            log.exception("request failed")
            last = Error(f"internal error: {type(e).__name__}: {e}", internal=True)
        finally:
            if seq is not None:
                self._release(seq, persona_len)
            self._handle = None
        evicted = self.pool.evictions - evictions
        if evicted:
            self._notice("evict", f"{evicted} cached block(s) ({evicted * self.config.block_size} tokens of "
                                  "earlier prefixes) evicted to make room")
        handle.events.put(last)

    def _release(self, seq: Sequence, persona_len: int) -> None:
        """After the reply (never before the first token): pin and persist the persona, free blocks."""
        try:
            self.personas.remember(seq, persona_len)
        except Exception:
            log.exception("could not remember the persona")
        self.manager.free(seq)

    def context_limit(self) -> int:
        """Tokens a sequence may reach: the context setting, and what the pool holds at the lowest
        precision it may step down to."""
        pool = self.kvpool
        floor = Precision.INT4 if self.auto else pool.precision
        return min(self.config.max_context, pool.tokens_for(floor))

    def _prompt_ids(self, request: Request) -> tuple[list[int], int, int]:
        """The prompt's token ids, how many of them are the persona (the system message), and how
        many of the oldest messages were left out so that the rest fits the context."""
        limit = self.context_limit()
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            vocab = self.loaded.model.config.vocab_size
            if not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ChatError(f"prompt_ids must be a non-empty list of token ids below {vocab}")
            if len(ids) >= limit:
                raise EngineError(f"the prompt is {len(ids)} tokens, longer than the context of {limit}")
            return ids, 0, 0
        messages = request.messages
        room = min(request.sampling.max_new_tokens, limit // 4)
        encoded = self.formatter.encode(messages)
        trimmed = 0
        while len(encoded.token_ids) + room > limit:
            shorter = drop_oldest(messages)
            if shorter is None:
                raise EngineError(f"the prompt is {len(encoded.token_ids)} tokens, longer than the context of "
                                  f"{limit} (with room for a {room}-token reply)")
            trimmed += len(messages) - len(shorter)
            messages = shorter
            encoded = self.formatter.encode(messages)
        if trimmed:
            self._notice("trim", f"{trimmed} oldest message(s) are outside the context of {limit} tokens")
        persona_len = 0
        if messages[0]["role"] == "system":
            persona_len = encoded.message_starts[1] if len(messages) > 1 else encoded.prompt_start
        return encoded.token_ids, persona_len, trimmed

    def _reserve(self, seq: Sequence, tokens: int) -> None:
        """Blocks for ``tokens``; when the pool is full (unreferenced cached blocks already evicted),
        Auto steps the precision down and tries again."""
        while True:
            try:
                return self.manager.reserve(seq, tokens)
            except PoolExhausted:
                old = self.precision
                if not self.auto or self.kvpool.downshift([seq]) is None:
                    raise
                self._notice("downshift", f"KV cache full: {old.value} -> {self.precision.value}, "
                                          f"room for {self.kvpool.tokens_for(self.precision):,} tokens")

    def _generate(self, handle: RequestHandle, seq: Sequence, prompt_len: int, persona_len: int) -> Finished:
        cfg, sp = self.config, handle.request.sampling
        start = time.perf_counter()
        stats = Stats(prompt_tokens=prompt_len)
        limit = self.context_limit()
        self.manager.match_prefix(seq)
        self.personas.restore(seq, persona_len)
        stats.cached_tokens = seq.num_computed
        logits = None
        while seq.num_computed < prompt_len:
            if handle.cancelled:
                return Finished("", [], "cancelled", stats)
            end = min(seq.num_computed + cfg.prefill_chunk, prompt_len)
            self._reserve(seq, end)
            logits = self.runner.forward(seq, end, want_logits=end == prompt_len)
            self.manager.commit(seq)
        sampler = Sampler(sp, device=self.loaded.device)
        detok, stops = StreamDetokenizer(self.loaded.tokenizer), StopChecker(sp.stop)
        text, generated, reason = [], [], "length"
        first_at = None
        while True:
            seen = torch.tensor(seq.token_ids, device=logits.device) if sp.repetition_penalty != 1 else None
            token = sampler(logits, seen)
            if first_at is None:
                first_at = time.perf_counter()
            seq.token_ids.append(token)
            generated.append(token)
            if token in self.eos_ids and not sp.ignore_eos:
                reason = "stop"
                break
            delta = stops.feed(detok.add(token))
            text.append(delta)
            handle.events.put(TokenDelta(delta, token))
            if stops.stopped:
                reason = "stop"
                break
            if len(generated) >= sp.max_new_tokens or len(seq) >= limit:
                break
            if handle.cancelled:
                reason = "cancelled"
                break
            self._tick([seq])
            self._reserve(seq, len(seq))
            logits = self.runner.forward(seq, len(seq), want_logits=True)
            self.manager.commit(seq)
        if not stops.stopped:
            tail = stops.flush()
            if tail:
                text.append(tail)
                handle.events.put(TokenDelta(tail, -1))
        done = time.perf_counter()
        stats.ttft_ms = (first_at - start) * 1000
        stats.decode_tok_s = (len(generated) - 1) / (done - first_at) if len(generated) > 1 else 0.0
        stats.generated_tokens = len(generated)
        stats.kv_precision = self.precision.value
        return Finished("".join(text), generated, reason, stats)


def _fail(item, message: str) -> None:
    if isinstance(item, tuple):
        item[0].set_exception(EngineError(message))
    else:
        item.events.put(Error(message))


def drop_oldest(messages: list[dict]) -> list[dict] | None:
    """The conversation without its oldest exchange; the persona and the last message stay. None
    when nothing is left to drop."""
    head = 1 if messages[0]["role"] == "system" else 0
    if len(messages) - head <= 1:
        return None
    rest = messages[head + 1:]
    while len(rest) > 1 and rest[0]["role"] != "user":  # start the history on a user turn
        rest = rest[1:]
    return messages[:head] + rest


def eos_token_ids(lm: LoadedModel) -> set[int]:
    ids = set()
    for source in (lm.model.config, getattr(lm.model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
    if lm.tokenizer.eos_token_id is not None:
        ids.add(lm.tokenizer.eos_token_id)
    return ids
