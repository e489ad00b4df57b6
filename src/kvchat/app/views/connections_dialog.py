"""Saved connections to OpenAI-compatible servers: add, edit, remove, and pick the one to run on.
The API key goes only to the OS keyring (core/connections.py); the model is one the server lists
on /v1/models, asked off the GUI thread."""
import threading

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import (QComboBox, QDialogButtonBox, QFormLayout, QHBoxLayout, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QPushButton, QVBoxLayout)

from kvchat.core.connections import (SESSION_NOTE, Connection, Connections, KeyringUnavailable, connection_problem,
                                     get_key, keep_for_session)
from kvchat.remote.client import list_models
from kvchat.app.views.sheet import Sheet, confirm, mark

FIRST_MODEL = "(the server's first model)"


class ModelLister(QObject):
    """/v1/models on a thread; the answer comes back as a queued signal."""
    listed = Signal(list)
    failed = Signal(str)

    def ask(self, url: str, api_key: str | None) -> None:
        def run():
            try:
                self.listed.emit(list_models(url, api_key))
            except Exception as e:  # EngineError says why in one line; anything else is still one line
                self.failed.emit(str(e).splitlines()[0] if str(e) else type(e).__name__)

        threading.Thread(target=run, name="kvchat-list-models", daemon=True).start()


def check(name: str, url: str, taken: set[str]) -> str | None:
    """Why these values cannot be saved, or None: the engine's rules, and a name not taken."""
    if name and name in taken:
        return f"a connection named {name!r} already exists"
    return connection_problem(name, url)


class ConnectionEditor(Sheet):
    """One connection's name, base URL, API key and model. Saves on OK; stays open with the reason
    when it cannot (a name taken, no keyring for the key)."""
    saved = Signal(str)  # the connection's name

    def __init__(self, parent, connections: Connections, connection: Connection | None = None):
        super().__init__(parent, "Edit connection" if connection else "Add connection",
                         "A server that speaks the OpenAI API, at its base URL; the key stays in the OS keyring.")
        self.connections, self.original = connections, connection
        self.has_key = bool(connection and get_key(connection.name))
        self.name = QLineEdit(connection.name if connection else "", objectName="connectionName")
        self.url = QLineEdit(connection.base_url if connection else "", objectName="connectionUrl",
                             placeholderText="http://gpu-box:8000")
        self.key = QLineEdit(objectName="connectionKey", echoMode=QLineEdit.Password,
                             placeholderText="saved in the keyring: empty keeps it" if self.has_key else
                             "none (kept in the OS keyring when given)")
        self.model = QComboBox(objectName="connectionModel")
        self.model.addItem(FIRST_MODEL, None)
        if connection and connection.model:
            self.model.addItem(connection.model, connection.model)
            self.model.setCurrentIndex(1)
        self.fetch = QPushButton("Ask the server", objectName="fetchModels",
                                 toolTip="List the models the server offers (its /v1/models)")
        self.status = QLabel(objectName="connectionStatus", wordWrap=True)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model, 1)
        model_row.addWidget(self.fetch)
        form = self.card(QFormLayout)
        form.addRow("Name", self.name)
        form.addRow("Base URL", self.url)
        form.addRow("API key", self.key)
        form.addRow("Model", model_row)
        form.addRow("", self.status)
        self.buttons.accepted.disconnect(self.accept)  # Save checks first, and stays open with the reason
        self.buttons.accepted.connect(self.save)
        self.buttons.setStandardButtons(QDialogButtonBox.Save | QDialogButtonBox.Cancel)
        mark(self.buttons.button(QDialogButtonBox.Save), "accent")
        mark(self.buttons.button(QDialogButtonBox.Cancel), "plain")
        self.setMinimumWidth(480)
        self.lister = ModelLister()
        self.lister.listed.connect(self.on_models)
        self.lister.failed.connect(lambda why: self.say(why, error=True))
        self.fetch.clicked.connect(self.ask_models)

    def api_key(self) -> str | None:
        typed = self.key.text().strip()
        if typed:
            return typed
        return get_key(self.original.name) if self.has_key else None

    def ask_models(self) -> None:
        if not self.url.text().strip():
            self.say("type the server's base URL first", error=True)
            return
        self.fetch.setEnabled(False)
        self.say("asking the server for its models…")
        self.lister.ask(self.url.text().strip(), self.api_key())

    def on_models(self, models: list) -> None:
        self.fetch.setEnabled(True)
        chosen = self.model.currentData()
        self.model.clear()
        self.model.addItem(FIRST_MODEL, None)
        for m in models:
            self.model.addItem(m, m)
        self.model.setCurrentIndex(max(0, self.model.findData(chosen)))
        self.say(f"the server offers {len(models)} model{'s' if len(models) != 1 else ''}")

    def say(self, text: str, error: bool = False) -> None:
        self.fetch.setEnabled(True)
        self.status.setText(text)
        self.status.setStyleSheet("color: #c2410c;" if error else "")
        self.adjustSize()  # a longer message gets its lines: a wrapped label is not resized by its text

    def save(self) -> None:
        name, url = self.name.text().strip(), self.url.text().strip()
        taken = {c.name for c in self.connections.all()} - {self.original.name if self.original else None}
        why = check(name, url, taken)
        if why:
            self.say(why, error=True)
            return
        key = self.api_key()
        try:
            self.connections.save(Connection(name, url, self.model.currentData()), api_key=key)
        except KeyringUnavailable:
            # usable now all the same: the connection saved, its key in this process only, and said so
            self.connections.save(Connection(name, url, self.model.currentData()))
            keep_for_session(name, key)
            self.finish_renaming(name)
            self.saved.emit(name)
            self.say(SESSION_NOTE)
            self.buttons.button(QDialogButtonBox.Save).hide()
            self.buttons.button(QDialogButtonBox.Cancel).setText("Close")
            return
        self.finish_renaming(name)
        self.saved.emit(name)
        self.accept()

    def finish_renaming(self, name: str) -> None:
        if self.original and self.original.name != name:  # renamed: the old entry and its key go
            self.connections.remove(self.original.name)


