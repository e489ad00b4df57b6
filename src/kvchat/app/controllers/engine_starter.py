"""The local engine, made on a worker thread so that the window shows first.

Making the engine imports torch and transformers (3-5 s on two cores). Done on the GUI thread before
``show()``, that is how long a user waited for any window. An EngineStarter stands in for the
Engine from the start: the bridge and the window hold it as they would hold the engine. Until the
engine exists it keeps what they ask of it (listeners, a model switch, a cancel, a reconfigure,
close) and hands it over, in order, the moment the engine is made; from then on every attribute is
the engine's own."""
import threading
from concurrent.futures import Future

from kvchat.core.backend import LOCAL
from kvchat.core.config import EngineConfig
from kvchat.core.events import EngineError, LoadFailed, RequestHandle

STILL_STARTING = "the engine is still starting; send again once the model is ready"


class EngineStarter:
    capabilities = LOCAL  # it stands in for the local engine

    def __init__(self, config: EngineConfig, make):
        """``make(config)`` makes the engine (the ``kvchat`` command's local_engine)."""
        self._config = config
        self._make = make
        self._engine = None
        self._lock = threading.Lock()  # orders the GUI's calls against the hand-over
        self._pending: list[tuple[str, tuple, Future]] = []
        self._closed = False
        self._failure: str | None = None  # the engine could not be made (a broken install)
        self._ready = threading.Event()  # stands in for the engine's until it exists
        self._thread: threading.Thread | None = None

    def start(self) -> "EngineStarter":
        """Make the engine on a worker thread (once)."""
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="kvchat-engine-start", daemon=True)
                self._thread.start()
        return self

    def _run(self) -> None:
        try:
            engine = self._make(self._config)
        except Exception as e:  # torch or the engine cannot be imported: said like a failed load
            self._fail(f"the engine could not start: {type(e).__name__}: {e}")
            return
        with self._lock:
            self._engine, pending, self._pending = engine, self._pending, []
            closed = self._closed
        for name, args, future in pending:
            _settle(future, getattr(engine, name), args)
        if closed:
            engine.close()

    def _fail(self, message: str) -> None:
        with self._lock:
            self._failure, pending, self._pending = message, self._pending, []
        for name, args, future in pending:
            if name == "add_listener":
                args[0](LoadFailed(message))
            future.set_result(None)
        self._ready.set()

    def _call(self, name: str, *args):
        """The engine's method now, or once it exists (a Future for its result)."""
        with self._lock:
            engine = self._engine
            if engine is None and self._failure is None:
                future = Future()
                self._pending.append((name, args, future))
                return future
        if engine is None:  # it could not be made: nothing to ask
            if name == "add_listener":
                args[0](LoadFailed(self._failure))
                return None
            refused = Future()
            refused.set_exception(EngineError(self._failure))
            return refused
        return getattr(engine, name)(*args)

    # -- the engine's interface, as the bridge and the window use it --

    def add_listener(self, callback, replay: bool = False) -> None:
        self._call("add_listener", callback, replay)

    def load_model(self, config: EngineConfig, loaded=None):
        with self._lock:
            if self._engine is None and self._thread is None:  # not started yet: start with this one
                self._config = config
                return None
        return self._call("load_model", config, loaded)

    def cancel_load(self) -> None:
        self._call("cancel_load")

    def reconfigure(self, max_context=None, kv_precision=None, headroom_bytes=None) -> Future:
        return self._call("reconfigure", max_context, kv_precision, headroom_bytes)

    def submit(self, request, listener=None) -> RequestHandle:
        engine = self._engine
        if engine is not None:
            return engine.submit(request, listener)
        handle = RequestHandle(request, listener)
        handle.refuse(STILL_STARTING)
        return handle

    def cancel(self, handle):
        return self._call("cancel", handle)

    def forget(self, messages):
        return self._call("forget", messages)

    def tokenize(self, text: str):
        return self._call("tokenize", text)

    def close(self, timeout: float = 2.0) -> bool:
        """Close the engine, or the one still being made as soon as it exists."""
        with self._lock:
            self._closed, engine, thread = True, self._engine, self._thread
        if engine is not None:
            return engine.close(timeout)
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    @property
    def config(self) -> EngineConfig:
        return self._engine.config if self._engine is not None else self._config

    @property
    def ready(self) -> threading.Event:
        return self._engine.ready if self._engine is not None else self._ready

    @property
    def load_error(self) -> str | None:
        return self._engine.load_error if self._engine is not None else self._failure

    @property
    def loaded(self):
        return self._engine.loaded if self._engine is not None else None

    @property
    def alive(self) -> bool:
        if self._engine is not None:
            return self._engine.alive
        return not self._closed and self._failure is None

    def __getattr__(self, name: str):
        """Everything else is the engine's (its pool, formatter...), once it exists."""
        engine = self.__dict__.get("_engine")
        if engine is None:
            raise AttributeError(f"{name}: the engine is still starting")
        return getattr(engine, name)


def _settle(future: Future, method, args) -> None:
    """Run a call kept for the engine; its Future follows the engine's own answer."""
    try:
        result = method(*args)
    except Exception as e:
        future.set_exception(e)
        return
    if isinstance(result, Future):
        result.add_done_callback(lambda done: _copy(done, future))
    else:
        future.set_result(result)


def _copy(done: Future, into: Future) -> None:
    if done.exception() is not None:
        into.set_exception(done.exception())
    else:
        into.set_result(done.result())
