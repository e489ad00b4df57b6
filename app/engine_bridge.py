"""The engine's events as Qt signals. The GUI thread never waits: each request is read by a
small thread that only emits signals, which Qt queues to the GUI thread. Switching models closes
the engine and starts another one from ``make_engine(settings)``, also off the GUI thread."""
import threading
from dataclasses import asdict

from PySide6.QtCore import QObject, Signal

from kvchat.engine.config import SamplingParams
from kvchat.engine.events import Error, Finished, LoadProgress, Notice, Request, TokenDelta
from kvchat.engine.memory import GiB, MemorySnapshot


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

    def __init__(self, engine, make_engine=None):
        super().__init__()
        self.engine, self.make_engine = engine, make_engine
        self.handle = None
        self.switching, self._cancelled = False, False
        engine.add_listener(self._from_engine)

    def start(self) -> None:
        """Emit ready or load_failed for the first engine. The window calls this once its slots are
        connected: a model that fails in a millisecond would otherwise be reported to no one, and the
        window would say "loading model..." for ever."""
        if not self.switching:  # a switch under way announces its own outcome
            threading.Thread(target=self._wait_ready, daemon=True).start()

    def _wait_ready(self) -> None:
        self.engine.ready.wait()
        self.switching = False
        if self.engine.load_error:
            self.load_failed.emit(self.engine.load_error)
        else:
            self.ready.emit()

    def switch_model(self, settings: dict) -> None:
        """Close this engine (its memory goes back first) and load ``settings`` in a new one."""
        old, self.switching, self._cancelled = self.engine, True, False

        def run():
            old.close()
            try:
                self.engine = self.make_engine(settings)
            except Exception as e:  # settings the engine refuses outright
                self.switching = False
                self.load_failed.emit(str(e))
                return
            self.engine.add_listener(self._from_engine)
            if self._cancelled:  # pressed while the old engine was closing
                self.engine.cancel_load()
            self._wait_ready()

        threading.Thread(target=run, daemon=True).start()

    def cancel_load(self) -> None:
        self._cancelled = True
        self.engine.cancel_load()

    @property
    def loading(self) -> bool:
        return self.switching or not self.engine.ready.is_set()

    def _from_engine(self, event) -> None:
        if isinstance(event, LoadProgress):
            self.load_progress.emit(event.done, event.total)
        elif isinstance(event, MemorySnapshot):
            self.snapshot.emit(asdict(event))
        elif isinstance(event, Notice):
            self.notice.emit(event.kind, event.message)

    @property
    def busy(self) -> bool:
        return self.handle is not None

    def send(self, messages: list[dict], sampling: SamplingParams) -> None:
        if self.switching:
            self.failed.emit("another model is loading; send again once it is ready")
            return
        self.handle = handle = self.engine.submit(Request(messages=messages, sampling=sampling))
        threading.Thread(target=self._pump, args=(handle,), daemon=True).start()

    def _pump(self, handle) -> None:
        for event in handle:
            if isinstance(event, TokenDelta):
                self.token.emit(event.text, event.token_id)
            elif isinstance(event, Finished):
                self.handle = None
                self.finished.emit({"text": event.text, "token_ids": event.token_ids,
                                    "finish_reason": event.finish_reason, "stats": asdict(event.stats)})
            elif isinstance(event, Error):
                self.handle = None
                self.failed.emit(event.message)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()

    def reconfigure(self, max_context: int | None, kv_precision: str | None, headroom_gib: float | None = None) -> None:
        headroom = None if headroom_gib is None else int(headroom_gib * GiB)
        future = self.engine.reconfigure(max_context=max_context, kv_precision=kv_precision, headroom_bytes=headroom)

        def wait():
            try:
                self.reconfigured.emit(future.result())
            except Exception as e:
                self.failed.emit(str(e))

        threading.Thread(target=wait, daemon=True).start()
