"""What answers a conversation: the local Engine or a remote OpenAI-compatible server. The app and
``kvchat chat`` hold a Backend and never ask which one it is; the events are the same (ModelReady or
LoadFailed once it can serve or cannot, TokenDelta, Finished with stats, Error), and stop is
``cancel(handle)`` on both."""
import threading
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

from kvchat.core.events import EngineError, Request, RequestHandle


@runtime_checkable
class Backend(Protocol):
    ready: threading.Event  # set once the model is loaded, or the server answered /v1/models
    load_error: str | None  # why it cannot serve, once ready is set

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

    def close(self) -> None: ...

    @property
    def alive(self) -> bool: ...


def open_backend(config=None, remote: str | None = None, api_key: str | None = None,
                 model: str | None = None, connection: str | None = None) -> Backend:
    """The local engine for ``config``; a server at ``remote`` (a base URL) with ``model`` (None: the
    server's first); or the saved ``connection`` of that name, with its key from the keyring.
    Returns at once; ``wait_ready`` blocks until it can serve."""
    if connection:
        from kvchat.core.connections import Connections, get_key

        saved = Connections().get(connection)
        if saved is None:
            raise EngineError(f"no saved connection named {connection!r} (see: kvchat connections list)")
        remote, api_key, model = saved.base_url, api_key or get_key(saved.name), model or saved.model
    if remote:
        from kvchat.remote.client import RemoteBackend

        return RemoteBackend(remote, api_key=api_key, model=model)
    from kvchat.engine.engine import Engine

    return Engine(config)
