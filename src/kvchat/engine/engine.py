"""The Engine: one long-lived actor. Its thread owns the model, the KV pool and every change to
them, and takes typed commands (Submit, Tokenize, PersonaQuery, Cancel, Reconfigure, LoadModel,
Shutdown) from one queue; each command's future always resolves. The work is delegated: loading to the model host
(host.py), memory to the governor (governor.py), which requests run each step to the scheduler
(scheduler.py), a request's life to its job (job.py), its prompt to the prompt builder
(prompt.py). Requests run together, a step at a time; a command that changes the model or the
pool waits until none runs, and requests sent after it wait for it. A question about the pool (the
persona badge's) and a deleted chat's Forget are answered between two steps: the thread that steps
is the one that reads and drops."""
import logging
import queue
import threading
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import asdict

from kvchat.core.commands import (Cancel, Command, Forget, LoadModel, PersonaQuery, Reconfigure, Shutdown, Submit,
                                  Tokenize, refuse)
from kvchat.core.config import EngineConfig, Precision, SamplingParams
from kvchat.core.memory_policy import MemoryPolicy
from kvchat.core.events import EngineError, Error, Finished, LoadFailed, ModelReady, Notice, Request, RequestHandle
from kvchat.engine.prompt import PromptBuilder
from kvchat.engine.scheduler import Scheduler
from kvchat.engine.governor import SNAPSHOT_PERIOD, MemoryGovernor
from kvchat.engine.host import ModelHost
from kvchat.engine.kv.forget import answer_forget, chat_in_use
from kvchat.engine.kv.persona_probe import answer_persona_query
from kvchat.engine.kv.disk_tier import DiskTier
from kvchat.engine.kv.pool import KVPool
from kvchat.engine.load_order import LoadOrder
from kvchat.engine.model.loading import LoadedModel

