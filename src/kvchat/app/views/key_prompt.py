"""Asking for a connection's API key when its server refuses the one kvchat has (none: a key kept
for one session only is gone after a restart, or the server's key changed)."""
from PySide6.QtWidgets import QInputDialog, QLineEdit


def ask_key(parent, name: str) -> str | None:
    """The key typed (hidden as it is typed), or None where the user cancelled."""
    key, ok = QInputDialog.getText(parent, "API key", f"The server of the connection “{name}” refused its API "
                                   "key, or has none from kvchat. Its key:", QLineEdit.Password)
    return key.strip() if ok and key.strip() else None
