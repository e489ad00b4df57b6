"""A fake of the local Engine for the GUI's tests: the Backend protocol (core/backend.py) and the
engine's own commands (load_model, reconfigure, tokenize), as one actor thread that takes the same
typed commands (core/commands.py) from one queue and gives the same events (core/events.py) in the
same order as engine/engine.py, with canned replies and no model (fake_model.py).

What a test controls: ``pace`` (how far a reply may stream: free, held, or in lockstep with the
window), ``warm_up()`` (the first reply waits for a decode step being compiled), ``model.forward``
(replace it to fail a request as a device would), ``PersonaDisk`` (personas' KV kept across fakes)."""
import queue
import threading
from concurrent.futures import Future
from dataclasses import asdict

from kvchat.core.backend import LOCAL
from kvchat.engine.outbox import Outbox
from kvchat.core.commands import Cancel, Command, LoadModel, Reconfigure, Shutdown, Submit, Tokenize, refuse
from kvchat.core.config import EngineConfig, Precision, SamplingParams
from kvchat.core.events import EngineError, Finished, Request, RequestHandle
from kvchat.engine.load_order import LoadOrder

from support import fake_host
from support.fake_model import PersonaDisk, PrefixCache, persona_ids, snapshot
from support.fake_request import serve
from support.pace import Pace

__all__ = ["FakeBackend", "Pace", "PersonaDisk"]
SNAPSHOT_PERIOD = 1.0  # seconds between the idle engine's memory snapshots (engine/governor.py)


class FakeBackend:
    capabilities = LOCAL  # it stands in for the local engine

    def __init__(self, config: EngineConfig | None = None, disk: PersonaDisk | None = None,
                 converted: set | None = None):
        self.config = config or EngineConfig()
        self.model = None  # the FakeModel loaded
        self.precision = Precision.FP16
        self.cache = PrefixCache()
        self.disk = disk
        self.converted = converted if converted is not None else set()  # GGUF files converted once already
        self.pace = Pace()
        self.compiled: threading.Event | None = None  # set: a decode step to prepare before the next reply
        self.background = False
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.handle: RequestHandle | None = None
        self.commands_seen: list = []  # every command the actor ran, in order
        # the engine's own listeners, notices and replayed load status (engine/outbox.py)
        self.out = Outbox(lambda: [self.handle] if self.handle is not None else [])
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._stopping = threading.Event()
        self.good: EngineConfig | None = None
        self.loads = LoadOrder()  # which LoadModel is the newest, as the engine keeps it
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

    def forget(self, messages=None) -> Future:
        """It keeps no KV tiers: nothing to delete."""
        done = Future()
        done.set_result(0)
        return done

    def cancel(self, handle: RequestHandle) -> Future:
        handle.cancel()
        self.pace.wake()
        return self._put(Cancel(handle))

    def reconfigure(self, max_context=None, kv_precision=None, headroom_bytes=None) -> Future:
        return self._put(Reconfigure(max_context, kv_precision, headroom_bytes))

    def load_model(self, config: EngineConfig, loaded=None) -> Future:
        with self._lock:
            command = LoadModel(config, loaded, self.loads.next())
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
        self.loads.cancel()

    def add_listener(self, callback, replay: bool = False) -> None:
        self.out.add_listener(callback, replay)

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self.ready.wait(timeout):
            raise EngineError("the model is still loading")
        if self.load_error:
            raise EngineError(self.load_error)

    def flush(self) -> Future:
        """Resolves once every command queued before it has run, so every event they gave has been
        handed to the listeners (a test then processes Qt's queue to see them all delivered)."""
        return self._put(Cancel(RequestHandle(Request())))

    def warm_up(self, background: bool = False) -> threading.Event:
        """The next reply first prepares the decode step, as after a start: captured on CUDA, which
        the reply waits for until the test sets the event returned; or (``background``) compiled on
        the CPU's thread of its own, which no reply waits for (engine/host.py prepare_decode)."""
        self.compiled, self.background = threading.Event(), background
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
            fake_host.load(self, command)
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
            fake_host.reconfigure(self, command)
        self._snapshot()

    def _refuse_queued(self, reason: str) -> None:
        while True:
            try:
                refuse(self._commands.get_nowait(), reason)
            except queue.Empty:
                return

    def _warm_decode(self) -> None:
        if self.compiled is not None and self.background:
            self.compiled = None
            self.notice("warm-up", "preparing fast decoding in the background: replies start at once, faster "
                                   "when it is ready")
        elif self.compiled is not None:
            self.notice("warm-up", "preparing fast decoding (capturing the decode step: seconds, a minute the first time)")
            self.compiled.wait()
            self.compiled = None
            self.notice("warm-up", "fast decoding ready (4 s)")

    # -- loading (support/fake_host.py): which LoadModel is the newest --

    def switching(self) -> bool:
        return self._stopping.is_set() or self.loads.switching()

    # -- events --

    def notice(self, kind: str, message: str) -> None:
        self.out.notice(kind, message)

    def _snapshot(self, in_use: int = 0) -> None:
        if self.model is not None:
            self.emit(snapshot(self.model, self.config, self.precision, self.cache.tokens(), in_use))

    def announce(self, status) -> None:
        self.out.announce(status)

    def emit(self, event) -> None:
        self.out.emit(event)