log = logging.getLogger("kvchat.engine")
CLOSE_TIMEOUT = 2.0  # seconds close() waits for the current step to end


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 probe=None, disk_tier: DiskTier | bool | None = True):
        # what the model host loads, and what the governor and the runner work on
        self.config = config or EngineConfig()
        self.loaded: LoadedModel | None = None
        self.kvpool: KVPool | None = None
        self.formatter = None  # the loaded model's ChatFormatter
        self.eos_ids: set[int] = set()
        self.probe = probe
        self.weights_bytes = self.activations = 0
        self.policy = MemoryPolicy(Precision.AUTO)  # what Auto decides about the pool; set with the config
        self.ready = threading.Event()  # set while no load is under way
        self.load_error: str | None = None  # why no model is loaded, when none is
        self.host = ModelHost(self, probe, disk_tier)
        self.governor = MemoryGovernor(self)
        self.prompts = PromptBuilder(weakref.proxy(self))
        self.scheduler = Scheduler(self)
        # the actor's own bookkeeping
        self._listeners: list = []
        self._status: ModelReady | LoadFailed | None = None  # how the last load ended
        self._commands: queue.Queue = queue.Queue()
        self._held: deque[Command] = deque()  # taken, waiting for no request to run (and what came after)
        self._lock = threading.Lock()  # orders _closed against puts, so no command is queued after the drain
        self._closed = False
        self._stopping = threading.Event()
        self.loads = LoadOrder()  # which LoadModel is the newest
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
            command = LoadModel(config, loaded, self.loads.next())
        self._cancel_running()
        return self._put(command)

    def persona_state(self, system_prompt: str, timeout: float | None = None) -> str:
        """Is this persona's prefix warm (``persona_probe``): the badge's question, asked off the
        engine thread and answered on it, between two steps."""
        return self._put(PersonaQuery(system_prompt)).result(timeout)

    def forget(self, messages: list[dict] | None = None) -> Future:
        """Delete a chat's KV from every tier (its persona's stays), or with None every cached
        conversation's (``kv/forget.py``): a chat's between two steps, all of them when no reply runs."""
        return self._put(Forget(messages))

    def cancel_load(self) -> None:
        """Stop the model load under way or queued (a download stops at its next chunk)."""
        self.loads.cancel()

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

    def settings(self) -> dict:
        """The config as the GUI shows it, plain values only."""
        out = asdict(self.config)
        out["kv_precision"] = self.config.kv_precision.value
        if self.kvpool is not None:
            out["precision"] = self.kvpool.precision.value
        return out

    def _put(self, command: Command) -> Future:
        with self._lock:
            if not self._closed:
                self._commands.put(command)
                return command.future
        refuse(command, "the engine is shut down")
        return command.future

    def _cancel_running(self) -> None:
        """Any thread: flags only; each request ends at its next step."""
        self.scheduler.cancel_all()

    # -- the engine thread --

    def _main(self) -> None:
        try:
            while True:
                busy = self.scheduler.busy()
                try:
                    command = self._commands.get(block=not busy, timeout=None if busy else SNAPSHOT_PERIOD)
                except queue.Empty:
                    command = None
                if isinstance(command, Shutdown):
                    return self._shutdown(command)
                if command is not None:
                    self._take(command)  # every queued command before the next step
                elif busy:
                    self.scheduler.step()
                else:
                    self.host.prepare_decode()
                    self.governor.tick()
                self._run_held()
        finally:  # even a bug here leaves no caller waiting
            with self._lock:
                self._closed = True
            self._refuse_queued("the engine has stopped")
            self.ready.set()

    def _take(self, command: Command) -> None:
        """A request joins the scheduler; a cancel, a tokenize, a persona question or a deleted chat's
        Forget is answered now; the rest waits until no request runs (``_waits``). Requests taken
        after a waiting command wait behind it."""
        if isinstance(command, Cancel):
            command.handle.cancel()
            return command.future.set_result(True)
        if self._held or _waits(self, command):
            self._held.append(command)
            return
        self._run(command)

    def _run_held(self) -> None:
        while self._held and not _waits(self, self._held[0]):
            self._run(self._held.popleft())
            self.governor.tick()

    def _run(self, command: Command) -> None:
        if self._stopping.is_set():
            return refuse(command, "the engine is shutting down")
        if isinstance(command, LoadModel):
            return self.host.load(command)
        if isinstance(command, PersonaQuery):
            return answer_persona_query(self, command)
        if isinstance(command, Forget):
            return answer_forget(self, command)
        if self.kvpool is None:
            return refuse(command, self.load_error or "no model is loaded")
        if isinstance(command, Tokenize):
            return self.prompts.tokenize(command)
        try:
            if isinstance(command, Submit):
                self.scheduler.add(command.handle)  # its first token starts the compile (scheduler.py)
            else:
                self.governor.control(command)
        except Exception as e:  # control resolves its own; this is a last resort
            log.exception("command failed")
            _fail(command, f"internal error: {type(e).__name__}: {e}")

    def _shutdown(self, command: Shutdown) -> None:
        with self._lock:
            self._closed = True
        self.scheduler.cancel_all()
        self.scheduler.refuse_waiting("the engine is shut down")
        while self.scheduler.running:  # cancelled: each ends at this step, its blocks released
            self.scheduler.step()
        self.host.end_compiles()
        self._refuse_queued("the engine is shut down")
        command.future.set_result(None)  # the model stays readable (stats, tests); the process is ending

    def _refuse_queued(self, reason: str) -> None:
        while self._held:
            refuse(self._held.popleft(), reason)
        self.scheduler.end_all(reason)
        while True:
            try:
                refuse(self._commands.get_nowait(), reason)
            except queue.Empty:
                return

    def switching(self) -> bool:
        """A shutdown or a newer model is on its way: a request taken now is cancelled at once."""
        return self._stopping.is_set() or self.loads.switching()

    # -- events --

    def notice(self, kind: str, message: str) -> None:
        notice = Notice(kind, message)
        log.info("%s: %s", kind, message)
        for handle in self.scheduler.handles():
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


def _waits(engine: Engine, command: Command) -> bool:
    """Held until no request runs: it changes the model or the pool. A persona question held so
    made every message sent after it wait for all running replies (the app asks one each time a
    chat opens); so did a deleted chat's Forget, which waits only for a request that continues the chat."""
    if not engine.scheduler.busy() or isinstance(command, (Submit, Tokenize, PersonaQuery)):
        return False
    if isinstance(command, Forget) and command.messages is not None:
        return chat_in_use(engine, command)
    return True


def _fail(command: Command, message: str) -> None:
    if isinstance(command, Submit):
        command.handle.put(Error(message, internal=True))
    elif not command.future.done():
        command.future.set_exception(EngineError(message))
