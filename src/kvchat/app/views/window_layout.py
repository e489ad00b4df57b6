"""The main window's widgets and where they sit: the sidebar, the top bar, the composer and the status
bar. Each builder sets the widgets on the window (the controllers and tests reach them there) and
returns the frame that holds them."""
from PySide6.QtCore import QObject, Qt, Slot
from shiboken6 import isValid
from PySide6.QtWidgets import (QComboBox, QFrame, QHBoxLayout, QLabel, QLineEdit, QProgressBar,
                               QPushButton, QSizePolicy, QToolButton, QVBoxLayout)

from kvchat.app.views.composer import Composer
from kvchat.app.views.composer_height import ComposerHeight
from kvchat.app.views.connection_box import ConnectionBox
from kvchat.app.views.elided_label import ElidedLabel
from kvchat.app.views.running_button import RunningButton
from kvchat.app.views.conversation_list import ConversationList
from kvchat.app.views.top_bar import Chip, TopBar

# the model chip elides its name: the context and KV chips give way before it is narrower than this
MODEL_CHIP_ROOM = 160


def sidebar(win) -> QFrame:
    win.new_button = QPushButton("New chat", objectName="newChat")
    win.search = QLineEdit(placeholderText="Search chats", objectName="search")
    win.search.setClearButtonEnabled(True)
    win.conversation_list = ConversationList()
    win.rename_button, win.delete_button, win.theme_button = (
        QToolButton(autoRaise=True, toolTip=t) for t in ("Rename chat", "Delete chat", "Theme"))
    win.theme_button.setToolButtonStyle(Qt.ToolButtonTextBesideIcon)
    side = QVBoxLayout()
    side.setContentsMargins(10, 12, 10, 10)
    side.addWidget(win.new_button)
    side.addWidget(win.search)
    side.addWidget(win.conversation_list, 1)
    win.no_match = QLabel(objectName="noMatch", wordWrap=True)
    win.no_match.setProperty("muted", True)
    win.no_match.hide()
    side.addWidget(win.no_match)
    win.search_note = SearchNote(win)
    row = QHBoxLayout()
    for b in (win.rename_button, win.delete_button):
        row.addWidget(b)
    row.addStretch(1)
    row.addWidget(win.theme_button)
    side.addLayout(row)
    frame = QFrame(objectName="sidebar")
    frame.setLayout(side)
    frame.setMinimumWidth(180)  # beside the memory panel and the top bar at their minimum, within 1,000 px
    return frame


class SearchNote(QObject):
    """A search that finds no chat says so, instead of showing an empty list. A child of the label:
    the list's last signals, while the window is torn down, no longer reach it."""

    def __init__(self, win):
        super().__init__(win.no_match)
        self.win = win
        model = win.conversation_list.model()
        for signal in (model.rowsInserted, model.rowsRemoved, model.modelReset):
            signal.connect(self.update)
        win.search.textChanged.connect(self.update)

    @Slot()
    def update(self, *_) -> None:
        if not isValid(self.win.search):  # the list empties itself as the window is torn down
            return
        text = self.win.search.text().strip()
        empty = bool(text) and not self.win.conversation_list.chat_items()
        self.win.no_match.setText(f"No chat matches “{text}”. Search looks in titles and messages." if empty else "")
        self.win.no_match.setVisible(empty)


