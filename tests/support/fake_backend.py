"""A fake of the local Engine for the GUI's tests: the Backend protocol (core/backend.py) and the
engine's own commands (load_model, reconfigure, tokenize), as one actor thread that takes the same
typed commands (core/commands.py) from one queue and gives the same events (core/events.py) in the
same order as engine/engine.py, with canned replies and no model (fake_model.py).

What a test controls: ``pace`` (how far a reply may stream: free, held, or in lockstep with the
window), ``warm_up()`` (the first reply waits for a decode step being compiled), ``model.forward``
(replace it to fail a request as a device would), ``PersonaDisk`` (personas' KV kept across fakes)."""
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import asdict, replace

from kvchat.core.commands import Cancel, Command, LoadModel, Reconfigure, Shutdown, Submit, Tokenize, refuse
from kvchat.core.config import ConfigError, EngineConfig, Precision, SamplingParams
from kvchat.core.errors import first_line
from kvchat.core.events import (EngineError, Finished, LoadFailed, ModelReady, Notice, Reconfigured, Refused,
                                Request, RequestHandle)
from kvchat.core.model_source import ModelError

from support.fake_loading import load as load_model_files
from support.fake_model import PersonaDisk, PrefixCache, layout, persona_ids, snapshot
from support.fake_request import serve
from support.pace import Pace

__all__ = ["FakeBackend", "Pace", "PersonaDisk"]
SNAPSHOT_PERIOD = 1.0  # seconds between the idle engine's memory snapshots (engine/governor.py)


