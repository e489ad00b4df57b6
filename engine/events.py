"""What a request hands back: events, and the handle that carries them across threads."""
import queue
import threading
from dataclasses import dataclass, field

from .config import SamplingParams


class EngineError(RuntimeError):
    """A request the engine could not serve; the message is one line for the user."""


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft_ms: float = 0.0
    decode_tok_s: float = 0.0
    kv_precision: str = "fp16"
    trimmed_messages: int = 0  # oldest messages left out so the conversation fits the context

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
class LoadProgress:
    """Bytes of the model downloaded so far; ``total`` 0 while unknown."""
    done: int
    total: int


@dataclass
class Notice:
    """Something the user should know: kind is downshift, shrink, evict, trim or pressure."""
    kind: str
    message: str


@dataclass
class Error:
    message: str
    internal: bool = False  # a bug or a device failure, not the request's fault


@dataclass
class Request:
    messages: list[dict] | None = None
    prompt_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)


class RequestHandle:
    def __init__(self, request: Request):
        self.request = request
        self.events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()

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
