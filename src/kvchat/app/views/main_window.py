"""The main window: its widgets (views/window_layout.py) wired to four controllers: the chats
(conversations), personas, the reply, and the model. Everything the user does is saved at once; the
engine is only reached through the bridge's queued signals."""
import time
from pathlib import Path

from PySide6.QtCore import QEvent, Qt, QTimer
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import QFileDialog, QMainWindow, QSplitter, QVBoxLayout, QWidget

from kvchat.core.config import SamplingParams

from kvchat.app.controllers.compile_ticker import CompileTicker
from kvchat.app.controllers.conversations import ConversationController
from kvchat.app.controllers.desktop import DesktopController
from kvchat.app.controllers.model_choice import PENDING, ModelController
from kvchat.app.controllers.memory_tally import MemoryTally
from kvchat.app.controllers.personas import PersonaController
from kvchat.app.controllers.replies import WAITING_NOTE, ReplyController
from kvchat.app.controllers.wait_notes import WaitNotes
from kvchat.app.models.sampling_defaults import model_defaults
from kvchat.app.store import Store
from kvchat.app.views import window_layout
from kvchat.app.views.chat_view import ChatView
from kvchat.app.views.icons import icon
from kvchat.app.views.load_bar import show_progress
from kvchat.app.views.memory_panel import MemoryPanel
from kvchat.app.views.sheet import give_keys_back, tell_later
from kvchat.app.views.theme import COLOURS, Theme

NOTICES_KEPT = 20  # the notice line's tooltip lists this many of the latest
FILE_TYPES = ("Documents (*.txt *.md *.markdown *.rst *.csv *.tsv *.json *.yaml *.yml *.toml *.log *.pdf *.py *.js *.ts "
              "*.c *.h *.cpp *.hpp *.rs *.go *.java *.kt *.rb *.php *.sh *.sql *.html *.css *.xml);;All files (*)")


