"""The engine as Qt signals: one QObject adapter over one long-lived engine.

Every engine event, and the end of every command, reaches the GUI thread as one queued signal;
there, and only there, the bridge updates its state (busy, loading, the settings in force) and
emits the public signals. The GUI never waits on the engine and never reads its attributes: it
reads the bridge's state, which is what the last delivered event said."""
from concurrent.futures import Future
from dataclasses import asdict, dataclass

from PySide6.QtCore import QObject, Qt, Signal

from kvchat.engine.config import EngineConfig, SamplingParams
from kvchat.engine.events import (Error, Finished, LoadFailed, LoadProgress, ModelReady, Notice, Request,
                                  RequestHandle, TokenDelta)
from kvchat.engine.memory import GiB, MemorySnapshot


def settings_config(settings: dict) -> EngineConfig:
    """The engine config for the settings panel's values."""
    return EngineConfig(model=settings.get("model", "starter"), kv_precision=settings.get("kv_precision", "auto"),
                        max_context=settings.get("max_context", 8192), weights=settings.get("weights", "auto"),
                        headroom_bytes=int(settings.get("headroom_gib", 1.0) * GiB))


@dataclass
class _RequestEvent:
    request_id: int  # which send() it belongs to: only the latest one's end clears busy
    event: object


@dataclass
class _Reconfigured:
    future: Future


class EngineBridge(QObject):
    ready = Signal()
    load_failed = Signal(str)
    token = Signal(str, int)  # text, token id
    finished = Signal(dict)  # text, token_ids, finish_reason, stats
    failed = Signal(str)
    notice = Signal(str, str)  # kind, message
    snapshot = Signal(dict)
    reconfigured = Signal(dict)
    load_progress = Signal(object, object)  # bytes done, total (0: unknown); object: sizes pass 2 GiB
    _delivered = Signal(object)  # anything from the engine thread; queued to the GUI thread

    def __init__(self, engine, make_engine=None):
        """``make_engine`` is accepted for older callers and not used: switching models is the
        engine's own LoadModel, so there is only ever one engine and one model."""
        super().__init__()
        self.engine = engine  # the only engine, for its lifetime; the GUI calls its methods, never reads it
        self.handle: RequestHandle | None = None
        self._request_id = 0
        self.switching = True  # until the first load has ended
        self.settings: dict = {}  # the engine's config as last reported (model, max_context, kv_precision...)
        self.precision: str | None = None  # the KV precision in force
        self.model_config = None  # the loaded model's own config (the settings dialog's planner)
        self.load_error: str | None = None  # why no model is loaded, when none is
        self._delivered.connect(self._on_delivered, Qt.QueuedConnection)
        engine.add_listener(self._delivered.emit, replay=True)

    def start(self) -> None:
        """Kept for the window: the first load's outcome arrives as a queued signal, so slots
        connected before the event loop runs see it however fast the model loads or fails."""

    @property
    def loading(self) -> bool:
        return self.switching

    @property
    def busy(self) -> bool:
        return self.handle is not None

    # -- commands, from the GUI thread --

    def switch_model(self, settings: dict) -> None:
        """Load ``settings`` in the engine (the old model goes first; a failure brings it back). A
        second switch while one loads replaces it."""
        try:
            config = settings_config(settings)
        except ValueError as e:  # settings the engine refuses outright
            self.load_failed.emit(str(e))
            return
        self.switching = True
        self.engine.load_model(config)

    def cancel_load(self) -> None:
        self.engine.cancel_load()

    def send(self, messages: list[dict], sampling: SamplingParams) -> None:
        if self.switching:
            self.failed.emit("another model is loading; send again once it is ready")
            return
        self._request_id += 1
        rid = self._request_id
        self.handle = self.engine.submit(Request(messages=messages, sampling=sampling),
                                         listener=lambda event: self._delivered.emit(_RequestEvent(rid, event)))

    def stop(self) -> None:
        if self.handle is not None:
            self.engine.cancel(self.handle)

    def reconfigure(self, max_context: int | None, kv_precision: str | None, headroom_gib: float | None = None) -> None:
        headroom = None if headroom_gib is None else int(headroom_gib * GiB)
        future = self.engine.reconfigure(max_context=max_context, kv_precision=kv_precision, headroom_bytes=headroom)
        future.add_done_callback(lambda f: self._delivered.emit(_Reconfigured(f)))

    # -- the GUI thread: state changes here only --

    def _on_delivered(self, item) -> None:
        if isinstance(item, _RequestEvent):
            self._on_request_event(item.request_id, item.event)
        elif isinstance(item, _Reconfigured):
            self._on_reconfigured(item.future)
        elif isinstance(item, ModelReady):
            self.switching, self.load_error = False, None
            self.settings, self.model_config = item.settings, item.model_config
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
            self.load_progress.emit(item.done, item.total)
        elif isinstance(item, MemorySnapshot):
            self.precision = item.precision
            self.snapshot.emit(asdict(item))
        elif isinstance(item, Notice):
            self.notice.emit(item.kind, item.message)

    def _on_request_event(self, request_id: int, event) -> None:
        if isinstance(event, TokenDelta):
            if request_id == self._request_id:  # a stopped reply's last tokens must not join the next
                self.token.emit(event.text, event.token_id)
        elif isinstance(event, (Finished, Error)):
            if request_id == self._request_id:
                self.handle = None
            if isinstance(event, Finished):
                self.finished.emit({"text": event.text, "token_ids": event.token_ids,
                                    "finish_reason": event.finish_reason, "stats": asdict(event.stats)})
            else:
                self.failed.emit(event.message)
        # a request's Notice events are also engine-wide ones, which the listener already delivers

    def _on_reconfigured(self, future: Future) -> None:
        try:
            result = future.result()
        except Exception as e:
            self.failed.emit(str(e))
            return
        self.settings = {**self.settings, "kv_precision": result["kv_precision"],
                         "max_context": result["max_context"]}
        self.precision = result["kv_precision"]
        self.reconfigured.emit(result)
