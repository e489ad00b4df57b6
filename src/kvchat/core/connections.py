"""Saved connections to remote servers. Name, base URL and model go in a JSON file in the config
dir; the API key goes only to the OS keyring (the ``keyring`` package), never to that file or to the
app's SQLite file."""
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import keyring
import keyring.errors
import platformdirs

SERVICE = "kvchat"
NO_KEYRING = ("no OS keyring is available here (a headless session has none): the API key was not "
              "saved. Pass it with --api-key or KVCHAT_REMOTE_API_KEY each time, or install a keyring "
              "service (GNOME Keyring, KWallet) or the keyrings.alt package.")


SESSION_NOTE = ("No OS keyring on this machine: the key is kept for this session only, until kvchat quits "
                "(the connection itself is saved). To keep keys, install a keyring service (GNOME Keyring, "
                "KWallet) or the keyrings.alt package.")
_session_keys: dict[str, str] = {}  # a connection's key where no keyring can keep it: this process only


class KeyringUnavailable(RuntimeError):
    pass


def keep_for_session(name: str, api_key: str) -> None:
    _session_keys[name] = api_key


def remember_key(name: str, api_key: str) -> bool:
    """The key of connection ``name`` in the OS keyring (True), else for this session only."""
    try:
        set_key(name, api_key)
        _session_keys.pop(name, None)  # an older session-only key would be read first
        return True
    except KeyringUnavailable:
        keep_for_session(name, api_key)
        return False


def refused_key(message: str) -> bool:
    """Did the server refuse the request for its key (missing or wrong)? ``message`` as the remote
    client words a server's error (``remote.client.server_error``)."""
    return any(f"answered {status}" in message for status in (401, 403))


@dataclass
class Connection:
    name: str
    base_url: str
    model: str | None = None


def config_dir() -> Path:
    root = os.environ.get("KVCHAT_HOME")
    path = Path(root) / "config" if root else Path(platformdirs.user_config_dir("kvchat"))
    path.mkdir(parents=True, exist_ok=True)
    return path


ENDPOINTS = ("/chat/completions", "/completions", "/models", "/embeddings")  # what people paste from docs


def server_url(url: str) -> str:
    """The URL as saved and used: ``http://`` where no scheme was typed, no trailing slash, and no
    endpoint after the API's root (a URL copied from a client's config often ends in one):
    'gpu-box:8000/v1/chat/completions' -> 'http://gpu-box:8000/v1'."""
    url = url.strip().rstrip("/")
    if url and "://" not in url:
        url = "http://" + url
    for endpoint in ENDPOINTS:
        if url.endswith(endpoint):
            url = url[:-len(endpoint)].rstrip("/")
    return url


def connection_problem(name: str, url: str) -> str | None:
    """Why a connection named ``name`` at ``url`` cannot be saved, or None: what the app's editor
    and ``kvchat connections add`` both check (a URL without a scheme is taken as http)."""
    from urllib.parse import urlsplit

    if not name or any(ch in name for ch in "\n\t"):
        return "a connection needs a name without tabs or newlines"
    if not url:
        return "a connection needs the server's base URL, e.g. http://gpu-box:8000"
    parts = urlsplit(url if "://" in url else "http://" + url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not a server's base URL: it starts with http:// or https:// (e.g. http://gpu-box:8000)"
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        return f"{url!r} has a port that is not a number"
    if parts.username is not None or parts.password is not None:  # it would sit in connections.json as written
        return ("a URL with a user name or password in it would be saved in plain text: give the URL without "
                "them, and the key as the API key (kept in the OS keyring)")
    return None


class Connections:
    def __init__(self, path: Path | None = None):
        self._path = path

    @property
    def path(self) -> Path:
        """Resolved at each use: the config dir follows KVCHAT_HOME as it is now."""
        return self._path or config_dir() / "connections.json"

    def all(self) -> list[Connection]:
        try:
            rows = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []
        return [Connection(**{k: r.get(k) for k in ("name", "base_url", "model")})
                for r in rows if isinstance(r, dict) and r.get("name") and r.get("base_url")]

    def get(self, name: str) -> Connection | None:
        return next((c for c in self.all() if c.name == name), None)

    def save(self, connection: Connection, api_key: str | None = None) -> None:
        """Add or replace by name. The key, when given, goes to the keyring first: a machine
        without one refuses before anything is written."""
        problem = connection_problem(connection.name, connection.base_url)
        if problem:
            raise ValueError(problem)
        connection = replace(connection, base_url=server_url(connection.base_url))
        if api_key:
            set_key(connection.name, api_key)
        rows = [c for c in self.all() if c.name != connection.name] + [connection]
        self._write(rows)

    def remove(self, name: str) -> None:
        self._write([c for c in self.all() if c.name != name])
        _session_keys.pop(name, None)
        try:
            keyring.delete_password(SERVICE, _user(name))
        except keyring.errors.KeyringError:  # no key saved, or no keyring at all
            pass

    def _write(self, rows: list[Connection]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps([asdict(c) for c in rows], indent=2))
        tmp.replace(self.path)


def _user(name: str) -> str:
    return f"connection:{name}"


def set_key(name: str, api_key: str) -> None:
    try:
        keyring.set_password(SERVICE, _user(name), api_key)
    except keyring.errors.NoKeyringError:
        raise KeyringUnavailable(NO_KEYRING) from None
    except keyring.errors.KeyringError as e:
        raise KeyringUnavailable(f"the OS keyring refused the key: {e}") from None


def get_key(name: str) -> str | None:
    """The saved key (or the one kept for this session), or None when there is none."""
    if name in _session_keys:
        return _session_keys[name]
    try:
        return keyring.get_password(SERVICE, _user(name))
    except keyring.errors.KeyringError:
        return None
