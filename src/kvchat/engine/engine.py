"""The Engine: one long-lived actor. Its thread owns the model, the KV pool and every change to
them, and takes typed commands (Submit, Cancel, Reconfigure, LoadModel, Shutdown) from one queue;
each command's future always resolves."""
import ctypes
import gc
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, replace

import torch

from kvchat.engine.kv.block_pool import PoolExhausted
from kvchat.engine.chat import ChatError, ChatFormatter, longest_content
from kvchat.core.commands import Cancel, Command, LoadModel, Reconfigure, Refused, Shutdown, Submit, Tokenize, refuse
from kvchat.core.config import ConfigError, EngineConfig, Precision, SamplingParams
from kvchat.engine.detok import StopChecker, StreamDetokenizer
from kvchat.core.events import (EngineError, Error, Finished, LoadFailed, LoadProgress, ModelReady, Notice, Reconfigured,
                     Request, RequestHandle, Stats, TokenDelta)
from kvchat.core.kv_sizes import KVShape, bytes_per_token, config_value
from kvchat.engine.kv.manager import Sequence
from kvchat.engine.kv.pool import KVPool, kv_dtype
from kvchat.core.memory import PREFIX_RESERVE, PRECISIONS, MemorySnapshot, activations_bytes
from kvchat.engine.memory_probe import MemoryProbe
from kvchat.engine.model.loading import LoadedModel, ModelError, load
from kvchat.engine.kv.persona_store import PersonaStore
from kvchat.engine.sampler import Sampler
from kvchat.engine.model.weights import warm_up as warm_weights

