"""What the engine says to the world: notices, memory snapshots, load progress and how a load
ended, handed to the listeners on the engine thread. A notice also goes to every running request
(``handles``, the scheduler's). The engine's parts say what they have to say through this, not
through the engine."""
import logging
import threading

from kvchat.core.events import LoadFailed, ModelReady, Notice

log = logging.getLogger("kvchat.engine")


class Outbox:
    def __init__(self, handles=lambda: ()):
        self.handles = handles  # the running requests' handles: a notice reaches their replies too
        self._listeners: list = []
        self._status: ModelReady | LoadFailed | None = None  # how the last load ended
        self._lock = threading.Lock()

    def add_listener(self, callback, replay: bool = False) -> None:
        with self._lock:
            self._listeners.append(callback)
            status = self._status if replay else None
        if status is not None:
            callback(status)

    def notice(self, kind: str, message: str) -> None:
        notice = Notice(kind, message)
        log.info("%s: %s", kind, message)
        for handle in self.handles():
            handle.put(notice)
        self.emit(notice)

    def announce(self, status: ModelReady | LoadFailed) -> None:
        """How a load ended, to the listeners and to any that comes later (add_listener's replay)."""
        with self._lock:
            self._status = status
            listeners = list(self._listeners)
        self.emit(status, listeners)

    def emit(self, event, listeners: list | None = None) -> None:
        for callback in list(self._listeners) if listeners is None else listeners:
            try:
                callback(event)
            except Exception:
                log.exception("an engine listener failed")
