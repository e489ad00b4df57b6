"""What answers a conversation: the local Engine or a remote OpenAI-compatible server. The app and
``kvchat chat`` hold a Backend and never ask which one it is; the events are the same (TokenDelta,
Finished with stats, Error), and stop is ``handle.cancel()`` on both."""
import threading
from typing import Protocol, runtime_checkable

from .events import Request, RequestHandle


@runtime_checkable
class Backend(Protocol):
    ready: threading.Event  # set once the model is loaded, or the server answered /v1/models
    load_error: str | None  # why it cannot serve, once ready is set

    def submit(self, request: Request) -> RequestHandle: ...

    def add_listener(self, callback) -> None:
        """Memory events: MemorySnapshot and Notice (local), ServerMemory (remote)."""

    def wait_ready(self, timeout: float | None = None) -> None: ...

    def cancel_load(self) -> None: ...

    def close(self) -> None: ...

    @property
    def alive(self) -> bool: ...


def open_backend(config=None, remote: str | None = None, api_key: str | None = None,
                 model: str | None = None) -> Backend:
    """The local engine for ``config``, or a connection to ``remote`` (a base URL) with ``model``
    (None: the server's first). Returns at once; ``wait_ready`` blocks until it can serve."""
    if remote:
        from .remote import RemoteBackend

        return RemoteBackend(remote, api_key=api_key, model=model)
    from .engine import Engine

    return Engine(config)