log = logging.getLogger("kvchat.engine")
PRESSURE_SLACK = 256 << 20  # short by less (or an eighth of the pool): a module loaded late, not a program
SNAPSHOT_PERIOD = 1.0  # seconds between memory snapshots
CLOSE_TIMEOUT = 2.0  # seconds close() waits for the current step to end


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 persona_store: PersonaStore | None | bool = True, probe=None):
        self.config = config or EngineConfig()
        self.loaded: LoadedModel | None = None
        self.kvpool: KVPool | None = None
        self._store_arg = persona_store
        self._given_probe = probe
        self.probe = probe
        self.ready = threading.Event()  # set while no load is under way
        self.load_error: str | None = None  # why no model is loaded, when none is
        self.last_snapshot: MemorySnapshot | None = None
        self._listeners: list = []
        self._status: ModelReady | LoadFailed | None = None  # how the last load ended
        self._next_snapshot = 0.0
        self._handle: RequestHandle | None = None
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders _closed against puts, so no command is queued after the drain
        self._closed = False
        self._stopping = threading.Event()
        self._load_seq = self._cancelled_load = self._model_seq = 0  # the newest LoadModel asked for; the newest one cancelled
        self._good: tuple[EngineConfig, LoadedModel | None] | None = None  # what a failed switch goes back to
        self._warmed = self._fallback_told = False  # the decode step compiled once; its fallback told once
        self.load_model(self.config, loaded)
        self._thread = threading.Thread(target=self._main, name="kvchat-engine", daemon=True)
        self._thread.start()

    # -- public API, any thread: each call only queues a command or sets a flag --

    def submit(self, request: Request, listener=None) -> RequestHandle:
        """``listener(event)``, when given, sees the request's events on the engine thread."""
        handle = RequestHandle(request, listener)
        self._put(Submit(handle))
        return handle

    def generate(self, messages: list[dict], **sampling) -> Finished:
        return self.submit(Request(messages=messages, sampling=SamplingParams(**sampling))).result()

    def tokenize(self, text: str) -> Future:
        """A plain prompt's token ids (the API's /v1/completions), or ChatError when it cannot fit."""
        return self._put(Tokenize(text))

    def cancel(self, handle: RequestHandle) -> Future:
        """Stop a request at its next step (or before it starts); an API client that hung up calls
        this. The future resolves once the engine thread has seen it."""
        handle.cancel()
        return self._put(Cancel(handle))

    def reconfigure(self, max_context: int | None = None, kv_precision: str | None = None,
                    headroom_bytes: int | None = None) -> Future:
        """Change the context length, the KV precision or the memory headroom without reloading the
        weights: the pool is rebuilt and its cached blocks converted. Applied between requests, on
        the engine thread; the future gives the applied settings, or why not."""
        return self._put(Reconfigure(max_context, kv_precision, headroom_bytes))

    def load_model(self, config: EngineConfig, loaded: LoadedModel | None = None) -> Future:
        """Switch to another model: what runs is cancelled, the current model is dropped before the
        new one loads, and a failure brings it back. A later call replaces a load still under way."""
        with self._lock:
            self._load_seq += 1
            command = LoadModel(config, loaded, self._load_seq)
        self._cancel_running()
        return self._put(command)

    def persona_state(self, system_prompt: str) -> str:
        """Is this persona's prefix warm (``persona_probe``): the badge's question, asked off the
        engine thread."""
        from kvchat.engine.kv.persona_probe import engine_persona_state

        return engine_persona_state(self, system_prompt)

    def cancel_load(self) -> None:
        """Stop the model load under way or queued (a download stops at its next chunk); the
        previous model comes back."""
        self._cancelled_load = self._load_seq

    def add_listener(self, callback, replay: bool = False) -> None:
        """``callback(event)`` with MemorySnapshot (about once a second), Notice, LoadProgress,
        ModelReady, LoadFailed and Reconfigured events. It runs on the engine thread: it must only
        hand the event on (a queue, a queued Qt signal). With ``replay``, a listener that comes
        after the last load ended gets its ModelReady or LoadFailed at once (on this thread)."""
        with self._lock:
            self._listeners.append(callback)
            status = self._status if replay else None
        if status is not None:
            callback(status)

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self.ready.wait(timeout):
            raise EngineError("the model is still loading")
        if self.load_error:
            raise EngineError(self.load_error)

    def shutdown(self) -> Future:
        """Cancel what runs, refuse what is queued, stop the thread after the current step."""
        self._stopping.set()
        self._cancel_running()
        return self._put(Shutdown())

    def close(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Shut down and wait up to ``timeout`` seconds; True when the thread has ended."""
        self.shutdown()
        self._thread.join(timeout)
        return not self._thread.is_alive()

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

    def _put(self, command: Command) -> Future:
        with self._lock:
            if not self._closed:
                self._commands.put(command)
                return command.future
        refuse(command, "the engine is shut down")
        return command.future

    def _cancel_running(self) -> None:
        handle = self._handle
        if handle is not None:
            handle.cancel()

    # -- the engine thread --

    def _main(self) -> None:
        try:
            while True:
                try:
                    command = self._commands.get(timeout=SNAPSHOT_PERIOD)
                except queue.Empty:
                    self._idle()
                    continue
                if isinstance(command, Shutdown):
                    return self._shutdown(command)
                self._run(command)
                self._tick()
        finally:  # even a bug here leaves no caller waiting
            with self._lock:
                self._closed = True
            self._refuse_queued("the engine has stopped")
            self.ready.set()

    def _run(self, command: Command) -> None:
        if self._stopping.is_set():
            return refuse(command, "the engine is shutting down")
        if isinstance(command, LoadModel):
            return self._load(command)
        if isinstance(command, Cancel):
            command.handle.cancel()
            return command.future.set_result(True)
        if self.kvpool is None:
            return refuse(command, self.load_error or "no model is loaded")
        if isinstance(command, Tokenize):
            return self._tokenize(command)
        try:
            if isinstance(command, Submit):
                self._warm_decode()  # a first request before an idle second: warned the same
                self._serve(command.handle)
                self._report_fallback()
            else:
                self._control(command)
        except Exception as e:  # _serve and _control resolve their own; this is a last resort
            log.exception("command failed")
            _fail(command, f"internal error: {type(e).__name__}: {e}")

    def _idle(self) -> None:
        self._warm_decode()
        self._tick()

    def _shutdown(self, command: Shutdown) -> None:
        with self._lock:
            self._closed = True
        self._refuse_queued("the engine is shut down")
        command.future.set_result(None)  # the model stays readable (stats, tests); the process is ending

    def _refuse_queued(self, reason: str) -> None:
        while True:
            try:
                refuse(self._commands.get_nowait(), reason)
            except queue.Empty:
                return

    # -- loading and dropping models --

    def _load(self, command: LoadModel) -> None:
        """Drop the model, load the new one; on failure load the previous one again."""
        if self._superseded(command.seq):
            return refuse(command, "replaced by a later model choice")
        self.ready.clear()
        try:
            self._drop_model()
            try:
                self._start(command.config, command.loaded, command.seq)
            except Exception as e:
                return self._load_failed(command, _load_failure(e))
            self._good = (self.config, command.loaded)
            self.load_error = None
            settings = self.settings()
            command.future.set_result(settings)
            self._announce(ModelReady(self.loaded.source.label, settings, self.loaded.model.config,
                                      generation_settings(self.loaded.model)))
        finally:
            if not self._superseded(command.seq):  # else the newer load sets it when it ends
                self._model_seq = command.seq
                self.ready.set()

    def _superseded(self, seq: int) -> bool:
        return seq < self._load_seq

    def _switching(self) -> bool:
        """A shutdown or a newer model is on its way: a request taken now is cancelled at once."""
        return self._stopping.is_set() or self._load_seq > self._model_seq

    def _stop_loading(self, seq: int | None) -> str | None:
        if seq is None:  # bringing the previous model back: nothing stops that
            return None
        if seq < self._load_seq:
            return "replaced by a later model choice"
        if seq <= self._cancelled_load:
            return "loading cancelled"
        return None

    def _load_failed(self, command: LoadModel, reason: str) -> None:
        self._drop_model(check=False)
        if self._superseded(command.seq):
            return refuse(command, "replaced by a later model choice")
        restored = self._good is not None and self._restore()
        message = reason + ("; the previous model is back" if restored else "")
        self.load_error = None if restored else reason
        command.future.set_exception(EngineError(message))
        self._announce(LoadFailed(message, self.settings() if restored else None))

    def _restore(self) -> bool:
        config, loaded = self._good
        try:
            self._start(config, loaded, None)
        except Exception as e:
            log.exception("the previous model could not be loaded again")
            self._drop_model(check=False)
            self._good = None
            self._notice("load", f"the previous model could not be loaded again: {_load_failure(e)}")
            return False
        return True

    def _start(self, config: EngineConfig, loaded: LoadedModel | None, seq: int | None) -> None:
        """Load the model (unless given) and build its pool; raises with the reason."""
        self.config = cfg = config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        progress = lambda done, total, stage: self._load_progress(seq, done, total, stage)
        lm = loaded or load(cfg.model, cfg.device, cfg.dtype, cfg.weights, progress=progress, decode=cfg.decode)
        why = self._stop_loading(seq)
        if why:
            raise ModelError(why)
        self.loaded = lm
        self.formatter = ChatFormatter(lm.tokenizer)
        self.eos_ids = eos_token_ids(lm)
        self.probe = self._given_probe or MemoryProbe(lm.device)
        self.weights_bytes = sum(t.numel() * t.element_size() for t in lm.model.state_dict().values())
        self.activations = activations_bytes(lm.model.config, cfg.prefill_chunk, lm.dtype.itemsize, cfg.max_context)
        self.config = cfg = self._capped(cfg)
        self.auto = cfg.kv_precision == Precision.AUTO
        store = PersonaStore() if self._store_arg is True else (self._store_arg or None)
        precision, budget = self._layout(cfg)
        self.kvpool = KVPool(lm, cfg.block_size, precision, budget, store, cfg.decode)
        self._warmed = self._fallback_told = False
        self._next_snapshot = 0.0

    def _drop_model(self, check: bool = True) -> None:
        """Let go of the model and the pool and give their memory back before anything new loads.
        With ``check``, the probe must see most of it return, or the user is told."""
        if self.loaded is None and self.kvpool is None:
            return
        expected = getattr(self, "weights_bytes", 0) + (self.kvpool.kv.nbytes if self.kvpool else 0)
        ours = check and self._good is not None and self._good[1] is None  # not a model a caller still holds
        before = self.probe.own() if ours else 0
        self.kvpool = self.loaded = self.formatter = None
        self._handle = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        _trim_heap()
        if ours:
            freed = before - self.probe.own()
            if freed < expected // 2:
                self._notice("memory", f"the previous model's memory did not all come back: "
                                       f"{freed / 2**20:.0f} of {expected / 2**20:.0f} MiB freed")

    def settings(self) -> dict:
        """The config as the GUI shows it, plain values only."""
        out = asdict(self.config)
        out["kv_precision"] = self.config.kv_precision.value
        if self.kvpool is not None:
            out["precision"] = self.kvpool.precision.value
        return out

    def _capped(self, cfg: EngineConfig) -> EngineConfig:
        """The context is capped at what the model was trained for, unless the config allows more."""
        trained = config_value(self.loaded.model.config, "max_position_embeddings")
        if not trained or cfg.max_context <= trained:
            return cfg
        if cfg.allow_long_context:
            self._notice("context", f"{cfg.max_context:,} tokens is longer than the {trained:,} "
                                    "the model was trained for: expect worse answers past that")
            return cfg
        self._notice("context", f"{cfg.max_context:,} tokens capped at {trained:,}, the length the model was "
                                "trained for")
        return replace(cfg, max_context=trained)

    def _layout(self, cfg: EngineConfig) -> tuple[Precision, int]:
        """The pool's precision and bytes, sized from the context (never from all that is free).
        Auto starts at fp16, the best quality, in at most the bytes a full fp16 context needs, and
        steps down when the conversation outgrows them or memory runs short."""
        precision = Precision.FP16 if cfg.kv_precision == Precision.AUTO else cfg.kv_precision
        if cfg.kv_budget_bytes is not None:
            return precision, cfg.kv_budget_bytes
        total, used = self.probe.totals()
        available = total - used - self.activations - cfg.headroom_bytes
        if available <= 0:
            raise ConfigError("not enough free memory for a KV cache; lower the context or free memory")
        want = self._kv_bytes(cfg.max_context, precision)
        lowest = Precision.INT4 if cfg.kv_precision == Precision.AUTO else precision  # Auto steps down to it
        need = self._kv_bytes(cfg.max_context, lowest)
        if need > available:
            raise ConfigError(f"a context of {cfg.max_context:,} tokens needs {need / 2**20:,.0f} MiB of KV cache at "
                              f"{lowest.value}; {available / 2**20:,.0f} MiB are free: lower the context"
                              + ("" if lowest == Precision.INT4 else " or the precision"))
        return precision, min(want, available)

    def _kv_bytes(self, context: int, precision: Precision) -> int:
        """What a pool for ``context`` tokens plus the prefix-cache reserve takes."""
        shape = KVShape.from_config(self.loaded.model.config)
        per_token = bytes_per_token(shape, precision, kv_dtype(self.loaded).itemsize)
        return int(context * (1 + PREFIX_RESERVE) * per_token) + 1

    def _warm_decode(self) -> None:
        """Compile (or capture) the decode step in the first idle second, not in the first reply."""
        if self.kvpool is None or self._warmed:
            return
        self._warmed = True
        started = time.perf_counter()
        # compiling on the CPU takes a minute or more the first time: a message sent meanwhile
        # waits, and the user should know why (a CUDA capture takes a second)
        told = self.runner.step.captured and self.loaded.device.type == "cpu"
        if told:
            self._notice("warm-up", "preparing fast decoding (a minute or two the first time, seconds after)")
        try:
            self.runner.step.warm_up(self.kv)
            warm_weights(self.loaded.model)
        except Exception:
            log.exception("warming up the decode step failed")
        elapsed = time.perf_counter() - started
        log.info("decode step ready (%s) in %.1f s", self.runner.step.mode, elapsed)
        if told and self.runner.step.captured:
            self._notice("warm-up", f"fast decoding ready ({elapsed:.0f} s)")
        self._report_fallback()

    def _report_fallback(self) -> None:
        reason = self.runner.step.fallback if self.kvpool is not None else None
        if reason and not self._fallback_told:
            self._fallback_told = True
            self._notice("eager", reason)

    def _load_progress(self, seq: int | None, done: int, total: int, stage: str) -> None:
        """Called by a download after each chunk and a GGUF conversion after each tensor; raising
        here is how they stop."""
        why = self._stop_loading(seq)
        if why:
            raise ModelError(why)
        self._emit(LoadProgress(done, total, stage))

    # -- memory: snapshots, pressure, reconfiguration --

    def _tick(self, live: list[Sequence] = ()) -> None:
        """About once a second: relieve memory pressure, then tell the listeners where memory goes."""
        now = time.monotonic()
        if now < self._next_snapshot or self.kvpool is None:
            return
        self._next_snapshot = now + SNAPSHOT_PERIOD
        try:
            total, used = self.probe.totals()
            other = max(0, used - self.probe.own())
        except Exception:  # a probe failing must never stop the engine
            log.exception("memory probe failed")
            return
        self._relieve_pressure(total, other, list(live))
        self.last_snapshot = snap = self._snapshot(total, other)
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
        if choice is None:
            return self._notice("pressure", "memory is short and the KV cache cannot shrink further right now")
        try:
            done = self._rebuild(choice, allowed, live)
        except EngineError as e:
            return self._notice("pressure", f"memory is short and the KV cache could not shrink: {e}")
        if not done:
            return self._notice("pressure", "memory is short and the KV cache cannot shrink further right now")
        self._notice("shrink" if choice == old else "downshift",
                     f"another program took memory: KV cache now {allowed / 2**20:.0f} MiB"
                     + (f", {old.value} -> {choice.value}" if choice != old else ""))

    def _rebuild(self, precision: Precision, budget: int, live: list[Sequence] = ()) -> bool:
        """Allocate the new pool, convert, swap, free the old; False when live blocks would not fit.
        Refused up front when the new pool cannot be allocated next to the old; a failure part way
        leaves the old pool as it was (KVCache.converted is transactional) and raises EngineError."""
        pool = self.kvpool
        new_bytes = pool.tokens_for(precision, budget) * pool.bytes_per_token(precision)
        total, used = self.probe.totals()
        free = total - used
        if new_bytes > free:
            raise Refused(f"the new KV cache needs {new_bytes / 2**20:,.0f} MiB next to the current "
                          f"{pool.kv.nbytes / 2**20:,.0f} MiB, and {max(0, free) / 2**20:,.0f} MiB are free")
        try:
            done = pool.rebuild(precision, budget, live)
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
            raise EngineError(f"the KV cache could not be rebuilt ({_short(e)}); it is unchanged") from e
        if done and self.loaded.device.type == "cuda":
            torch.cuda.empty_cache()
        return done

    def _control(self, command: Reconfigure) -> None:
        try:
            settings = self._reconfigure(command.max_context, command.kv_precision, command.headroom_bytes)
        except Refused as e:
            self._notice("rebuild", f"settings not applied: {e}")
            return command.future.set_exception(e)
        except (ConfigError, ValueError) as e:
            return command.future.set_exception(ConfigError(str(e)))
        except EngineError as e:
            self._notice("rebuild", str(e))
            return command.future.set_exception(e)
        except Exception as e:
            log.exception("reconfigure failed")
            return command.future.set_exception(EngineError(f"reconfigure failed: {e}"))
        command.future.set_result(settings)
        self._emit(Reconfigured(settings))
        self._warmed = False  # another pool is another compiled step: in the next idle second, said, not mid-reply

    def _reconfigure(self, max_context, kv_precision, headroom_bytes) -> dict:
        """Apply new settings, or leave config and pool exactly as they were."""
        cfg, pool = self.config, self.kvpool
        new_cfg = replace(cfg, max_context=max_context or cfg.max_context,
                          kv_precision=kv_precision or cfg.kv_precision,
                          headroom_bytes=cfg.headroom_bytes if headroom_bytes is None else headroom_bytes)
        new_cfg = self._capped(new_cfg)
        precision, budget = self._layout(new_cfg)
        upward = PRECISIONS.index(precision) < PRECISIONS.index(pool.precision)
        if not self._rebuild(precision, budget):
            raise Refused("the KV cache is in use and cannot be rebuilt now")
        if upward:
            pool.pool.clear_cache()  # lossy blocks must not pass for full-precision ones
        self.config, self.auto = new_cfg, new_cfg.kv_precision == Precision.AUTO
        self._next_snapshot = 0.0
        return {**self.settings(), "kv_budget": budget}  # the whole config: the app shows it as it is

    def _notice(self, kind: str, message: str) -> None:
        notice = Notice(kind, message)
        log.info("%s: %s", kind, message)
        if self._handle is not None:
            self._handle.put(notice)
        self._emit(notice)

    def _announce(self, status: ModelReady | LoadFailed) -> None:
        """How a load ended, to the listeners and to any that comes later (add_listener's replay)."""
        with self._lock:
            self._status = status
            listeners = list(self._listeners)
        self._emit(status, listeners)

    def _emit(self, event, listeners: list | None = None) -> None:
        for callback in list(self._listeners) if listeners is None else listeners:
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
            if handle.cancelled or self._switching():  # cancelled while queued: not even tokenized
                last = Finished("", [], "cancelled", Stats(kv_precision=self.precision.value))
            else:
                taken = time.perf_counter()  # TTFT counts the prompt's encoding, as the user waits for it
                prompt, persona_len, trimmed = self._prompt_ids(handle.request)
                seq = Sequence(list(prompt))
                last = self._generate(handle, seq, len(prompt), persona_len, taken)
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
        handle.put(last)

    def _release(self, seq: Sequence, persona_len: int) -> None:
        """After the reply (never before the first token): pin and persist the persona, free blocks."""
        try:
            self.personas.remember(seq, persona_len)
        except Exception:
            log.exception("could not remember the persona")
        self.manager.free(seq, keep_tail=True)  # the next turn goes on from the last computed token

    def _tokenize(self, command: Tokenize) -> None:
        try:
            command.future.set_result(self.formatter.prompt_ids(command.text, self.context_limit()))
        except Exception as e:  # the future resolves whatever happens
            command.future.set_exception(e if isinstance(e, ChatError) else EngineError(f"internal error: {_short(e)}"))

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
        messages, trimmed = request.messages, 0
        cap = self.formatter.max_chars(limit)
        while longest_content(messages) > cap:  # a message alone past the context: trimmed or refused, untokenized
            shorter = drop_oldest(messages)
            if shorter is None:
                raise EngineError(f"a message is longer than the context of {limit} tokens ({cap:,} characters "
                                  "at most)")
            trimmed += len(messages) - len(shorter)
            messages = shorter
        room = min(request.sampling.max_new_tokens, limit // 4)
        encoded = self.formatter.encode(messages)
        while len(encoded.token_ids) + room > limit:
            shorter = drop_to_fit(messages, encoded, limit - room)
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

    def _generate(self, handle: RequestHandle, seq: Sequence, prompt_len: int, persona_len: int,
                  start: float) -> Finished:
        cfg, sp = self.config, handle.request.sampling
        stats = Stats(prompt_tokens=prompt_len)
        limit = self.context_limit()
        self.manager.match_prefix(seq)
        self.personas.restore(seq, persona_len)
        self.manager.match_tail(seq, copy=lambda src, dst: self.kv.move_blocks({src: dst}))
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
            token = sampler(logits, seq.token_ids)
            if first_at is None:
                first_at = time.perf_counter()
            seq.token_ids.append(token)
            generated.append(token)
            if token in self.eos_ids and not sp.ignore_eos:
                reason = "stop"
                break
            delta = stops.feed(detok.add(token))
            text.append(delta)
            handle.put(TokenDelta(delta, token))
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
                handle.put(TokenDelta(tail, -1))
        done = time.perf_counter()
        stats.ttft_ms = (first_at - start) * 1000
        stats.decode_tok_s = (len(generated) - 1) / (done - first_at) if len(generated) > 1 else 0.0
        stats.generated_tokens = len(generated)
        stats.kv_precision = self.precision.value
        return Finished("".join(text), generated, reason, stats)


def _fail(command: Command, message: str) -> None:
    if isinstance(command, Submit):
        command.handle.put(Error(message, internal=True))
    elif not command.future.done():
        command.future.set_exception(EngineError(message))


def _short(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:300]


def _load_failure(e: Exception) -> str:
    if isinstance(e, (ModelError, ConfigError, EngineError)):
        return str(e)
    log.exception("model load failed")
    return f"model load failed: {_short(e)}"


def _trim_heap() -> None:
    """Hand freed heap pages back to the system (glibc keeps them otherwise), so that the probe
    sees a dropped model's memory return and the next model can use it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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


def drop_to_fit(messages: list[dict], encoded, budget: int) -> list[dict] | None:
    """The conversation without as many of its oldest exchanges as its messages' token counts say
    must go for it to fit ``budget`` tokens: one re-encoding, not one per dropped message. None
    when nothing is left to drop."""
    ends = encoded.message_starts[1:] + [encoded.prompt_start]
    size = {id(m): end - start for m, start, end in zip(messages, encoded.message_starts, ends)}
    extra = len(encoded.token_ids) - encoded.prompt_start  # the generation prompt
    shorter = drop_oldest(messages)
    while shorter is not None:
        if sum(size[id(m)] for m in shorter) + extra <= budget:
            return shorter
        fewer = drop_oldest(shorter)
        if fewer is None:
            return shorter
        shorter = fewer
    return None


def eos_token_ids(lm: LoadedModel) -> set[int]:
    ids = set()
    for source in (lm.model.config, getattr(lm.model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
    if lm.tokenizer.eos_token_id is not None:
        ids.add(lm.tokenizer.eos_token_id)
    return ids


def generation_settings(model) -> dict:
    """What the model's authors set in its generation_config.json (``to_diff_dict``: transformers'
    own defaults, e.g. top_k 50, say nothing about this model), as plain values for the app."""
    config = getattr(model, "generation_config", None)
    return config.to_diff_dict() if config is not None else {}
