"""What callers ask of the engine thread: typed commands, each with a future that always resolves
(done, refused with a reason, or failed with a reason). The engine thread is the only reader."""
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvchat.core.config import EngineConfig
from kvchat.core.events import Refused, RequestHandle

__all__ = ["Cancel", "Command", "Forget", "LoadModel", "PersonaQuery", "Reconfigure", "Refused", "Shutdown", "Submit",
           "Tokenize", "refuse"]


@dataclass
class Submit:
    handle: RequestHandle

    @property
    def future(self) -> Future:
        return self.handle.future


@dataclass
class Cancel:
    handle: RequestHandle
    future: Future = field(default_factory=Future)


@dataclass
class Reconfigure:
    max_context: int | None = None
    kv_precision: str | None = None
    headroom_bytes: int | None = None
    future: Future = field(default_factory=Future)


@dataclass
class LoadModel:
    config: EngineConfig
    loaded: object = None  # an already loaded model (tests, benchmarks): no load from disk
    seq: int = 0  # order among LoadModel commands: a newer one replaces this one
    future: Future = field(default_factory=Future)


@dataclass
class Tokenize:
    """A plain prompt's token ids, from the loaded model's tokenizer on the engine thread (the one
    owner of the model, so a model switch cannot pull it away midway). A prompt that cannot fit the
    context is refused with ChatError, on its length in characters when that suffices."""
    text: str
    future: Future = field(default_factory=Future)


@dataclass
class PersonaQuery:
    """Is this persona's prefix warm (the badge's question)? Answered on the engine thread between
    requests, so the pool it reads is never one being rebuilt or switched."""
    system_prompt: str
    future: Future = field(default_factory=Future)


@dataclass
class Forget:
    """Privacy: a deleted chat's KV goes from the pool, RAM and disk (``messages`` as the chat sent
    them, its persona first; the persona's own blocks stay, other chats use them), or, with
    ``messages`` None, every cached conversation's ("Clear cached conversations"; personas stay).
    The future gives the number of blocks deleted."""
    messages: list[dict] | None = None
    future: Future = field(default_factory=Future)
    named: tuple | None = field(default=None, repr=False)  # the engine's (pool key, first block, hashes), once


@dataclass
class Shutdown:
    future: Future = field(default_factory=Future)


Command = Submit | Cancel | Reconfigure | LoadModel | Tokenize | PersonaQuery | Forget | Shutdown


def refuse(command: Command, reason: str) -> None:
    """Resolve a command the engine will not run. A request gets its Error event as well, so a
    caller that iterates the handle stops."""
    if isinstance(command, Submit):
        command.handle.refuse(reason)
    elif not command.future.done():
        command.future.set_exception(Refused(reason))
