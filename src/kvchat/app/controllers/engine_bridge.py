"""The backend as Qt signals: one QObject adapter over the backend in use, the local engine or a
connection to a server (core/backend.py); the window never asks which one it has.

Every engine event, and the end of every command, reaches the GUI thread as one queued signal;
there, and only there, the bridge updates its state (busy, loading, the settings in force) and
emits the public signals. The GUI never waits on the engine and never reads its attributes: it
reads the bridge's state, which is what the last delivered event said.

Several replies may run at once (the engine batches them): ``send`` gives each a key, and every
signal about a reply carries its key first."""
import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass

from PySide6.QtCore import QObject, Qt, Signal

from kvchat.core.config import DEFAULT_CONTEXT, DISK_CACHE_BYTES, EngineConfig, SamplingParams
from kvchat.core.events import (Error, Finished, LoadFailed, LoadProgress, ModelReady, Notice, PrefillProgress,
                                  Request, RequestHandle, TokenDelta, replies_wait)
from kvchat.core.memory import GiB, MemorySnapshot
from kvchat.remote.connect import open_remote
from kvchat.remote.metrics import ServerMemory


def settings_config(settings: dict) -> EngineConfig:
    """The engine config for the settings panel's values."""
    return EngineConfig(model=settings.get("model", "starter"), kv_precision=settings.get("kv_precision", "auto"),
                        max_context=settings.get("max_context", DEFAULT_CONTEXT), weights=settings.get("weights", "auto"),
                        headroom_bytes=int(settings.get("headroom_gib", 1.0) * GiB),
                        ram_cache_bytes=int(settings.get("ram_cache_gib", 0) * GiB) or None,  # 0: the engine's default
                        disk_cache_bytes=int(settings.get("disk_cache_gib", DISK_CACHE_BYTES / GiB) * GiB))


def settings_in_force(saved: dict, reported: dict) -> dict:
    """The settings panel's values in force: the engine's config as its last event gave it
    (``EngineBridge.settings``), over the ``saved`` ones (which the engine starts from, and which
    stand until it has said)."""
    config = settings_config(saved)
    return {"model": "starter", "weights": "auto", **saved,
            "max_context": reported.get("max_context", config.max_context),
            "kv_precision": reported.get("kv_precision", config.kv_precision.value),
            "headroom_gib": reported.get("headroom_bytes", config.headroom_bytes) / GiB}


@dataclass
class _RequestEvent:
    key: int  # which send() it belongs to
    event: object


@dataclass
class _Answer:
    """A command's future, done, for ``handle`` on the GUI thread."""
    future: Future
    handle: object
    generation: int  # the backend it was asked of: after a switch, its answer is not the new one's


@dataclass
class _BackendEvent:
    generation: int  # which backend sent it: a replaced one's last words are dropped
    event: object