class FakeBackend:
    def __init__(self, config: EngineConfig | None = None, disk: PersonaDisk | None = None,
                 converted: set | None = None):
        self.config = config or EngineConfig()
        self.model = None  # the FakeModel loaded
        self.precision = Precision.FP16
        self.cache = PrefixCache()
        self.disk = disk
        self.converted = converted if converted is not None else set()  # GGUF files converted once already
        self.pace = Pace()
        self.compiled: threading.Event | None = None  # set: a decode step to compile before the next reply
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.handle: RequestHandle | None = None
        self.commands_seen: list = []  # every command the actor ran, in order
        self._listeners: list = []
        self._status = None
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._stopping = threading.Event()
        self._good: EngineConfig | None = None
        self._load_seq = self._cancelled_load = self._model_seq = 0
        self.load_model(self.config)
        self._thread = threading.Thread(target=self._main, name="fake-engine", daemon=True)
        self._thread.start()

    # -- the public API, any thread --

    def submit(self, request: Request, listener=None) -> RequestHandle:
        handle = RequestHandle(request, listener)
        self._put(Submit(handle))
        return handle

    def generate(self, messages: list[dict], **sampling) -> Finished:
        return self.submit(Request(messages=messages, sampling=SamplingParams(**sampling))).result()

    def tokenize(self, text: str) -> Future:
        return self._put(Tokenize(text))

    def cancel(self, handle: RequestHandle) -> Future:
        handle.cancel()
        self.pace.wake()
        return self._put(Cancel(handle))

    def reconfigure(self, max_context=None, kv_precision=None, headroom_bytes=None) -> Future:
        return self._put(Reconfigure(max_context, kv_precision, headroom_bytes))

    def load_model(self, config: EngineConfig, loaded=None) -> Future:
        with self._lock:
            self._load_seq += 1
            command = LoadModel(config, loaded, self._load_seq)
        self._cancel_running()
        return self._put(command)

    def persona_state(self, system_prompt: str) -> str:
        model = self.model
        if self.load_error or not self.ready.is_set() or model is None:
            return "cold"
        ids = persona_ids(model, system_prompt)
        if not ids:
            return "short"
        if self.cache.holds(ids):
            return "warm"
        return "disk" if self.disk is not None and self.disk.has(self.disk_key(ids)) else "cold"

    def cancel_load(self) -> None:
        self._cancelled_load = self._load_seq

    def add_listener(self, callback, replay: bool = False) -> None:
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

    def flush(self) -> Future:
        """Resolves once every command queued before it has run, so every event they gave has been
        handed to the listeners (a test then processes Qt's queue to see them all delivered)."""
        return self._put(Cancel(RequestHandle(Request())))

    def warm_up(self) -> threading.Event:
        """The next reply (or idle moment) first compiles the decode step, as after a start; it ends
        when the test sets the event returned."""
        self.compiled = threading.Event()
        return self.compiled

    def shutdown(self) -> Future:
        self._stopping.set()
        self._cancel_running()
        return self._put(Shutdown())

    def close(self, timeout: float = 2.0) -> bool:
        self.shutdown()
        if self.compiled is not None:
            self.compiled.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def settings(self) -> dict:
        out = asdict(self.config)
        out["kv_precision"] = self.config.kv_precision.value
        if self.model is not None:
            out["precision"] = self.precision.value
        return out

    def disk_key(self, ids: list[int]) -> tuple:
        return self.model.label, self.precision.value, tuple(ids)

    def _put(self, command: Command) -> Future:
        with self._lock:
            if not self._closed:
                self._commands.put(command)
                return command.future
        refuse(command, "the engine is shut down")
        return command.future

    def _cancel_running(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.pace.wake()

    # -- the actor thread --

    def _main(self) -> None:
        try:
            while True:
                try:
                    command = self._commands.get(timeout=SNAPSHOT_PERIOD)
                except queue.Empty:  # idle: where memory goes, about once a second, as the engine says it
                    self._snapshot()
                    continue
                self.commands_seen.append(command)
                if isinstance(command, Shutdown):
                    with self._lock:
                        self._closed = True
                    self._refuse_queued("the engine is shut down")
                    return command.future.set_result(None)
                self._run(command)
        finally:
            with self._lock:
                self._closed = True
            self._refuse_queued("the engine has stopped")
            self.ready.set()

    def _run(self, command: Command) -> None:
        if self._stopping.is_set():
            return refuse(command, "the engine is shutting down")
        if isinstance(command, LoadModel):
            self._load(command)
            return self._snapshot()
        if isinstance(command, Cancel):
            command.handle.cancel()
            return command.future.set_result(True)
        if self.model is None:
            return refuse(command, self.load_error or "no model is loaded")
        if isinstance(command, Tokenize):
            return command.future.set_result(self.model.encode([{"role": "user", "content": command.text}])[0][2:-3])
        if isinstance(command, Submit):
            self._warm_decode()
            serve(self, command.handle)
        else:
            self._reconfigure(command)
        self._snapshot()

    def _refuse_queued(self, reason: str) -> None:
        while True:
            try:
                refuse(self._commands.get_nowait(), reason)
            except queue.Empty:
                return

    def _warm_decode(self) -> None:
        if self.compiled is not None:
            self.notice("warm-up", "preparing fast decoding (a minute or two the first time, seconds after)")
            self.compiled.wait()
            self.compiled = None
            self.notice("warm-up", "fast decoding ready (4 s)")

    # -- loading: engine/host.py's steps and events --

    def switching(self) -> bool:
        return self._stopping.is_set() or self._load_seq > self._model_seq

    def stop_loading(self, seq: int | None) -> str | None:
        if seq is None:
            return None
        if seq < self._load_seq:
            return "replaced by a later model choice"
        if seq <= self._cancelled_load:
            return "loading cancelled"
        return None

    def _load(self, command: LoadModel) -> None:
        if command.seq < self._load_seq:
            return refuse(command, "replaced by a later model choice")
        self.ready.clear()
        try:
            self.model, self.handle = None, None
            self.cache.clear()
            try:
                self._start(command.config, command.seq)
            except (ModelError, ConfigError, EngineError) as error:
                return self._failed(command, str(error))
            self._good, self.load_error = self.config, None
            settings = self.settings()
            command.future.set_result(settings)
            self._announce(ModelReady(self.model.label, settings, self.model.config, dict(self.model.generation)))
        finally:
            if command.seq >= self._load_seq:
                self._model_seq = command.seq
                self.ready.set()

    def _failed(self, command: LoadModel, reason: str) -> None:
        self.model = None
        if command.seq < self._load_seq:
            return refuse(command, "replaced by a later model choice")
        restored = False
        if self._good is not None:
            try:
                self._start(self._good, None)
                restored = True
            except (ModelError, ConfigError, EngineError) as error:
                self.model, self._good = None, None
                self.notice("load", f"the previous model could not be loaded again: {error}")
        message = reason + ("; the previous model is back" if restored else "")
        self.load_error = None if restored else reason
        command.future.set_exception(EngineError(message))
        self._announce(LoadFailed(message, self.settings() if restored else None))

    def _start(self, config: EngineConfig, seq: int | None) -> None:
        self.config = config
        model = load_model_files(self, config.model, seq)
        if self.stop_loading(seq):
            raise ModelError(self.stop_loading(seq))
        self.model = model
        self.config = config = self._capped(config)
        self.precision = layout(model, config)

    def _capped(self, config: EngineConfig) -> EngineConfig:
        trained = self.model.trained
        if not trained or config.max_context <= trained:
            return config
        if config.allow_long_context:
            self.notice("context", f"{config.max_context:,} tokens is longer than the {trained:,} the model was "
                                   "trained for: expect worse answers past that")
            return config
        self.notice("context", f"{config.max_context:,} tokens capped at {trained:,}, the length the model "
                               "was trained for")
        return replace(config, max_context=trained)

    # -- settings: engine/governor.py's reconfigure --

    def _reconfigure(self, command: Reconfigure) -> None:
        old = self.config
        try:
            new = replace(old, max_context=command.max_context or old.max_context,
                          kv_precision=command.kv_precision or old.kv_precision,
                          headroom_bytes=old.headroom_bytes if command.headroom_bytes is None else command.headroom_bytes)
            new = self._capped(new)
            precision = layout(self.model, new)
        except (ConfigError, ValueError) as error:
            return command.future.set_exception(ConfigError(first_line(error)))
        except Refused as error:
            self.notice("rebuild", f"settings not applied: {error}")
            return command.future.set_exception(error)
        if [*Precision].index(precision) < [*Precision].index(self.precision):
            self.cache.clear()  # lossy blocks must not pass for full-precision ones
        self.config, self.precision = new, precision
        settings = {**self.settings(), "kv_budget": snapshot(self.model, new, precision, 0, 0).kv_total}
        command.future.set_result(settings)
        self._emit(Reconfigured(settings))

    # -- events --

    def notice(self, kind: str, message: str) -> None:
        notice = Notice(kind, message)
        if self.handle is not None:
            self.handle.put(notice)
        self._emit(notice)

    def _snapshot(self, in_use: int = 0) -> None:
        if self.model is not None:
            self._emit(snapshot(self.model, self.config, self.precision, self.cache.tokens(), in_use))

    def _announce(self, status) -> None:
        with self._lock:
            self._status = status
        self._emit(status)

    def _emit(self, event) -> None:
        for callback in list(self._listeners):
            try:
                callback(event)
            except Exception:  # a listener's bug must not stop the actor, as in the engine
                logging.getLogger("kvchat.fake").exception("a listener failed")