class ConnectionsDialog(Sheet):
    """The list of saved connections. ``chosen`` names the one to run on; None is this computer."""
    chosen = Signal(object)

    def __init__(self, parent, connections: Connections | None = None, current: str | None = None):
        super().__init__(parent, "Connections", "Servers that speak the OpenAI API: vLLM, SGLang, llama.cpp's "
                         "llama-server, Ollama, another kvchat. API keys are kept in the OS keyring.")
        self.resize(560, 380)
        self.connections = connections or Connections()
        self.current = current
        self.editor: ConnectionEditor | None = None
        self.list = QListWidget(objectName="connections")
        self.add_button = QPushButton("Add…", objectName="addConnection")
        self.edit_button = QPushButton("Edit…", objectName="editConnection")
        self.remove_button = QPushButton("Remove", objectName="removeConnection")
        self.use_button = QPushButton("Use", objectName="useConnection", default=True)
        self.local_button = QPushButton("Use this computer", objectName="useLocal")
        buttons = QVBoxLayout()
        for b in (self.add_button, self.edit_button, self.remove_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(self.use_button)
        buttons.addWidget(self.local_button)
        row = self.card(QHBoxLayout)
        row.addWidget(self.list, 1)
        row.addLayout(buttons)
        self.button("Close", QDialogButtonBox.RejectRole, "plain")
        self.add_button.clicked.connect(lambda: self.open_editor(None))
        self.edit_button.clicked.connect(lambda: self.open_editor(self.selected()))
        self.remove_button.clicked.connect(self.remove)
        self.use_button.clicked.connect(self.use)
        self.local_button.clicked.connect(lambda: self.choose(None))
        self.list.itemDoubleClicked.connect(lambda _item: self.use())
        self.list.currentItemChanged.connect(lambda *_: self.update_buttons())
        self.fill()

    def fill(self, select: str | None = None) -> None:
        self.list.clear()
        for c in self.connections.all():
            in_use = " (in use)" if c.name == self.current else ""
            item = QListWidgetItem(f"{c.name}{in_use}\n    {c.base_url} · {c.model or FIRST_MODEL}")
            item.setData(Qt.UserRole, c.name)
            self.list.addItem(item)
            if c.name == (select or self.current):
                self.list.setCurrentItem(item)
        if self.list.currentItem() is None and self.list.count():
            self.list.setCurrentRow(0)
        self.update_buttons()

    def selected(self) -> Connection | None:
        item = self.list.currentItem()
        return self.connections.get(item.data(Qt.UserRole)) if item is not None else None

    def update_buttons(self) -> None:
        has = self.list.currentItem() is not None
        for b in (self.edit_button, self.remove_button, self.use_button):
            b.setEnabled(has)
        self.local_button.setEnabled(self.current is not None)

    def open_editor(self, connection: Connection | None) -> None:
        """Not modal to the event loop (open, not exec): the window keeps streaming meanwhile."""
        self.editor = ConnectionEditor(self, self.connections, connection)
        self.editor.saved.connect(lambda name: self.fill(select=name))
        self.editor.open()

    def remove(self) -> None:
        connection = self.selected()
        if connection is None:
            return
        if not confirm(self, "Remove connection", f"Remove the connection “{connection.name}” and its saved key?",
                       "Remove"):
            return
        self.connections.remove(connection.name)
        if connection.name == self.current:  # removed while in use: the app goes back to this computer
            self.choose(None)
            return
        self.fill()

    def use(self) -> None:
        connection = self.selected()
        if connection is not None:
            self.choose(connection.name)

    def choose(self, name: str | None) -> None:
        self.chosen.emit(name)
        self.accept()