class MainWindow(QMainWindow):
    def __init__(self, store: Store, bridge, sampling: SamplingParams | None = None, theme: Theme | None = None):
        super().__init__()
        self.store, self.bridge = store, bridge
        saved = store.setting("sampling")
        # until the model says otherwise (ModelController.on_ready), the fallback defaults
        self.sampling = sampling or SamplingParams(**(saved or model_defaults(None)))
        self.sampling_from_model = sampling is None and saved is None
        self.theme = theme or Theme(store.setting("theme") or "system")
        self.theme.apply()
        self.conversation_id: int | None = None  # the chat in view
        self.notices: list[str] = []
        self.setWindowTitle("kvchat")
        self.resize(1200, 720)  # room for every chip of the top bar beside the sidebar
        self._build()
        self.chats, self.personas = ConversationController(self), PersonaController(self)
        self.replies, self.models = ReplyController(self), ModelController(self)
        self.waits, self.tally = WaitNotes(self), MemoryTally(self)
        self.personas.reload()
        self.paint_icons()
        self._connect()
        self.memory_button.setChecked(bool(store.setting("memory_panel")))
        self.models.set_loading(self.bridge.loading)
        self.bridge.start()  # after _connect: then ready or load_failed reaches us, however fast
        if store.setting("connection") and self.connection_box.findData(store.setting("connection")) > 0:
            self.models.use_connection(store.setting("connection"))  # the local engine started behind it is closed
        self.chats.refresh()
        self.render_chat()
        self.desktop = DesktopController(self)  # its keys and menu; the window's size and last chat back
        self.input.setFocus()

    def _build(self) -> None:
        sidebar = window_layout.sidebar(self)
        self.chat_view = ChatView(self.theme)
        main = QVBoxLayout()
        main.setContentsMargins(0, 0, 0, 0)
        main.setSpacing(0)
        main.addWidget(window_layout.top_bar(self))
        main.addWidget(self.chat_view, 1)
        main.addLayout(window_layout.composer(self))
        main.addWidget(window_layout.status_bar(self))
        self.input.installEventFilter(self)
        right = QWidget()
        right.setLayout(main)
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

    def paint_icons(self) -> None:
        colour = COLOURS[self.theme.dark]["text"]
        for button, name in ((self.new_button, "plus"), (self.rename_button, "rename"), (self.delete_button, "trash"),
                             (self.persona_edit_button, "edit"), (self.persona_new_button, "persona"),
                             (self.export_button, "export"), (self.memory_button, "memory"),
                             (self.library_button, "library"), (self.settings_button, "settings"),
                             (self.send_button, "send"), (self.stop_button, "stop"),
                             (self.attach_button, "paperclip")):
            button.setIcon(icon(name, COLOURS[self.theme.dark]["accentText"] if button is self.send_button else colour))
        self.theme_button.setIcon(icon("moon" if self.theme.dark else "sun", colour))
        self.theme_button.setText(self.theme.mode.capitalize())
        self.personas.update_badge()

    def _connect(self) -> None:
        b, chats, personas, replies, models = self.bridge, self.chats, self.personas, self.replies, self.models
        b.ready.connect(models.on_ready)
        b.load_failed.connect(models.on_load_failed)
        b.load_progress.connect(lambda done, total, stage: show_progress(self, done, total, stage))
        b.token.connect(replies.on_token)
        b.finished.connect(replies.on_finished)
        b.reply_failed.connect(replies.on_reply_failed)
        b.failed.connect(replies.on_failed)
        b.notice.connect(self.on_notice)
        self.compile_ticker = CompileTicker(self)
        b.notice.connect(self.compile_ticker.on_notice)
        b.snapshot.connect(models.on_snapshot)
        b.server_memory.connect(models.on_server_memory)
        b.reconfigured.connect(lambda _: (models.update_chips(), personas.update_badge(), self.clear_notice(PENDING),
                                          self.input.recount()))
        b.ready.connect(self.input.recount)  # another model, another tokenizer
        self.input.attached.connect(b.count_tokens)
        b.tokens_counted.connect(self.input.set_count)
        self.cancel_load_button.clicked.connect(b.cancel_load)
        self.connection_box.picked.connect(models.use_connection)
        self.send_button.clicked.connect(replies.send)
        self.attach_button.clicked.connect(self.pick_files)
        self.input.refused.connect(self.notify)
        self.stop_button.clicked.connect(replies.stop)
        self.running_button.clicked.connect(replies.show_next)
        self.new_button.clicked.connect(chats.new)
        self.rename_button.clicked.connect(chats.rename)
        self.delete_button.clicked.connect(chats.delete)
        self.export_button.clicked.connect(chats.export_dialog)
        self.search.textChanged.connect(chats.refresh)
        self.conversation_list.currentItemChanged.connect(chats.on_select)
        self.theme_button.clicked.connect(self.cycle_theme)
        self.theme.changed.connect(self.paint_icons)
        self.persona_box.currentIndexChanged.connect(personas.on_chosen)
        self.persona_edit_button.clicked.connect(lambda: personas.edit(new=False))
        self.persona_new_button.clicked.connect(lambda: personas.edit(new=True))
        self.settings_button.clicked.connect(lambda: models.open_settings())
        for chip in (self.model_chip, self.context_chip, self.kv_chip):
            chip.opened.connect(models.open_settings)
        self.memory_button.toggled.connect(self.show_memory_panel)
        self.library_button.clicked.connect(models.show_library)
        self.chat_view.pressed.connect(self.focus_input)
        actions = self.chat_view.actions
        actions.copied.connect(lambda _text: self.notify("copied"))
        actions.edit_requested.connect(replies.begin_edit)
        actions.regenerate_requested.connect(replies.regenerate)
        actions.version_requested.connect(replies.show_version)
        actions.prompt_chosen.connect(replies.use_prompt)
        QShortcut(QKeySequence.New, self, chats.new)
        QShortcut(QKeySequence("Ctrl+,"), self, lambda: models.open_settings())
        QShortcut(QKeySequence("Escape"), self, self.escape)
        QShortcut(QKeySequence("Ctrl+M"), self, self.memory_button.toggle)

    def focus_input(self) -> None:
        """Typing goes to the message box: after a click in the conversation, and when the window shows."""
        self.input.setFocus()

    def showEvent(self, event) -> None:
        super().showEvent(event)
        QTimer.singleShot(0, self.focus_input)

    def escape(self) -> None:
        """Stops a reply; otherwise leaves an edit, putting the box back as it was."""
        if self.replies.shown is not None:
            self.replies.stop()
        elif self.replies.editing is not None:
            self.replies.stop_editing()
            self.input.clear()
            self.notify("edit cancelled")

    def eventFilter(self, obj, event) -> bool:
        if obj is self.input and event.type() == QEvent.KeyPress and event.key() in (Qt.Key_Return, Qt.Key_Enter):
            if not event.modifiers() & Qt.ShiftModifier:
                self.replies.send()
                return True
        return super().eventFilter(obj, event)

    def show_memory_panel(self, shown: bool) -> None:
        """The panel's room comes from the chat column down to its minimum (the top bar's), then
        from the list of chats down to its own, so a window of 1,000 px keeps its width (it grew to
        1,095 px when the column's share went under its minimum)."""
        if shown:  # the splitter remembers it at zero width
            side, centre, _ = self.splitter.sizes()
            total, panel = side + centre, self.memory_panel.width()
            centre = max(self.splitter.widget(1).minimumSizeHint().width(), total - side - panel)
            side = max(self.splitter.widget(0).minimumSizeHint().width(), total - centre - panel)
            self.memory_panel.setVisible(True)
            self.splitter.setSizes([side, centre, panel])
        else:
            self.memory_panel.setVisible(False)
        self.store.set_setting("memory_panel", shown)

    def cycle_theme(self) -> None:
        """System, then light, then dark; saved."""
        modes = ("system", "light", "dark")
        mode = modes[(modes.index(self.theme.mode) + 1) % len(modes)]
        self.theme.set_mode(mode)
        self.store.set_setting("theme", mode)

    def render_chat(self, refresh: bool = False, follow: bool = False) -> None:
        """The whole conversation, when another one opens or a message is added or removed; with
        ``refresh`` (a message sent, a reply ended), only the rows that changed or came, and with
        ``follow`` the view goes to the newest."""
        model, replies = self.chat_view.model, self.replies
        replies.update_buttons()  # Stop stands for the chat in view's reply, if it has one
        if self.conversation_id is None:
            model.reset([], "Assistant")
            return
        persona = self.personas.persona(self.store.conversation(self.conversation_id)["persona_id"])
        live = replies.shown
        (model.refresh if refresh else model.reset)(self.store.messages(self.conversation_id),
                                                    persona["name"] if persona else "Assistant",
                                                    live and live.reply_id, live.text if live else "")
        if refresh:
            self.tally.show()  # the chat's tokens, from the saved reply's stats (a reset tells it itself)
            if follow:
                model.follow.emit()
        if replies.waiting == self.conversation_id:
            model.set_note(WAITING_NOTE)
        self.waits.note_warming()

    def on_notice(self, kind: str, message: str) -> None:
        self.notify(f"{kind}: {message}")

    def clear_notice(self, prefix: str) -> None:
        """A notice about a state (an edit under way, a reply in the way) goes when the state ends."""
        if self.notice_label.text().startswith(prefix):
            self.notice_label.setText("")

    def pick_files(self) -> None:
        """The paper clip: files picked in the system's dialog are attached."""
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach files", str(Path.home()), FILE_TYPES)
        give_keys_back(self)
        self.input.attach_files(paths)

    def notify(self, message: str) -> None:
        """The notice line shows the latest; its tooltip the ones before."""
        self.notices = (self.notices + [f"{time.strftime('%H:%M:%S')}  {message}"])[-NOTICES_KEPT:]
        self.notice_label.setText(message)
        self.notice_label.setToolTip("\n".join(self.notices))

    def show_error(self, message: str) -> None:
        """In the notice line, and in a dialog that does not block the event loop."""
        self.notify(message)
        tell_later(self, "Something went wrong", message)
