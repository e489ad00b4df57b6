"""What answers a conversation: the local Engine (kvchat.engine) or a remote OpenAI-compatible
server (kvchat.remote). The app and ``kvchat chat`` hold a Backend and never ask which one it is;
the ``kvchat`` command (kvchat.cli) is the one place that makes the local engine; the events are the same (ModelReady or
LoadFailed once it can serve or cannot, TokenDelta, Finished with stats, Error), and stop is
``cancel(handle)`` on both."""
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvchat.core.events import Request, RequestHandle


@dataclass(frozen=True)
class Capabilities:
    """What a backend lets its caller change or ask: the app reads these, never which backend it
    holds. A method a backend cannot honour still exists and refuses, in its future."""
    models: bool = False  # loads the model the user picks (load_model)
    memory: bool = False  # its context, KV precision and headroom are the caller's (reconfigure)
    forget: bool = False  # a deleted chat's KV is deleted from its tiers (forget)
    tokenize: bool = False  # counts a text's tokens with the model's tokenizer (tokenize)


LOCAL = Capabilities(models=True, memory=True, forget=True, tokenize=True)
SERVER = Capabilities()  # a server's model, cache and tokenizer are its own


@runtime_checkable
class Backend(Protocol):
    ready: threading.Event  # set once the model is loaded, or the server answered /v1/models
    load_error: str | None  # why it cannot serve, once ready is set
    capabilities: Capabilities

    def submit(self, request: Request, listener=None) -> RequestHandle:
        """``listener(event)``, when given, sees the request's events on a background thread."""

    def cancel(self, handle: RequestHandle) -> Future: ...

    def persona_state(self, system_prompt: str) -> str:
        """The badge's answer: warm, disk, cold, short (persona_probe), or server."""

    def add_listener(self, callback, replay: bool = False) -> None:
        """ModelReady / LoadFailed, then memory events: MemorySnapshot and Notice (local),
        ServerMemory (remote). ``replay``: a late listener gets how the start ended at once."""

    def wait_ready(self, timeout: float | None = None) -> None: ...

    def cancel_load(self) -> None: ...

    def load_model(self, config) -> Future: ...

    def reconfigure(self, max_context=None, kv_precision=None, headroom_bytes=None) -> Future: ...

    def forget(self, messages: list[dict] | None) -> Future: ...

    def tokenize(self, text: str) -> Future: ...

    def close(self) -> None: ...

    @property
    def alive(self) -> bool: ...

