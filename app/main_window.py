"""The main window: conversations, the chat, personas, the memory gauge. Everything the user does
is saved at once; the engine is only reached through the bridge's queued signals."""
import time
from pathlib import Path

from PySide6.QtCore import QEvent, Qt, QTimer
from PySide6.QtGui import QDesktopServices, QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QFileDialog, QFormLayout, QHBoxLayout,
                               QInputDialog, QLabel, QLineEdit, QListWidget, QListWidgetItem, QMainWindow,
                               QMessageBox, QPlainTextEdit, QProgressBar, QPushButton, QSplitter, QTextBrowser,
                               QVBoxLayout, QWidget)

from kvchat.engine.config import SamplingParams
from kvchat.engine.memory import GiB

from .gauge import MemoryGauge, legend
from .render import Turn, conversation_html
from .settings_dialog import SettingsDialog
from .store import Store

SAVE_EVERY_S = 0.5  # a streaming reply is saved this often, marked interrupted until it ends
NOTICES_KEPT = 20  # the notice line's tooltip lists this many of the latest


class MainWindow(QMainWindow):
    def __init__(self, store: Store, bridge, sampling: SamplingParams | None = None):
        super().__init__()
        self.store, self.bridge = store, bridge
        self.sampling = sampling or SamplingParams(**(store.setting("sampling") or {}))
        self.conversation_id: int | None = None
        self.reply_id: int | None = None
        self.reply_conversation: int | None = None  # the chat a reply streams into; the view may show another
        self.reply_persona: int | None = None  # the persona that reply was asked with
        self.reply_text, self.reply_ids, self.last_save = "", [], 0.0
        self.warm_personas: set[int] = set()
        self.notices: list[str] = []
        self.editing: int | None = None  # the position of the user message being edited in the box
        self.previous_engine_settings: dict | None = None  # what to go back to if a new model fails
        self.pending_engine_settings: dict | None = None  # saved once they load: a failed model is never saved
        self.setWindowTitle("kvchat")
        self.resize(1100, 720)
        self._build()
        self._connect()
        self.set_loading(self.bridge.loading)
        self.bridge.start()  # after _connect: then ready or load_failed reaches us, however fast
        self.refresh_conversations()

    # -- layout --

    def _build(self) -> None:
        self.search = QLineEdit(placeholderText="Search chats")
        self.conversation_list = QListWidget()
        self.new_button, self.rename_button, self.delete_button = (QPushButton(t) for t in ("New", "Rename", "Delete"))
        side = QVBoxLayout()
        side.addWidget(self.search)
        side.addWidget(self.conversation_list)
        buttons = QHBoxLayout()
        for b in (self.new_button, self.rename_button, self.delete_button):
            buttons.addWidget(b)
        side.addLayout(buttons)
        self.persona_box = QComboBox()
        self.persona_badge = QLabel()
        self.persona_edit_button, self.persona_new_button, self.export_button = (
            QPushButton(t) for t in ("Edit persona", "New persona", "Export"))
        self.chat_view = QTextBrowser(openLinks=False)
        self.code_blocks: list[str] = []
        self.input = QPlainTextEdit(placeholderText="Message (Enter sends, Shift+Enter for a new line)")
        self.input.setMaximumHeight(110)
        self.input.installEventFilter(self)
        self.send_button, self.stop_button, self.regen_button, self.settings_button = (
            QPushButton(t) for t in ("Send", "Stop", "Regenerate", "Settings"))
        self.stop_button.setEnabled(False)
        self.gauge = MemoryGauge()
        self.precision_label, self.notice_label = QLabel("loading model..."), QLabel()
        self.load_bar = QProgressBar(minimumWidth=240, maximumWidth=320, textVisible=True, format="loading model")
        self.load_bar.setRange(0, 0)  # busy until a download reports its size
        self.cancel_load_button = QPushButton("Cancel loading")
        top = QHBoxLayout()
        top.addWidget(QLabel("Persona:"))
        top.addWidget(self.persona_box, 1)
        top.addWidget(self.persona_badge)
        for b in (self.persona_edit_button, self.persona_new_button, self.export_button):
            top.addWidget(b)
        actions = QHBoxLayout()
        for b in (self.send_button, self.stop_button, self.regen_button, self.settings_button):
            actions.addWidget(b)
        gauge_row = QHBoxLayout()
        gauge_row.addWidget(self.gauge, 1)
        gauge_row.addWidget(self.precision_label)
        gauge_row.addWidget(self.load_bar)
        gauge_row.addWidget(self.cancel_load_button)
        main = QVBoxLayout()
        main.addLayout(top)
        main.addWidget(self.chat_view, 1)
        main.addWidget(self.input)
        main.addLayout(actions)
        main.addLayout(gauge_row)
        main.addWidget(legend())
        main.addWidget(self.notice_label)
        left, right = QWidget(), QWidget()
        left.setLayout(side)
        right.setLayout(main)
        splitter = QSplitter()
        splitter.addWidget(left)
        splitter.addWidget(right)
        splitter.setSizes([260, 840])
        self.setCentralWidget(splitter)
        self.render_timer = QTimer(self, singleShot=True, interval=50)
        self.render_timer.timeout.connect(self.render_chat)
        self.reload_personas()

    def _connect(self) -> None:
        b = self.bridge
        b.ready.connect(self.on_ready)
        b.load_failed.connect(self.on_load_failed)
        b.load_progress.connect(self.on_load_progress)
        self.cancel_load_button.clicked.connect(self.bridge.cancel_load)
        b.token.connect(self.on_token)
        b.finished.connect(self.on_finished)
        b.failed.connect(self.on_failed)
        b.notice.connect(lambda kind, m: self.notify(f"{kind}: {m}"))
        b.snapshot.connect(self.on_snapshot)
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(self.bridge.stop)
        self.regen_button.clicked.connect(self.regenerate)
        self.new_button.clicked.connect(self.new_conversation)
        self.rename_button.clicked.connect(self.rename_conversation)
        self.delete_button.clicked.connect(self.delete_conversation)
        self.search.textChanged.connect(self.refresh_conversations)
        self.conversation_list.currentItemChanged.connect(self.on_select)
        self.persona_box.currentIndexChanged.connect(self.on_persona)
        self.settings_button.clicked.connect(self.open_settings)
        self.persona_edit_button.clicked.connect(lambda: self.edit_persona(new=False))
        self.persona_new_button.clicked.connect(lambda: self.edit_persona(new=True))
        self.export_button.clicked.connect(self.export_dialog)
        self.chat_view.anchorClicked.connect(self.on_link)
        QShortcut(QKeySequence.New, self, self.new_conversation)
        QShortcut(QKeySequence("Ctrl+,"), self, self.open_settings)
        QShortcut(QKeySequence("Escape"), self, self.escape)

    def escape(self) -> None:
        """Stops a reply; otherwise leaves an edit, putting the box back as it was."""
        if self.bridge.busy:
            self.bridge.stop()
        elif self.editing is not None:
            self.stop_editing()
            self.input.clear()
            self.notify("edit cancelled")

    def eventFilter(self, obj, event) -> bool:
        if obj is self.input and event.type() == QEvent.KeyPress and event.key() in (Qt.Key_Return, Qt.Key_Enter):
            if not event.modifiers() & Qt.ShiftModifier:
                self.send()
                return True
        return super().eventFilter(obj, event)

    # -- conversations --

    def refresh_conversations(self) -> None:
        self.conversation_list.blockSignals(True)
        self.conversation_list.clear()
        for conv in self.store.conversations(self.search.text()):
            item = QListWidgetItem(conv["title"])
            item.setData(Qt.UserRole, conv["id"])
            self.conversation_list.addItem(item)
            if conv["id"] == self.conversation_id:
                self.conversation_list.setCurrentItem(item)
        self.conversation_list.blockSignals(False)

    def new_conversation(self) -> int:
        self.stop_editing()
        self.conversation_id = self.store.create_conversation("New chat", self.persona_box.currentData())
        self.refresh_conversations()
        self.render_chat()
        return self.conversation_id

    def open_conversation(self, conversation_id: int) -> None:
        self.stop_editing()
        self.conversation_id = conversation_id
        persona = self.store.conversation(conversation_id)["persona_id"]
        index = self.persona_box.findData(persona)
        self.persona_box.blockSignals(True)
        self.persona_box.setCurrentIndex(max(0, index))
        self.persona_box.blockSignals(False)
        self.update_badge()
        self.render_chat()

    def on_select(self, item, _previous) -> None:
        # the view follows the highlight even while a reply streams (into its own chat), so the list and
        # the view never name different chats
        if item is not None:
            self.open_conversation(item.data(Qt.UserRole))

    def rename_conversation(self) -> None:
        if self.conversation_id is None:
            return
        title, ok = QInputDialog.getText(self, "Rename chat", "Title:",
                                         text=self.store.conversation(self.conversation_id)["title"])
        if ok:
            self.store.rename_conversation(self.conversation_id, title)
            self.refresh_conversations()

    def delete_conversation(self) -> None:
        """Deletes the open chat, the one in view, after a confirmation that names it. No parameter:
        the button's clicked(bool) must have nothing to fill."""
        doomed = self.conversation_id
        if doomed is None:
            return
        if doomed == self.reply_conversation:
            self.notify("a reply is streaming into this chat: stop it (Escape) before deleting the chat")
            return
        title = self.store.conversation(doomed)["title"]
        if QMessageBox.question(self, "Delete chat", f"Delete “{title}” for good?",
                                QMessageBox.Yes | QMessageBox.Cancel, QMessageBox.Cancel) != QMessageBox.Yes:
            return
        self.store.delete_conversation(doomed)
        self.conversation_id = None
        self.refresh_conversations()
        self.render_chat()

    def on_persona(self, _index) -> None:
        if self.conversation_id is not None:
            self.store.set_persona(self.conversation_id, self.persona_box.currentData())
        self.update_badge()

    def reload_personas(self, select: int | None = None) -> None:
        current = select if select is not None else self.persona_box.currentData()
        self.persona_box.blockSignals(True)
        self.persona_box.clear()
        for persona in self.store.personas():
            self.persona_box.addItem(persona["name"], persona["id"])
        self.persona_box.setCurrentIndex(max(0, self.persona_box.findData(current)))
        self.persona_box.blockSignals(False)

    def edit_persona(self, new: bool) -> None:
        persona = None if new else next((p for p in self.store.personas()
                                         if p["id"] == self.persona_box.currentData()), None)
        dialog = PersonaDialog(self, persona)
        if dialog.exec():
            self.save_persona(persona["id"] if persona else None, *dialog.values())

    def save_persona(self, persona_id: int | None, name: str, prompt: str) -> None:
        """A changed prompt is a new prefix: the old one's cache simply goes cold."""
        try:
            if persona_id is None:
                persona_id = self.store.add_persona(name, prompt)
            else:
                self.store.update_persona(persona_id, name, prompt)
                self.warm_personas.discard(persona_id)
        except ValueError as e:
            self.show_error(f"Could not save the persona: {e}")
            return
        self.reload_personas(select=persona_id)
        self.on_persona(None)

    def export_dialog(self) -> None:
        if self.conversation_id is None:
            return
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", "chat.md", "Markdown (*.md);;JSON (*.json)")
        if path:
            self.export_to(Path(path))

    def export_to(self, path: Path) -> None:
        text = (self.store.export_json if path.suffix == ".json" else self.store.export_markdown)(self.conversation_id)
        path.write_text(text, encoding="utf-8")
        self.notify(f"exported to {path}")

    def update_badge(self) -> None:
        warm = self.persona_box.currentData() in self.warm_personas
        self.persona_badge.setText("warm (cached)" if warm else "cold")

    # -- the chat --

    def engine_messages(self) -> list[dict]:
        persona = next((p for p in self.store.personas() if p["id"] == self.persona_box.currentData()), None)
        head = [{"role": "system", "content": persona["system_prompt"]}] if persona else []
        return head + [m.for_engine() for m in self.store.messages(self.conversation_id)]

    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self.bridge.busy:
            return
        if self.bridge.switching:
            self.notify("a model is loading: your message stays in the box until it is ready")
            return
        if self.editing is not None:
            position = self.editing
            self.stop_editing()
            self.input.clear()
            self.edit_and_resend(position, text)
            return
        if self.conversation_id is None:
            self.new_conversation()
        if not self.store.messages(self.conversation_id):
            self.store.rename_conversation(self.conversation_id, text[:40])
            self.refresh_conversations()
        self.input.clear()
        self.store.add_message(self.conversation_id, "user", text)
        self.start_reply()

    def regenerate(self) -> None:
        if self.conversation_id is None or self.bridge.busy or self.bridge.switching:
            return
        messages = self.store.messages(self.conversation_id)
        if messages and messages[-1].role == "assistant":
            self.store.truncate(self.conversation_id, messages[-1].position)
        if self.store.messages(self.conversation_id):
            self.start_reply()

    def begin_edit(self, position: int) -> None:
        """Put a user message back in the input box; Send then replaces it and what followed."""
        message = next((m for m in self.store.messages(self.conversation_id) if m.position == position), None)
        if message is None or message.role != "user" or self.bridge.busy:
            return
        self.editing = position
        self.input.setPlainText(message.content)
        self.input.setFocus()
        self.send_button.setText("Resend")
        self.notify("editing: Resend replaces the message and the replies after it; Escape cancels")

    def stop_editing(self) -> None:
        if self.editing is not None:
            self.editing = None
            self.send_button.setText("Send")

    def edit_and_resend(self, position: int, text: str) -> None:
        """Replace the user message at ``position`` and everything after it."""
        if self.bridge.busy or self.bridge.switching or not text.strip():
            return
        self.store.truncate(self.conversation_id, position)
        self.store.add_message(self.conversation_id, "user", text.strip())
        self.start_reply()

    def start_reply(self) -> None:
        messages = self.engine_messages()
        self.reply_text, self.reply_ids, self.last_save = "", [], time.monotonic()
        self.reply_id = self.store.add_message(self.conversation_id, "assistant", "", interrupted=True)
        self.reply_conversation, self.reply_persona = self.conversation_id, self.persona_box.currentData()
        self.send_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self.bridge.send(messages, self.sampling)
        self.render_chat()

    def on_token(self, text: str, token_id: int) -> None:
        self.reply_text += text
        if token_id >= 0:
            self.reply_ids.append(token_id)
        if time.monotonic() - self.last_save > SAVE_EVERY_S:
            self.store.update_message(self.reply_id, self.reply_text, self.reply_ids, interrupted=True)
            self.last_save = time.monotonic()
        if self.conversation_id == self.reply_conversation and not self.render_timer.isActive():
            self.render_timer.start()  # only while its chat is in view: another one is not redrawn under the reader

    def on_finished(self, done: dict) -> None:
        cancelled = done["finish_reason"] == "cancelled"
        text = self.reply_text if cancelled else done["text"]
        self.store.update_message(self.reply_id, text, done["token_ids"] or self.reply_ids, done["stats"],
                                  interrupted=cancelled)
        if self.reply_persona is not None:  # not the persona box's: the view may show another chat by now
            self.warm_personas.add(self.reply_persona)
        self.precision_label.setText(f"KV {done['stats']['kv_precision']}")
        self.end_reply()

    def on_failed(self, message: str) -> None:
        if self.reply_id is not None:
            self.store.update_message(self.reply_id, self.reply_text or f"*Error: {message}*", self.reply_ids,
                                      interrupted=True)
        self.end_reply()
        self.notify(f"error: {message}")

    def end_reply(self) -> None:
        self.reply_id = self.reply_conversation = None
        self.send_button.setEnabled(True)
        self.stop_button.setEnabled(False)
        self.update_badge()
        self.render_chat()

    def on_snapshot(self, snapshot: dict) -> None:
        self.gauge.update_snapshot(snapshot)
        where = " · on the CPU" if snapshot["on_cpu"] else ""
        self.precision_label.setText(f"KV {snapshot['precision']}{where}")

    def render_chat(self) -> None:
        if self.conversation_id is None:
            self.chat_view.setMarkdown("*Start a new chat: type below and press Enter.*")
            return
        turns = []
        for m in self.store.messages(self.conversation_id):
            live = m.id == self.reply_id
            turns.append(Turn(m.role, self.reply_text if live else m.content, m.position,
                              m.interrupted and not live, None if live else m.stats))
        page, self.code_blocks = conversation_html(turns)
        self.chat_view.setHtml(page)
        self.chat_view.verticalScrollBar().setValue(self.chat_view.verticalScrollBar().maximum())

    def settings_dialog(self) -> SettingsDialog:
        engine = self.bridge.engine
        snap = self.gauge.snapshot
        config = engine.loaded.model.config if engine.ready.is_set() and engine.loaded else None
        memory = snap["total"] - snap["other_processes"] if snap else None
        current = {**(self.store.setting("engine") or {}), "max_context": engine.config.max_context,
                   "kv_precision": engine.config.kv_precision.value}
        return SettingsDialog(self, current, vars(self.sampling), config, memory,
                              on_cuda=bool(snap and not snap["on_cpu"]))

    def open_settings(self) -> None:
        dialog = self.settings_dialog()
        if dialog.exec():
            self.apply_settings(dialog)

    def apply_settings(self, dialog: SettingsDialog) -> None:
        """Sampling applies to the next reply; context, precision and headroom without reloading the
        model; a different model or weight format loads at once."""
        try:
            self.sampling = SamplingParams(**dialog.sampling())
        except ValueError as e:
            self.show_error(str(e))
            return
        self.store.set_setting("sampling", dialog.sampling())
        wanted = dialog.engine_settings()
        before = self.store.setting("engine") or {}
        engine = self.bridge.engine
        now = {"model": "starter", "weights": "auto", **before, "max_context": engine.config.max_context,
               "kv_precision": engine.config.kv_precision.value,
               "headroom_gib": engine.config.headroom_bytes / GiB}
        live = ("max_context", "kv_precision", "headroom_gib")
        if (wanted["model"], wanted["weights"]) != (now["model"], now["weights"]) or engine.load_error:
            # saved by on_ready; after a failed start there is no working model to go back to
            self.load_model(wanted, previous=None if engine.load_error else now)
            return
        self.store.set_setting("engine", wanted)
        if any(wanted[k] != now[k] for k in live):
            self.bridge.reconfigure(*(wanted[k] for k in live))

    # -- loading a model --

    def load_model(self, settings: dict, previous: dict | None) -> None:
        """Close the engine and load ``settings`` in a new one; the chat waits, the window does not."""
        if self.bridge.busy:
            self.bridge.stop()
        self.previous_engine_settings, self.pending_engine_settings = previous, settings
        self.set_loading(True)
        self.notify(f"loading {settings.get('model', 'starter')}...")
        self.bridge.switch_model(settings)

    def set_loading(self, loading: bool) -> None:
        self.load_bar.setVisible(loading)
        self.cancel_load_button.setVisible(loading)
        if loading:
            self.load_bar.setRange(0, 0)
            self.load_bar.setFormat("loading model")
            self.precision_label.setText("loading model...")

    def on_load_progress(self, done: int, total: int) -> None:
        if total <= 0:
            return
        self.load_bar.setRange(0, 1000)
        self.load_bar.setValue(int(1000 * done / total))
        self.load_bar.setFormat(f"{done / 1e9:.2f} / {total / 1e9:.2f} GB")

    def on_ready(self) -> None:
        self.set_loading(False)
        if self.pending_engine_settings is not None:  # it loaded: now it is the setting
            self.store.set_setting("engine", self.pending_engine_settings)
        self.previous_engine_settings = self.pending_engine_settings = None
        self.precision_label.setText(f"KV {self.bridge.engine.precision.value}")
        self.notify(f"model ready: {(self.store.setting('engine') or {}).get('model', 'starter')}")

    def on_load_failed(self, message: str) -> None:
        """Say why; after a failed switch, load the model that worked again (its setting was never
        replaced). With none to go back to (the saved model fails at launch), say so and stay there."""
        self.set_loading(False)
        previous = self.previous_engine_settings
        self.previous_engine_settings = self.pending_engine_settings = None
        if previous is not None:
            self.show_error(f"The model could not be loaded: {message}")
            self.load_model(previous, previous=None)
        else:
            self.precision_label.setText("no model loaded")
            self.show_error(f"The model could not be loaded: {message}. Choose another one in Settings.")

    def on_link(self, url) -> None:
        if url.scheme() == "copy":
            QGuiApplication.clipboard().setText(self.code_blocks[int(url.path())])
            self.notify("code copied")
        elif url.scheme() == "edit":
            self.begin_edit(int(url.path()))
        else:
            QDesktopServices.openUrl(url)

    def notify(self, message: str) -> None:
        """The notice line shows the latest; its tooltip the ones before."""
        self.notices = (self.notices + [f"{time.strftime('%H:%M:%S')}  {message}"])[-NOTICES_KEPT:]
        self.notice_label.setText(message)
        self.notice_label.setToolTip("\n".join(self.notices))

    def show_error(self, message: str) -> None:
        """In the notice line, and in a dialog that does not block the event loop."""
        self.notify(message)
        box = QMessageBox(QMessageBox.Warning, "kvchat", message, QMessageBox.Ok, self)
        box.setAttribute(Qt.WA_DeleteOnClose)
        box.open()


class PersonaDialog(QDialog):
    def __init__(self, parent, persona: dict | None):
        super().__init__(parent)
        self.setWindowTitle("Persona")
        form = QFormLayout(self)
        self.name = QLineEdit(persona["name"] if persona else "")
        self.prompt = QPlainTextEdit(persona["system_prompt"] if persona else "")
        form.addRow("Name", self.name)
        form.addRow("System prompt", self.prompt)
        buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)

    def values(self) -> tuple[str, str]:
        return self.name.text(), self.prompt.toPlainText()
