"""The main window: conversations, the chat, personas, the memory panel. Everything the user does
is saved at once; the engine is only reached through the bridge's queued signals."""
import time
from pathlib import Path

from PySide6.QtCore import QEvent, Qt, QTimer
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QFileDialog, QFormLayout,
                               QFrame, QHBoxLayout, QInputDialog, QLabel, QLineEdit, QMainWindow, QMessageBox,
                               QPlainTextEdit, QProgressBar, QPushButton, QSizePolicy, QSplitter, QToolButton,
                               QVBoxLayout, QWidget)

from kvchat.core.config import SamplingParams
from kvchat.core.memory import GiB, plan

from kvchat.app.views.chat_view import ChatView
from kvchat.app.views.connection_box import ConnectionBox
from kvchat.app.views.conversation_list import ConversationList
from kvchat.app.views.icons import icon
from kvchat.app.controllers.loop_guard import LoopGuard
from kvchat.app.views.memory_panel import MemoryPanel
from kvchat.app.views.model_library import ModelLibrary
from kvchat.app.views.persona_badge import LABELS, BadgeAsker
from kvchat.app.models.sampling_defaults import model_defaults
from kvchat.app.views.settings_dialog import SettingsDialog, trained_context
from kvchat.app.store import Store
from kvchat.app.views.theme import COLOURS, Theme
from kvchat.app.views.top_bar import Chip, TopBar, model_name, size_label

SAVE_EVERY_S = 0.5  # a streaming reply is saved this often, marked interrupted until it ends
RENDER_EVERY_MS = 66  # tokens arriving faster than this are shown together (15 frames a second)
NOTICES_KEPT = 20  # the notice line's tooltip lists this many of the latest
# the model chip elides its name: the context and KV chips give way before it is narrower than this
MODEL_CHIP_ROOM = 160
WAITING_NOTE = "The model is loading: this message will be answered when it is ready."
EDITING_NOTICE = "editing: Resend replaces the message and the replies after it; Escape cancels"
STREAMING_NOTICE = "a reply is streaming into this chat: stop it (Escape) before deleting the chat"
WARMING_NOTE = "Preparing fast decoding for this model (a minute or two the first time): the reply starts after it."
# a GGUF's first conversion before its tensors count (the starter: ~2.5 s, ~1.3 s, ~1.9 s)
BUSY_STAGES = {"read": "reading GGUF file…", "tokenizer": "converting GGUF: the tokenizer…",
               "model": "converting GGUF: building the model…"}
COUNTED_STAGES = {"convert": "converting GGUF", "weights": "loading weights"}


