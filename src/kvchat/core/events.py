"""What a request hands back: events, and the handle that carries them across threads."""
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvchat.core.config import SamplingParams

# the "warm-up" notice that a compile runs in the background (the app counts its time: compile_ticker)
PREPARING = "preparing fast decoding in the background: replies start at once, faster when it is ready"


class EngineError(RuntimeError):
    """A request the engine could not serve; the message is one line for the user."""


class Refused(EngineError):
    """A command the engine declined without trying (shut down, no model, replaced); one line."""


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft_ms: float = 0.0
    decode_tok_s: float = 0.0
    kv_precision: str = "fp16"
    trimmed_messages: int = 0  # oldest messages left out so the conversation fits the context
    ram_tokens: int = 0  # of cached_tokens, those restored from the host-RAM tier
    disk_tokens: int = 0  # and from the disk tier; the rest were in the pool
    accepted_prediction_tokens: int = 0  # proposed (lookup or the client's prediction) and kept
    rejected_prediction_tokens: int = 0  # proposed and not kept

    @property
    def pool_tokens(self) -> int:
        return self.cached_tokens - self.ram_tokens - self.disk_tokens

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class TokenDelta:
    text: str
    token_id: int


@dataclass
class Finished:
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | cancelled
    stats: Stats


@dataclass
class PrefillProgress:
    """How far a request's prompt is computed: ``done`` of ``total`` prompt tokens, its cached
    prefix counted as done. Sent before each prefill chunk and once all are done, so that a long
    prompt shows its progress and an estimate; the first token follows."""
    done: int
    total: int


@dataclass
class LoadProgress:
    """How far a load is: ``stage`` "download" counts bytes, "convert" the tensors of a GGUF being
    converted, "weights" the tensors loaded; "read", "tokenizer" and "model", a conversion's steps
    before its count, have ``total`` 0 (models.load)."""
    done: int
    total: int
    stage: str = "download"


@dataclass
class Notice:
    """Something the user should know: kind is downshift, shrink, evict, trim, pressure, eager
    (decoding without compilation) or warm-up (compiling the decode step)."""
    kind: str
    message: str


def replies_wait(notice: Notice) -> bool | None:
    """What a notice says of the decode step's warm-up: True while replies wait for it (a CUDA
    capture holds the engine for its seconds), False once none does (ready, eager, or a CPU compile
    in the background, which replies never wait for); None for a notice about something else."""
    if notice.kind not in ("warm-up", "eager"):
        return None
    return notice.kind == "warm-up" and notice.message.startswith("preparing") and "background" not in notice.message


@dataclass
class ModelReady:
    """A model finished loading and serves requests; ``settings`` are the engine's config as a
    dict, ``model_config`` the model's own (transformers) config, for planning."""
    label: str
    settings: dict
    model_config: object = None
    generation: dict = field(default_factory=dict)  # the model's generation_config.json, as its authors set it


@dataclass
class LoadFailed:
    """A model could not be loaded. ``settings`` are those of the previous model when it is back
    (and serves requests again), None when no model is loaded."""
    message: str
    settings: dict | None = None

    @property
    def restored(self) -> bool:
        return self.settings is not None


@dataclass
class Reconfigured:
    settings: dict  # the engine's config as applied (Engine.settings), and kv_budget


@dataclass
class Error:
    message: str
    internal: bool = False  # a bug or a device failure, not the request's fault


@dataclass
class Request:
    messages: list[dict] | None = None
    prompt_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prediction: str | None = None  # the reply's expected text (OpenAI's Predicted Outputs): proposed first


class RequestHandle:
    """A request's events, in order, ending with Finished or Error. ``listener``, when given, sees
    each event too, on the engine thread (it must only hand it on). ``future`` resolves with the
    last event (Finished, or EngineError for Error), so a request's end can be awaited like any
    other command's."""

    def __init__(self, request: Request, listener=None):
        self.request = request
        self.events: queue.Queue = queue.Queue()
        self.future: Future = Future()
        self.listener = listener
        self.sent = time.perf_counter()  # TTFT counts from here: a wait in the queue is the user's wait too
        self._cancel = threading.Event()

    def put(self, event, refused: bool = False) -> None:
        if self.future.done():  # a request ends once; later events (a shutdown's refusal) are moot
            return
        self.events.put(event)
        if self.listener is not None:
            try:
                self.listener(event)
            except Exception:  # a broken listener must not take the engine thread down
                logging.getLogger("kvchat.engine").exception("a request listener failed")
        if isinstance(event, Finished):
            self.future.set_result(event)
        elif isinstance(event, Error):
            self.future.set_exception((Refused if refused else EngineError)(event.message))

    def refuse(self, reason: str) -> None:
        """End a request the engine will not run: an Error event, and Refused from the future."""
        self.put(Error(reason), refused=True)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def __iter__(self):
        while True:
            event = self.events.get()
            yield event
            if isinstance(event, (Finished, Error)):
                return

    def result(self, timeout: float | None = None) -> Finished:
        """Wait for the end; raises EngineError if the request failed."""
        while True:
            event = self.events.get(timeout=timeout)
            if isinstance(event, Error):
                raise EngineError(event.message)
            if isinstance(event, Finished):
                return event
