"""The Engine: one long-lived actor. Its thread owns the model, the KV pool and every change to
them, and takes typed commands (Submit, Tokenize, PersonaQuery, Cancel, Reconfigure, LoadModel,
Shutdown) from one queue; each command's future always resolves. The work is delegated: loading to the model host
(host.py), memory to the governor (governor.py), which requests run each step to the scheduler
(scheduler.py), a request's life to its job (job.py), its prompt to the prompt builder
(prompt.py), what it says to the listeners to the outbox (outbox.py). What a load makes is one
``Session`` (session.py), which the engine holds and swaps whole, and hands to its parts: none of
them holds the engine. Requests run together, a step at a time; a command that changes the model or the
pool waits until none runs, and requests sent after it wait for it. A question about the pool (the
persona badge's) and a deleted chat's Forget are answered between two steps: the thread that steps
is the one that reads and drops."""
import logging
import queue
import threading
from collections import deque
from concurrent.futures import Future

from kvchat.core.backend import LOCAL
from kvchat.core.commands import (Cancel, Command, Forget, LoadModel, PersonaQuery, Reconfigure, Shutdown, Submit,
                                  Tokenize, refuse)
from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.core.events import EngineError, Error, Finished, Request, RequestHandle
from kvchat.engine.outbox import Outbox
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
from kvchat.engine.session import Session, config_settings

log = logging.getLogger("kvchat.engine")
CLOSE_TIMEOUT = 2.0  # seconds close() waits for the current step to end


class Engine:
    capabilities = LOCAL

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 probe=None, disk_tier: DiskTier | bool | None = True):
        self.session: Session | None = None  # what the model host loaded; the engine thread swaps it
        self.ready = threading.Event()  # set while no load is under way
        self.loads = LoadOrder()  # which LoadModel is the newest
        self._stopping = threading.Event()
        self.out = Outbox()
        self.host = ModelHost(self.out, self.loads, config or EngineConfig(), probe, disk_tier)
        self.governor = MemoryGovernor(self.out)
        stopping, loads = self._stopping, self.loads  # not self: no part holds the engine
        switching = lambda: stopping.is_set() or loads.switching()  # a request taken now is cancelled at once
        self.prompts = PromptBuilder(self.out.notice)
        self.scheduler = Scheduler(self.out.notice, self.prompts, switching)
        self.out.handles = self.scheduler.handles
        self._commands: queue.Queue = queue.Queue()
        self._held: deque[Command] = deque()  # taken, waiting for no request to run (and what came after)
        self._lock = threading.Lock()  # orders _closed against puts, so no command is queued after the drain
        self._closed = False
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
        self.out.add_listener(callback, replay)

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

    # -- what is loaded, read from the session (None while no model is) --

    @property
    def config(self) -> EngineConfig:
        s = self.session  # read once: the engine thread may set it to None between two reads
        return s.config if s is not None else self.host.config

    @property
    def load_error(self) -> str | None:
        return self.host.load_error

    @property
    def loaded(self) -> LoadedModel | None:
        s = self.session
        return s.loaded if s is not None else None

    @property
    def kvpool(self) -> KVPool | None:
        s = self.session
        return s.kvpool if s is not None else None

    def settings(self) -> dict:
        """The config as the GUI shows it, plain values only."""
        return self.session.settings() if self.session is not None else config_settings(self.config)

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
                    if self.scheduler.step(self.session):  # a token came
                        self._between_steps(between_tokens=True)
                else:
                    self._between_steps()
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

    def _between_steps(self, between_tokens: bool = False) -> None:
        """Memory and the decode step's compiles: after a first token, not before it (a compile shares
        the GIL with the prefill: first token 5.9 s in bench startup when it started first), or when
        idle. A failure here (a compile child that cannot start) is logged: the engine thread goes on."""
        try:
            self.governor.tick(self.session, self.scheduler.live())
            self.host.prepare_decode(self.session, between_tokens)
        except Exception:
            log.exception("between two steps")

    def _run_held(self) -> None:
        while self._held and not _waits(self, self._held[0]):
            self._run(self._held.popleft())
            self.governor.tick(self.session)

    def _run(self, command: Command) -> None:
        if self._stopping.is_set():
            return refuse(command, "the engine is shutting down")
        if isinstance(command, LoadModel):
            return self._load(command)
        if isinstance(command, PersonaQuery):
            return answer_persona_query(self.session, command)
        if isinstance(command, Forget):
            return answer_forget(self.session, command, lambda: self.host.disk_tier(self.config))
        if self.session is None:
            return refuse(command, self.load_error or "no model is loaded")
        if isinstance(command, Tokenize):
            return self.prompts.tokenize(self.session, command)
        try:
            if isinstance(command, Submit):
                self.scheduler.add(command.handle, self.session)  # its first token starts the compile
            else:
                self.session = self.governor.control(self.session, command)
                self.host.applied(self.session.config)
        except Exception as e:  # control resolves its own; this is a last resort
            log.exception("command failed")
            _fail(command, f"internal error: {type(e).__name__}: {e}")

    def _load(self, command: LoadModel) -> None:
        """The current session closed, the new one opened (or the previous one again)."""
        if self.loads.superseded(command.seq):
            return refuse(command, "replaced by a later model choice")
        self.ready.clear()
        try:
            current, self.session = self.session, None
            self.session = self.host.load(command, current)
            self.governor.soon()
        finally:
            if self.loads.ended(command.seq):
                self.ready.set()

    def _shutdown(self, command: Shutdown) -> None:
        with self._lock:
            self._closed = True
        self.scheduler.cancel_all()
        self.scheduler.refuse_waiting("the engine is shut down")
        while self.scheduler.running:  # cancelled: each ends at this step, its blocks released
            self.scheduler.step(self.session)
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



def _waits(engine: Engine, command: Command) -> bool:
    """Held until no request runs: it changes the model or the pool. A persona question held so
    made every message sent after it wait for all running replies (the app asks one each time a
    chat opens); so did a deleted chat's Forget, which waits only for a request that continues the chat."""
    if not engine.scheduler.busy() or isinstance(command, (Submit, Tokenize, PersonaQuery)):
        return False
    if isinstance(command, Forget) and command.messages is not None:
        return chat_in_use(engine.session, (*engine.scheduler.running, *engine.scheduler.waiting), command)
    return True


def _fail(command: Command, message: str) -> None:
    if isinstance(command, Submit):
        command.handle.put(Error(message, internal=True))
    elif not command.future.done():
        command.future.set_exception(EngineError(message))