def top_bar(win) -> TopBar:
    win.persona_box = QComboBox()
    win.persona_box.setMinimumContentsLength(10)  # its size hint, so a narrow window squeezes the chips first
    win.persona_badge = QLabel()
    win.persona_edit_button, win.persona_new_button, win.export_button = (
        QToolButton(autoRaise=True, toolTip=t) for t in ("Edit persona", "New persona", "Export chat"))
    win.connection_box = ConnectionBox()
    win.running_button = RunningButton()
    win.model_chip = Chip("model", "The model: click to change it")
    win.model_chip.setMinimumWidth(90)  # a narrow window elides the chip instead of overlapping the persona
    win.context_chip = Chip("context", "Context length: click to change it")
    win.kv_chip = Chip("precision", "Memory saving (the KV cache's precision): click to change it")
    win.memory_button = QToolButton(autoRaise=True, toolTip="Memory (Ctrl+M)", checkable=True)
    win.library_button = QToolButton(autoRaise=True, toolTip="Models on this computer (Ctrl+L)")
    win.settings_button = QToolButton(autoRaise=True, toolTip="Settings (Ctrl+,)")
    win.more_button = QToolButton(autoRaise=True, text="⋯", toolTip="More: what the bar has no room for",
                                  objectName="moreChips")
    row = QHBoxLayout()
    row.setContentsMargins(14, 8, 10, 8)
    row.addWidget(win.persona_box)
    row.addWidget(win.persona_badge)
    for b in (win.persona_edit_button, win.persona_new_button):
        row.addWidget(b)
    row.addStretch(1)
    for w in (win.running_button, win.connection_box, win.model_chip, win.context_chip, win.kv_chip, win.more_button,
              win.library_button, win.export_button, win.memory_button, win.settings_button):
        row.addWidget(w)
    # narrow, the library's and export's buttons go into the overflow menu first, then the chips
    win.top_bar = TopBar(row, [win.context_chip, win.kv_chip, win.library_button, win.export_button],
                         {win.model_chip: MODEL_CHIP_ROOM}, win.more_button,
                         objectName="topbar")
    return win.top_bar


def composer(win) -> QHBoxLayout:
    """The message box with Send and Stop, centred under the message column."""
    win.input = Composer(placeholderText="Message kvchat (Enter sends, Shift+Enter for a new line)")
    win.input.setTabChangesFocus(True)  # Tab moves on (to Send): a chat message has no use for a tab
    win.input_height = ComposerHeight(win.input)
    win.attach_button = QToolButton(objectName="attach", autoRaise=True,
                                    toolTip="Attach files: text, code, Markdown, CSV or PDF (or drop them here)")
    win.send_button = QPushButton("Send", objectName="send")
    win.stop_button = QPushButton("Stop")
    win.stop_button.setEnabled(False)
    win.stop_button.hide()
    row = QHBoxLayout()
    row.setContentsMargins(10, 6, 8, 6)
    row.addWidget(win.attach_button, 0, Qt.AlignBottom)
    row.addWidget(win.input, 1)
    row.addWidget(win.send_button, 0, Qt.AlignBottom)
    row.addWidget(win.stop_button, 0, Qt.AlignBottom)
    frame = QFrame(objectName="composer")
    frame.setLayout(row)
    frame.setMaximumWidth(800)  # the message column's 760 px and the frame's padding
    centre = QHBoxLayout()
    centre.setContentsMargins(16, 4, 16, 4)
    centre.addStretch(1)
    centre.addWidget(frame, 100)
    centre.addStretch(1)
    return centre


def status_bar(win) -> QFrame:
    win.precision_label, win.notice_label = QLabel("loading model..."), ElidedLabel()
    for label in (win.precision_label, win.notice_label):
        label.setProperty("muted", True)
    # a long notice must not widen the window: its size hint is ignored, it ends in "…" where it is
    # cut, and the tooltip has it whole
    win.notice_label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
    win.load_bar = QProgressBar(minimumWidth=240, maximumWidth=360, textVisible=True, format="loading model")
    win.load_bar.setRange(0, 0)  # busy until a download or a conversion reports its size
    win.cancel_load_button = QPushButton("Cancel loading")
    row = QHBoxLayout()
    row.setContentsMargins(16, 0, 16, 6)
    row.addWidget(win.notice_label, 1)
    # the stage's label before the bar: its width changes from stage to stage, the bar's place does not
    row.addWidget(win.precision_label)
    row.addWidget(win.load_bar)
    row.addWidget(win.cancel_load_button)
    frame = QFrame(objectName="statusbar")
    frame.setLayout(row)
    return frame
