"""A remote backend from what a user names: a saved connection (its key from the keyring) or a URL."""
from kvchat.core.connections import Connections, get_key
from kvchat.core.events import EngineError
from kvchat.remote.client import RemoteBackend


def open_remote(target: str, api_key: str | None = None, model: str | None = None,
                saved_only: bool = False) -> RemoteBackend:
    """``target``: a saved connection's name, else (unless ``saved_only``) a server's base URL.
    Returns at once; ``wait_ready`` blocks until the server answered."""
    saved = Connections().get(target)
    if saved is None and saved_only:
        raise EngineError(f"no saved connection named {target!r} (see: kvchat connections list)")
    url = saved.base_url if saved else target
    key = api_key or (get_key(saved.name) if saved else None)
    return RemoteBackend(url, api_key=key, model=model or (saved.model if saved else None))