class MainWindow(QMainWindow):
    def __init__(self, store: Store, bridge, sampling: SamplingParams | None = None, theme: Theme | None = None):
        super().__init__()
        self.store, self.bridge = store, bridge
        saved = store.setting("sampling")
        # until the model says otherwise (on_ready), the fallback defaults
        self.sampling = sampling or SamplingParams(**(saved or model_defaults(None)))
        self.sampling_from_model = sampling is None and saved is None
        self.theme = theme or Theme(store.setting("theme") or "system")
        self.theme.apply()
        self.conversation_id: int | None = None
        self.reply_id: int | None = None
        self.reply_conversation: int | None = None  # the chat a reply streams into; the view may show another
        self.reply_text, self.reply_ids, self.last_save = "", [], 0.0
        self.loop_guard, self.loop_stopped = LoopGuard(), False
        self.waiting: int | None = None  # a chat whose last message waits for the model to load
        self.warming = False  # the engine compiles its decode step (warm-up notices): a reply waits for it
        self.notices: list[str] = []
        self.editing: int | None = None  # the position of the user message being edited in the box
        self.previous_engine_settings: dict | None = None  # what to go back to if a new model fails
        self.pending_engine_settings: dict | None = None  # saved once they load: a failed model is never saved
        self.model_config = None  # the loaded model's config and name, read once when it is ready
        self.model_label = ""
        self.setWindowTitle("kvchat")
        self.resize(1200, 720)  # room for every chip of the top bar beside the sidebar
        self._build()
        self._connect()
        self.memory_button.setChecked(bool(store.setting("memory_panel")))
        self.set_loading(self.bridge.loading)
        self.bridge.start()  # after _connect: then ready or load_failed reaches us, however fast
        if store.setting("connection") and self.connection_box.findData(store.setting("connection")) > 0:
            self.use_connection(store.setting("connection"))  # the local engine started behind it is closed
        self.refresh_conversations()
        self.render_chat()
        self.input.setFocus()

    # -- layout --

    def _build(self) -> None:
        self.new_button = QPushButton("New chat", objectName="newChat")
        self.search = QLineEdit(placeholderText="Search chats", objectName="search")
        self.search.setClearButtonEnabled(True)
        self.conversation_list = ConversationList()
        self.rename_button, self.delete_button, self.theme_button = (
            QToolButton(autoRaise=True, toolTip=t) for t in ("Rename chat", "Delete chat", "Theme"))
        self.theme_button.setToolButtonStyle(Qt.ToolButtonTextBesideIcon)
        side = QVBoxLayout()
        side.setContentsMargins(10, 12, 10, 10)
        side.addWidget(self.new_button)
        side.addWidget(self.search)
        side.addWidget(self.conversation_list, 1)
        row = QHBoxLayout()
        for b in (self.rename_button, self.delete_button):
            row.addWidget(b)
        row.addStretch(1)
        row.addWidget(self.theme_button)
        side.addLayout(row)
        sidebar = QFrame(objectName="sidebar")
        sidebar.setLayout(side)
        sidebar.setMinimumWidth(220)

        self.persona_box = QComboBox()
        self.persona_box.setMinimumContentsLength(10)  # its size hint, so a narrow window squeezes the chips first
        self.persona_badge = QLabel()
        self.persona_edit_button, self.persona_new_button, self.export_button = (
            QToolButton(autoRaise=True, toolTip=t) for t in ("Edit persona", "New persona", "Export chat"))
        self.connection_box = ConnectionBox()
        self.model_chip = Chip("model", "The model: click to change it")
        self.model_chip.setMinimumWidth(90)  # a narrow window elides the chip instead of overlapping the persona
        self.context_chip = Chip("context", "Context length: click to change it")
        self.kv_chip = Chip("precision", "KV cache precision: click to change it")
        self.memory_button = QToolButton(autoRaise=True, toolTip="Memory (Ctrl+M)", checkable=True)
        self.library_button = QToolButton(autoRaise=True, toolTip="Models on this computer")
        self.settings_button = QToolButton(autoRaise=True, toolTip="Settings (Ctrl+,)")
        top = QHBoxLayout()
        top.setContentsMargins(14, 8, 10, 8)
        top.addWidget(self.persona_box)
        top.addWidget(self.persona_badge)
        for b in (self.persona_edit_button, self.persona_new_button):
            top.addWidget(b)
        top.addStretch(1)
        for w in (self.connection_box, self.model_chip, self.context_chip, self.kv_chip, self.library_button, self.export_button,
                  self.memory_button,
                  self.settings_button):
            top.addWidget(w)
        # narrow, the KV chip goes first (the status bar names the precision too), then the context's
        self.top_bar = topbar = TopBar(top, [self.context_chip, self.kv_chip], {self.model_chip: MODEL_CHIP_ROOM},
                                       objectName="topbar")

        self.chat_view = ChatView(self.theme)
        self.input = QPlainTextEdit(placeholderText="Message kvchat (Enter sends, Shift+Enter for a new line)")
        self.input.setFixedHeight(64)
        self.input.installEventFilter(self)
        self.send_button = QPushButton("Send", objectName="send")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.stop_button.hide()
        composer_row = QHBoxLayout()
        composer_row.setContentsMargins(10, 6, 8, 6)
        composer_row.addWidget(self.input, 1)
        composer_row.addWidget(self.send_button, 0, Qt.AlignBottom)
        composer_row.addWidget(self.stop_button, 0, Qt.AlignBottom)
        composer = QFrame(objectName="composer")
        composer.setLayout(composer_row)
        composer.setMaximumWidth(800)  # the message column's 760 px and the frame's padding
        centre = QHBoxLayout()
        centre.setContentsMargins(16, 4, 16, 4)
        centre.addStretch(1)
        centre.addWidget(composer, 100)
        centre.addStretch(1)

        self.precision_label, self.notice_label = QLabel("loading model..."), QLabel()
        for label in (self.precision_label, self.notice_label):
            label.setProperty("muted", True)
        # a long notice must not widen the window: its size hint is ignored, the tooltip has it whole
        self.notice_label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.load_bar = QProgressBar(minimumWidth=240, maximumWidth=360, textVisible=True, format="loading model")
        self.load_bar.setRange(0, 0)  # busy until a download or a conversion reports its size
        self.cancel_load_button = QPushButton("Cancel loading")
        status = QHBoxLayout()
        status.setContentsMargins(16, 0, 16, 6)
        status.addWidget(self.notice_label, 1)
        # the stage's label before the bar: its width changes from stage to stage, the bar's place does not
        status.addWidget(self.precision_label)
        status.addWidget(self.load_bar)
        status.addWidget(self.cancel_load_button)
        statusbar = QFrame(objectName="statusbar")
        statusbar.setLayout(status)

        main = QVBoxLayout()
        main.setContentsMargins(0, 0, 0, 0)
        main.setSpacing(0)
        main.addWidget(topbar)
        main.addWidget(self.chat_view, 1)
        main.addLayout(centre)
        main.addWidget(statusbar)
        right = QWidget()
        right.setLayout(main)
        self.badge_asker = BadgeAsker()
        self.memory_panel = MemoryPanel()
        self.memory_panel.hide()
        self.gauge = self.memory_panel.gauge
        self.splitter = splitter = QSplitter()
        splitter.setHandleWidth(1)
        splitter.addWidget(sidebar)
        splitter.addWidget(right)
        splitter.addWidget(self.memory_panel)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([260, 840, 0])
        splitter.setCollapsible(1, False)
        self.setCentralWidget(splitter)
        self.render_timer = QTimer(self, singleShot=True, interval=RENDER_EVERY_MS)
        self.render_timer.timeout.connect(self.show_stream)
        self.reload_personas()
        self.paint_icons()

    def paint_icons(self) -> None:
        colour = COLOURS[self.theme.dark]["text"]
        for button, name in ((self.new_button, "plus"), (self.rename_button, "rename"), (self.delete_button, "trash"),
                             (self.persona_edit_button, "edit"), (self.persona_new_button, "persona"),
                             (self.export_button, "export"), (self.memory_button, "memory"),
                             (self.library_button, "library"),
                             (self.settings_button, "settings"), (self.send_button, "send"),
                             (self.stop_button, "stop")):
            button.setIcon(icon(name, COLOURS[self.theme.dark]["accentText"] if button is self.send_button else colour))
        self.theme_button.setIcon(icon("moon" if self.theme.dark else "sun", colour))
        self.theme_button.setText(self.theme.mode.capitalize())
        self.update_badge()

    def _connect(self) -> None:
        b = self.bridge
        b.ready.connect(self.on_ready)
        b.load_failed.connect(self.on_load_failed)
        b.load_progress.connect(self.on_load_progress)
        self.cancel_load_button.clicked.connect(self.bridge.cancel_load)
        b.token.connect(self.on_token)
        b.finished.connect(self.on_finished)
        b.failed.connect(self.on_failed)
        b.notice.connect(self.on_notice)
        b.snapshot.connect(self.on_snapshot)
        b.server_memory.connect(self.on_server_memory)  # a method: disconnected when the window goes
        self.connection_box.picked.connect(self.use_connection)
        b.reconfigured.connect(lambda _: (self.update_chips(), self.update_badge()))
        self.badge_asker.answered.connect(self.on_badge)
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(self.bridge.stop)
        self.new_button.clicked.connect(self.new_conversation)
        self.rename_button.clicked.connect(self.rename_conversation)
        self.delete_button.clicked.connect(self.delete_conversation)
        self.theme_button.clicked.connect(self.cycle_theme)
        self.theme.changed.connect(self.paint_icons)
        self.search.textChanged.connect(self.refresh_conversations)
        self.conversation_list.currentItemChanged.connect(self.on_select)
        self.persona_box.currentIndexChanged.connect(self.on_persona)
        self.settings_button.clicked.connect(lambda: self.open_settings())
        for chip in (self.model_chip, self.context_chip, self.kv_chip):
            chip.opened.connect(self.open_settings)
        self.memory_button.toggled.connect(self.show_memory_panel)
        self.library_button.clicked.connect(lambda: self.model_library().exec())
        self.persona_edit_button.clicked.connect(lambda: self.edit_persona(new=False))
        self.persona_new_button.clicked.connect(lambda: self.edit_persona(new=True))
        self.export_button.clicked.connect(self.export_dialog)
        self.chat_view.pressed.connect(self.focus_input)
        actions = self.chat_view.actions
        actions.copied.connect(lambda _text: self.notify("copied"))
        actions.edit_requested.connect(self.begin_edit)
        actions.regenerate_requested.connect(self.regenerate)
        actions.prompt_chosen.connect(self.use_prompt)
        QShortcut(QKeySequence.New, self, self.new_conversation)
        QShortcut(QKeySequence("Ctrl+,"), self, lambda: self.open_settings())
        QShortcut(QKeySequence("Escape"), self, self.escape)
        QShortcut(QKeySequence("Ctrl+M"), self, self.memory_button.toggle)

    def focus_input(self) -> None:
        """Typing goes to the message box: after a click in the conversation, and when the window
        shows (the splash had the focus before it)."""
        self.input.setFocus()

    def showEvent(self, event) -> None:
        super().showEvent(event)
        QTimer.singleShot(0, self.focus_input)

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

    def show_memory_panel(self, shown: bool) -> None:
        self.memory_panel.setVisible(shown)
        if shown:  # the splitter remembers it at zero width
            sizes = self.splitter.sizes()
            self.splitter.setSizes([sizes[0], max(200, sizes[1] - 280), 280])
        self.store.set_setting("memory_panel", shown)

    def cycle_theme(self) -> None:
        """System, then light, then dark; saved."""
        modes = ("system", "light", "dark")
        mode = modes[(modes.index(self.theme.mode) + 1) % len(modes)]
        self.theme.set_mode(mode)
        self.store.set_setting("theme", mode)

    # -- conversations --

    def refresh_conversations(self) -> None:
        self.conversation_list.fill(self.store.conversations(self.search.text()), self.conversation_id)

    def new_conversation(self) -> int:
        """A new chat, or the open one if it has no message yet: clicking twice makes one, not two
        empty chats that outlive a restart."""
        self.stop_editing()
        if self.conversation_id is not None and not self.store.messages(self.conversation_id):
            self.input.setFocus()
            return self.conversation_id
        self.conversation_id = self.store.create_conversation("New chat", self.persona_box.currentData())
        self.refresh_conversations()
        self.render_chat()
        self.input.setFocus()
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
        if item is not None and item.data(Qt.UserRole) is not None:
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
            self.notify(STREAMING_NOTICE)
            return
        title = self.store.conversation(doomed)["title"]
        if QMessageBox.question(self, "Delete chat", f"Delete “{title}” for good?",
                                QMessageBox.Yes | QMessageBox.Cancel, QMessageBox.Cancel) != QMessageBox.Yes:
            return
        self.store.delete_conversation(doomed)
        if self.waiting == doomed:
            self.waiting = None
        self.conversation_id = None
        self.refresh_conversations()
        self.render_chat()

    def on_persona(self, _index) -> None:
        if self.conversation_id is not None:
            self.store.set_persona(self.conversation_id, self.persona_box.currentData())
        self.update_badge()
        self.render_chat()

    def reload_personas(self, select: int | None = None) -> None:
        current = select if select is not None else self.persona_box.currentData()
        self.persona_box.blockSignals(True)
        self.persona_box.clear()
        for persona in self.store.personas():
            self.persona_box.addItem(persona["name"], persona["id"])
        self.persona_box.setCurrentIndex(max(0, self.persona_box.findData(current)))
        self.persona_box.blockSignals(False)

    def edit_persona(self, new: bool) -> None:
        persona = None if new else self.persona(self.persona_box.currentData())
        dialog = PersonaDialog(self, persona)
        if dialog.exec():
            self.save_persona(persona["id"] if persona else None, *dialog.values())

    def persona(self, persona_id: int | None) -> dict | None:
        return next((p for p in self.store.personas() if p["id"] == persona_id), None)

    def save_persona(self, persona_id: int | None, name: str, prompt: str) -> None:
        """A changed prompt is a new prefix: the old one's cache simply goes cold."""
        try:
            if persona_id is None:
                persona_id = self.store.add_persona(name, prompt)
            else:
                self.store.update_persona(persona_id, name, prompt)
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
        """Asks the engine whether the persona's prefix is in the pool or on disk; on_badge shows it."""
        persona = self.persona(self.persona_box.currentData())
        if self.bridge.loading or self.bridge.load_error:
            self.persona_badge.setText("")
            return
        if self.persona_badge.property("persona") != self.persona_box.currentData():
            self.persona_badge.setText("…")
        self.badge_asker.ask(self.bridge.engine, persona and persona["id"], persona and persona["system_prompt"])

    def on_badge(self, persona_id, state: str) -> None:
        if persona_id != self.persona_box.currentData():
            return  # answered for a persona no longer shown
        self.persona_badge.setProperty("persona", persona_id)
        self.persona_badge.setProperty("state", state)
        self.persona_badge.setText(LABELS[state])
        self.persona_badge.setToolTip({"warm": "This persona's prefix is in the KV cache: it is not computed again.",
                                       "disk": "This persona's prefix is saved on disk: it is restored, not computed.",
                                       "cold": "This persona's prefix would be computed for the next reply.",
                                       "short": "No persona prefix long enough to cache.",
                                       "server": "The server keeps its own prefix cache: the persona is sent "
                                                 "byte-identical every time, so that it hits there."}[state])
        colours = COLOURS[self.theme.dark]
        self.persona_badge.setStyleSheet(f"color: {colours['warm' if state in ('warm', 'disk', 'server') else 'cold']};")

    # -- the chat --

    def engine_messages(self, conversation_id: int) -> list[dict]:
        persona = self.persona(self.store.conversation(conversation_id)["persona_id"])
        head = [{"role": "system", "content": persona["system_prompt"]}] if persona else []
        return head + [m.for_engine() for m in self.store.messages(conversation_id)]

    def use_prompt(self, text: str) -> None:
        """An example prompt from the empty chat: sent as if typed."""
        self.input.setPlainText(text)
        self.send()

    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self.bridge.busy or self.waiting is not None:
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
            self.store.rename_conversation(self.conversation_id, text.splitlines()[0][:40])
        self.input.clear()
        self.store.add_message(self.conversation_id, "user", text)
        self.refresh_conversations()
        if self.bridge.loading:  # answered by on_ready
            self.waiting = self.conversation_id
            self.notify(WAITING_NOTE)
            self.render_chat()
            return
        self.start_reply()

    def regenerate(self) -> None:
        if self.conversation_id is None or self.bridge.busy or self.bridge.loading:
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
        self.notify(EDITING_NOTICE)

    def stop_editing(self) -> None:
        if self.editing is not None:
            self.editing = None
            self.send_button.setText("Send")
            self.clear_notice(EDITING_NOTICE)

    def edit_and_resend(self, position: int, text: str) -> None:
        """Replace the user message at ``position`` and everything after it."""
        if self.bridge.busy or self.bridge.loading or not text.strip():
            return
        self.store.truncate(self.conversation_id, position)
        self.store.add_message(self.conversation_id, "user", text.strip())
        self.start_reply()

    def start_reply(self, conversation_id: int | None = None) -> None:
        conversation_id = conversation_id or self.conversation_id
        messages = self.engine_messages(conversation_id)
        self.reply_text, self.reply_ids, self.last_save = "", [], time.monotonic()
        self.loop_guard, self.loop_stopped = LoopGuard(), False
        self.reply_id = self.store.add_message(conversation_id, "assistant", "", interrupted=True)
        self.reply_conversation = conversation_id
        self.send_button.setEnabled(False)
        self.send_button.hide()
        self.stop_button.setEnabled(True)
        self.stop_button.show()
        self.bridge.send(messages, self.sampling)
        self.render_chat()

    def on_token(self, text: str, token_id: int) -> None:
        if not self.reply_text and self.warming:
            self.warming = False  # the first token: the decode step is ready, whatever the notices said
            self.chat_view.model.set_note("")
        self.reply_text += text
        if token_id >= 0:
            self.reply_ids.append(token_id)
            if self.loop_guard.add(token_id) and not self.loop_stopped:
                self.loop_stopped = True
                self.bridge.stop()
                self.notify(f"stopped the reply: it was repeating its last {self.loop_guard.window} tokens")
        if time.monotonic() - self.last_save > SAVE_EVERY_S:
            self.store.update_message(self.reply_id, self.reply_text, self.reply_ids, interrupted=True)
            self.last_save = time.monotonic()
        if self.conversation_id == self.reply_conversation and not self.render_timer.isActive():
            self.render_timer.start()  # only while its chat is in view: another one is not redrawn under the reader

    def save_reply_so_far(self) -> None:
        """At quit: the streaming reply as the user last saw it, marked interrupted. The engine's
        cancelled end would arrive through the event loop, which has stopped by then, and the last
        periodic save is up to ``SAVE_EVERY_S`` behind the screen."""
        if self.reply_id is not None:
            self.store.update_message(self.reply_id, self.reply_text, self.reply_ids, interrupted=True)

    def show_stream(self) -> None:
        """The streaming reply's row, and only it, shows the text so far."""
        if self.reply_id is not None:
            self.chat_view.model.set_text(self.reply_id, self.reply_text)

    def on_finished(self, done: dict) -> None:
        cancelled = done["finish_reason"] == "cancelled"
        text = self.reply_text if cancelled else done["text"]
        stats = done["stats"]
        if cancelled and self.loop_stopped:  # a finished reply, not an interrupted one
            stats = {**stats, "finish_reason": "loop"}
        self.store.update_message(self.reply_id, text, done["token_ids"] or self.reply_ids, stats,
                                  interrupted=cancelled and not self.loop_stopped)
        self.end_reply()

    def on_failed(self, message: str) -> None:
        if self.reply_id is not None:
            self.store.update_message(self.reply_id, self.reply_text or f"*Error: {message}*", self.reply_ids,
                                      interrupted=True)
        self.end_reply()
        self.notify(f"error: {message}")

    def end_reply(self) -> None:
        self.reply_id = self.reply_conversation = None
        self.clear_notice(STREAMING_NOTICE)
        self.render_timer.stop()
        self.send_button.setEnabled(True)
        self.send_button.show()
        self.stop_button.setEnabled(False)
        self.stop_button.hide()
        self.update_badge()
        self.render_chat()

    def on_snapshot(self, snapshot: dict) -> None:
        self.memory_panel.show_snapshot(snapshot)
        where = " · on the CPU" if snapshot["on_cpu"] else ""
        self.precision_label.setText(f"KV {snapshot['precision']}{where}")
        self.kv_chip.setText(f"KV {snapshot['precision']}")
        if self.model_config is not None:
            full = 4 if snapshot["on_cpu"] else 2
            p = plan(self.model_config, snapshot["total"] - snapshot["other_processes"], 4096,
                     weights_size=snapshot["weights"], headroom=self.bridge.engine.config.headroom_bytes,
                     kv_full_bytes=full)
            self.memory_panel.show_contexts(p.max_context, trained_context(self.model_config))

    def on_server_memory(self, memory: dict) -> None:
        if self.bridge.server is not None:
            self.memory_panel.show_server(memory, self.bridge.server)

    def render_chat(self) -> None:
        """The whole conversation, when another one opens or a message is added or removed."""
        if self.conversation_id is None:
            self.chat_view.model.reset([], "Assistant")
            return
        persona = self.persona(self.store.conversation(self.conversation_id)["persona_id"])
        live = self.reply_id if self.reply_conversation == self.conversation_id else None
        self.chat_view.model.reset(self.store.messages(self.conversation_id), persona["name"] if persona else
                                   "Assistant", live, self.reply_text)
        if self.waiting == self.conversation_id:
            self.chat_view.model.set_note(WAITING_NOTE)
        self.note_warming()

    # -- settings --

    def settings_dialog(self) -> SettingsDialog:
        snap = self.gauge.snapshot
        memory = snap["total"] - snap["other_processes"] if snap else None
        current = self.store.setting("engine") or {}
        if self.bridge.server is None:
            engine = self.bridge.engine
            current = {**current, "max_context": engine.config.max_context,
                       "kv_precision": engine.config.kv_precision.value}
        return SettingsDialog(self, current, vars(self.sampling), self.model_config, memory,
                              on_cuda=bool(snap and not snap["on_cpu"]), server=self.bridge.server)

    def open_settings(self, focus: str | None = None) -> None:
        dialog = self.settings_dialog()
        if focus:
            dialog.focus_on(focus)
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
        self.sampling_from_model = False
        if self.bridge.server is not None:  # the server's model, context and precision are its own
            return
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

    def model_library(self, roots=None) -> ModelLibrary:
        snap = self.gauge.snapshot
        memory = snap["total"] - snap["other_processes"] if snap else None
        library = ModelLibrary(self, self.store.setting("model_folders") or [], memory,
                               bool(snap and not snap["on_cpu"]), roots)
        library.chosen.connect(self.load_from_library)
        library.finished.connect(lambda _: self.store.set_setting("model_folders", library.folders))
        return library

    def load_from_library(self, path: str) -> None:
        """Like choosing the model in Settings: saved only once it has loaded. On a connection, the
        app comes back to this computer with that model."""
        if self.bridge.server is not None:
            self.use_connection(None, {**(self.store.setting("engine") or {}), "model": path})
            return
        engine = self.bridge.engine
        now = {"model": "starter", "weights": "auto", **(self.store.setting("engine") or {}),
               "max_context": engine.config.max_context, "kv_precision": engine.config.kv_precision.value,
               "headroom_gib": engine.config.headroom_bytes / GiB}
        self.load_model({**now, "model": path}, previous=None if engine.load_error else now)

    def load_model(self, settings: dict, previous: dict | None) -> None:
        """Close the engine and load ``settings`` in a new one; the chat waits, the window does not."""
        if self.bridge.busy:
            self.bridge.stop()
        self.previous_engine_settings, self.pending_engine_settings = previous, settings
        self.set_loading(True)
        self.notify(f"loading {settings.get('model', 'starter')}...")
        self.bridge.switch_model(settings)

    def use_connection(self, name: str | None, local_settings: dict | None = None) -> None:
        """Run on the saved connection ``name``, or on this computer (None) with ``local_settings``
        (default: the saved ones). A streaming reply stops and keeps what it had."""
        self.store.set_setting("connection", name)
        self.connection_box.fill(name)
        self.previous_engine_settings = self.pending_engine_settings = None
        self.model_config = None
        self.set_loading(True, f"connecting to {name}" if name else "loading model")
        self.notify(f"connecting to {name}..." if name else "back on this computer: loading the model...")
        if name:
            self.bridge.use_connection(name)
        else:
            self.pending_engine_settings = local_settings
            self.bridge.use_local(local_settings or self.store.setting("engine") or {})

    def set_loading(self, loading: bool, what: str = "loading model") -> None:
        self.load_bar.setVisible(loading)
        self.cancel_load_button.setVisible(loading and not what.startswith("connecting"))  # nothing loads there
        if loading:
            self.load_bar.setRange(0, 0)
            self.load_bar.setFormat(what)
            self.precision_label.setText(f"{what}...")
            self.model_chip.setText("connecting…" if what.startswith("connecting") else "loading…")

    def on_load_progress(self, done: int, total: int, stage: str = "download") -> None:
        """A download in bytes; a GGUF's first conversion in its stages, the tensors counted; then the
        weights, tensor by tensor. A busy bar draws no text: the label beside it names the stage."""
        if stage in BUSY_STAGES:
            self.load_bar.setRange(0, 0)
            self.precision_label.setText(BUSY_STAGES[stage])
            return
        if total <= 0:
            return
        if stage in COUNTED_STAGES:
            what = COUNTED_STAGES[stage]
            self.load_bar.setRange(0, total)
            self.load_bar.setValue(done)
            self.load_bar.setFormat(f"{what}: tensor {done} of {total}")
            self.precision_label.setText(f"{what}…")
            return
        self.load_bar.setRange(0, 1000)
        self.load_bar.setValue(int(1000 * done / total))
        self.load_bar.setFormat(f"{done / 1e9:.2f} / {total / 1e9:.2f} GB")
        self.precision_label.setText("downloading…")

    def on_ready(self) -> None:
        self.set_loading(False)
        if self.pending_engine_settings is not None:  # it loaded: now it is the setting
            self.store.set_setting("engine", self.pending_engine_settings)
        self.previous_engine_settings = self.pending_engine_settings = None
        self.model_config, self.model_label = self.bridge.model_config, self.bridge.label
        # the model's own sampling defaults; a server's model has none to read here
        loaded = getattr(self.bridge.engine, "loaded", None)  # read once, the engine thread is done loading
        if self.sampling_from_model:
            self.sampling = SamplingParams(**model_defaults(getattr(getattr(loaded, "model", None),
                                                                    "generation_config", None)))
        server = self.bridge.server
        self.precision_label.setText(f"on {self.bridge.settings['host']}" if server else f"KV {self.bridge.precision}")
        if server:
            self.memory_panel.show_server(None, server)
        self.chat_view.actions.set_where(f"Replies come from {self.bridge.settings['host']}: what you type is sent "
                                         "there." if server else self.chat_view.actions.LOCAL_NOTE)
        self.update_chips()
        self.update_badge()
        self.notify(f"connected: {self.bridge.settings['model']} at {server}" if server else
                    f"model ready: {(self.store.setting('engine') or {}).get('model', 'starter')}")
        self.answer_waiting()

    def answer_waiting(self) -> None:
        """The message sent while the model loaded gets its reply now."""
        if self.waiting is not None:
            waiting, self.waiting = self.waiting, None
            self.start_reply(waiting)

    def update_chips(self) -> None:
        server = self.bridge.server
        self.top_bar.allow(self.context_chip, server is None)
        if server is not None:  # the model and its cache are the server's: the chip names them
            self.model_chip.setText(model_name(self.bridge.settings["model"]))
            self.model_chip.setToolTip(f"{self.bridge.settings['model']} at {server}, the connection's model")
            self.kv_chip.setText("KV on the server")
            return
        self.model_chip.setToolTip("The model: click to change it")
        if self.model_config is None:
            return
        engine = self.bridge.engine
        weights = (self.store.setting("engine") or {}).get("weights", "auto")
        parts = [model_name(self.model_label), size_label(self.model_config), f"weights {weights}"]
        self.model_chip.setText(" · ".join(p for p in parts if p))
        self.context_chip.setText(f"{engine.config.max_context:,} ctx")
        self.kv_chip.setText(f"KV {engine.config.kv_precision.value}")

    def on_load_failed(self, message: str) -> None:
        """Say why; after a failed switch, load the model that worked again (its setting was never
        replaced). With none to go back to (the saved model fails at launch), say so and stay there."""
        self.set_loading(False)
        previous = self.previous_engine_settings
        self.previous_engine_settings = self.pending_engine_settings = None
        if previous is not None and getattr(self.bridge, "load_error", "") is None:
            # the engine brought the previous model back itself: it is the setting again
            self.show_error(f"The model could not be loaded: {message}")
            self.store.set_setting("engine", previous)
            self.update_chips()
            self.update_badge()
            self.notify(f"model ready: {previous.get('model', 'starter')} (back after the failed load)")
            self.answer_waiting()
        elif previous is not None:
            self.show_error(f"The model could not be loaded: {message}")
            self.load_model(previous, previous=None)
        elif self.store.setting("connection"):
            self.precision_label.setText("not connected")
            self.model_chip.setText("not connected")
            self.show_error(f"Could not use the connection {self.store.setting('connection')}: {message}. "
                            "Edit it, or choose another one or this computer in the box at the top.")
        else:
            self.precision_label.setText("no model loaded")
            self.model_chip.setText("no model")
            self.show_error(f"The model could not be loaded: {message}. Choose another one in Settings.")

    def on_notice(self, kind: str, message: str) -> None:
        self.notify(f"{kind}: {message}")
        if kind in ("warm-up", "eager"):  # eager: the compile failed, so it is over too
            self.warming = kind == "warm-up" and message.startswith("preparing")
            self.note_warming()

    def note_warming(self) -> None:
        """Under a reply that waits for the decode step to compile, in its own chat: why."""
        if self.reply_id is not None and not self.reply_text and self.reply_conversation == self.conversation_id:
            self.chat_view.model.set_note(WARMING_NOTE if self.warming else "")

    def clear_notice(self, prefix: str) -> None:
        """A notice about a state (an edit under way, a reply in the way) goes when the state ends."""
        if self.notice_label.text().startswith(prefix):
            self.notice_label.setText("")

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