class EngineBridge(QObject):
    ready = Signal()
    load_failed = Signal(str)
    token = Signal(int, str, int)  # reply key, text, token id
    prefill = Signal(int, int, int)  # reply key, prompt tokens computed (the cached ones included), of all
    finished = Signal(int, dict)  # reply key, {text, token_ids, finish_reason, stats}
    reply_failed = Signal(int, str)  # reply key, why
    failed = Signal(str)  # a command refused: a send while a model loads, a reconfigure
    notice = Signal(str, str)  # kind, message
    warming = Signal(bool)  # replies wait for the decode step's capture (CUDA), or no longer do
    snapshot = Signal(dict)
    reconfigured = Signal(dict)
    # done, total (0: unknown), stage: download in bytes (object: sizes pass 2 GiB), convert in tensors
    load_progress = Signal(object, object, str)
    server_memory = Signal(dict)  # a server's own KV-cache figures (ServerMemory), on a connection
    tokens_counted = Signal(str, object, str)  # a text, its tokens (None: not counted), why it cannot fit ('')
    _delivered = Signal(object)  # anything from the engine thread; queued to the GUI thread

    def __init__(self, engine, make_engine=None):
        """``engine``: the backend to start on. ``make_engine(settings)`` makes the local engine when
        the app comes back to it from a connection (switching models is the engine's own LoadModel);
        the ``kvchat`` command passes it in, for the app never imports the engine."""
        super().__init__()
        self.engine = engine  # the backend in use; the GUI calls its methods, never reads it
        self.make_engine = make_engine
        self._generation = 0
        self.handles: dict[int, RequestHandle] = {}  # the replies being written, by key
        self._keys = 0
        self._streamed: set[int] = set()  # the replies whose first token has arrived
        self.switching = True  # until the first load has ended
        self.settings: dict = {}  # the engine's config as last reported (model, max_context, kv_precision...)
        self.precision: str | None = None  # the KV precision in force
        self.model_config = None  # the loaded model's own config (the settings dialog's planner)
        self.model_generation: dict = {}  # the model's generation_config.json: its authors' sampling defaults
        self.load_error: str | None = None  # why no model is loaded, when none is
        self.label = ""  # the model's name as the backend gives it
        self._delivered.connect(self._on_delivered, Qt.QueuedConnection)
        self._listen()

    def _listen(self) -> None:
        generation = self._generation
        self.engine.add_listener(lambda event: self._post(_BackendEvent(generation, event)), replay=True)

    def _post(self, item) -> None:
        """From the engine's thread. After quit the bridge's Qt side may be gone while the engine
        still ends its step: its last events have no one to reach."""
        try:
            self._delivered.emit(item)
        except RuntimeError:  # "Signal source has been deleted"
            pass

    @property
    def server(self) -> str | None:
        """The server's base URL on a connection (the model, context and KV precision are the
        server's there); None on the local engine. From the backend's ModelReady settings."""
        return self.settings.get("server")

    capabilities = property(lambda self: self.engine.capabilities)  # what the backend lets the app do

    def start(self) -> None:
        """Kept for the window: the first load's outcome arrives as a queued signal, so slots
        connected before the event loop runs see it however fast the model loads or fails."""

    @property
    def loading(self) -> bool:
        return self.switching

    @property
    def busy(self) -> bool:
        return bool(self.handles)

    # -- commands, from the GUI thread --

    def switch_model(self, settings: dict) -> None:
        """Load ``settings`` in the engine (the old model goes first; a failure brings it back). A
        second switch while one loads replaces it. On a connection, the local engine comes back."""
        try:
            config = settings_config(settings)
        except ValueError as e:  # settings the engine refuses outright
            self.load_failed.emit(str(e))
            return
        if not self.engine.capabilities.models:  # a server's model is its own: back on this computer
            self.use_local(settings)
            return
        self.switching = True
        self.engine.load_model(config)

    def use_connection(self, name: str) -> None:
        """Run on the saved connection ``name`` (its key from the keyring); ready or load_failed
        says how it went."""
        try:
            backend = open_remote(name, saved_only=True)
        except Exception as e:  # no such connection any more
            self.load_failed.emit(str(e))
            return
        self.use_backend(backend)

    def use_local(self, settings: dict) -> None:
        """Back on this computer's engine, loading ``settings``' model."""
        if self.make_engine is None:
            self.load_failed.emit("this window was opened without a local engine")
            return
        self.use_backend(self.make_engine(settings))

    def use_backend(self, backend) -> None:
        """Replace the backend: the replies streaming on the old one end now, cancelled, keeping what
        they wrote (their late events are dropped: a closing backend may never send them), and the
        old one is closed off the GUI thread, freeing its memory."""
        old, self.engine = self.engine, backend
        for key, handle in list(self.handles.items()):
            old.cancel(handle)
            self._cut(key)
        self._generation += 1
        self.switching, self.load_error, self.settings = True, None, {}
        self.precision = self.model_config = None
        self.model_generation = {}
        self.label = ""
        self._listen()
        threading.Thread(target=old.close, name="kvchat-close-backend", daemon=True).start()

    def cancel_load(self) -> None:
        self.engine.cancel_load()

    def forget(self, messages: list[dict] | None) -> None:
        """A deleted chat's KV, or (None) every cached conversation's, deleted by the local engine
        from its pool, RAM and disk; a server keeps its own cache."""
        if self.engine.capabilities.forget:
            self.engine.forget(messages)

    def send(self, messages: list[dict], sampling: SamplingParams) -> int | None:
        """A new reply; its key, or None (and ``failed``) while a model loads."""
        if self.switching:
            self.failed.emit("another model is loading; send again once it is ready")
            return None
        self._keys += 1
        key = self._keys
        self.handles[key] = self.engine.submit(Request(messages=messages, sampling=sampling),
                                               listener=lambda event: self._post(_RequestEvent(key, event)))
        return key

    def stop(self, key: int) -> None:
        handle = self.handles.get(key)
        if handle is None:
            return
        self.engine.cancel(handle)
        if key not in self._streamed:
            # Nothing streamed yet: the request may wait behind others, or for a CUDA capture, and
            # its end would come only after. It ends now, and the engine skips it once it gets to it.
            self._cut(key)

    def _cut(self, key: int) -> None:
        """The reply ends now, cancelled; the window keeps what it showed. Its late events are
        dropped: the key is gone."""
        self._end(key)
        self.finished.emit(key, {"text": "", "token_ids": [], "finish_reason": "cancelled", "stats": {}})

    def _end(self, key: int) -> None:
        del self.handles[key]
        self._streamed.discard(key)

    def reconfigure(self, max_context: int | None, kv_precision: str | None, headroom_gib: float | None = None) -> None:
        headroom = None if headroom_gib is None else int(headroom_gib * GiB)
        self._answer(self.engine.reconfigure(max_context=max_context, kv_precision=kv_precision,
                                             headroom_bytes=headroom), self._on_reconfigured)

    def count_tokens(self, text: str) -> None:
        """The tokens of ``text`` (a pasted document) as the model's tokenizer counts them, and
        whether it fits the context: ``tokens_counted``. The local engine's only: a server's
        tokenizer is not reachable, so its chips keep their estimate."""
        if self.engine.capabilities.tokenize and not self.loading:
            self._answer(self.engine.tokenize(text), lambda f: self._on_counted(text, f))

    def _answer(self, future: Future, handle) -> None:
        generation = self._generation
        future.add_done_callback(lambda f: self._post(_Answer(f, handle, generation)))

    # -- the GUI thread: state changes here only --

    def _on_delivered(self, item) -> None:
        if isinstance(item, _BackendEvent):
            if item.generation == self._generation:
                self._on_backend_event(item.event)
        elif isinstance(item, _RequestEvent):
            self._on_request_event(item.key, item.event)
        elif isinstance(item, _Answer) and item.generation == self._generation:
            item.handle(item.future)

    def _on_counted(self, text: str, future: Future) -> None:
        try:
            self.tokens_counted.emit(text, len(future.result()), "")
        except ValueError as error:  # the engine's ChatError: longer than the context
            self.tokens_counted.emit(text, None, str(error))
        except Exception:  # no model to count with (a failed load): the estimate stays
            self.tokens_counted.emit(text, None, "")

    def _on_backend_event(self, item) -> None:
        if isinstance(item, ModelReady):
            self.switching, self.load_error = False, None
            self.settings, self.model_config, self.label = item.settings, item.model_config, item.label
            self.model_generation = item.generation
            self.precision = item.settings.get("precision")
            self.ready.emit()
        elif isinstance(item, LoadFailed):
            self.switching = False
            if item.restored:
                self.settings = item.settings
                self.precision = item.settings.get("precision")
            else:
                self.load_error, self.model_config, self.precision = item.message, None, None
            self.load_failed.emit(item.message)
        elif isinstance(item, LoadProgress):
            self.load_progress.emit(item.done, item.total, item.stage)
        elif isinstance(item, MemorySnapshot):
            self.precision = item.precision
            self.snapshot.emit(asdict(item))
        elif isinstance(item, ServerMemory):
            self.server_memory.emit(asdict(item))
        elif isinstance(item, Notice):
            self.notice.emit(item.kind, item.message)
            waits = replies_wait(item)
            if waits is not None:
                self.warming.emit(waits)

    def _on_request_event(self, key: int, event) -> None:
        if key not in self.handles:  # a reply ended early by stop(): its late events have no one to reach
            return
        if isinstance(event, TokenDelta):
            self._streamed.add(key)
            self.token.emit(key, event.text, event.token_id)
        elif isinstance(event, PrefillProgress):
            self.prefill.emit(key, event.done, event.total)
        elif isinstance(event, (Finished, Error)):
            self._end(key)
            if isinstance(event, Finished):
                self.finished.emit(key, {"text": event.text, "token_ids": event.token_ids,
                                         "finish_reason": event.finish_reason, "stats": asdict(event.stats)})
            else:
                self.reply_failed.emit(key, event.message)
        # a request's Notice events are also engine-wide ones, which the listener already delivers

    def _on_reconfigured(self, future: Future) -> None:
        try:
            result = future.result()
        except Exception as e:
            self.failed.emit(str(e))
            return
        self.settings = {**self.settings, **result}
        self.precision = result.get("precision", result["kv_precision"])
        self.reconfigured.emit(result)
