"""Asking for a connection's API key when its server refuses the one kvchat has (none: a key kept
for one session only is gone after a restart, or the server's key changed)."""
from kvchat.app.views.sheet import ask_text


def ask_key(parent, name: str) -> str | None:
    """The key typed (hidden as it is typed), or None where the user cancelled."""
    return ask_text(parent, "API key", f"The server of the connection “{name}” refused its API key, or has none "
                    "from kvchat. Type its key: it is kept in the OS keyring.", secret=True, action="Connect")
