"""Light and dark: follows the system's colour scheme unless the user picked one. One set of colours
feeds both the widgets (a Fusion palette and a small style sheet) and the QML chat view."""
from PySide6.QtCore import QObject, Qt, Property, Signal, Slot
from PySide6.QtGui import QColor, QGuiApplication, QPalette

from kvchat.app.views.icons import tinted_file

MODES = ("system", "light", "dark")

COLOURS = {
    False: {"bg": "#ffffff", "sidebar": "#f5f5f7", "panel": "#fafafa", "text": "#1f2328", "muted": "#6b7280",
            "border": "#e4e4e7", "accent": "#4f46e5", "accentText": "#ffffff", "userBubble": "#eef0fb",
            "codeBg": "#f6f8fa", "codeHeader": "#eaeef2", "hover": "#ececf1", "chip": "#f0f0f3",
            "warm": "#15803d", "cold": "#6b7280", "danger": "#b91c1c", "dangerText": "#ffffff"},
    True: {"bg": "#1e1f22", "sidebar": "#17181a", "panel": "#1b1c1f", "text": "#e6e6e6", "muted": "#9ca3af",
           "border": "#2f3136", "accent": "#8b87f5", "accentText": "#111111", "userBubble": "#2a2d38",
           "codeBg": "#131417", "codeHeader": "#26282d", "hover": "#2a2c31", "chip": "#27292e",
           "warm": "#4ade80", "cold": "#9ca3af", "danger": "#f87171", "dangerText": "#111111"},
}

STYLE_SHEET = """
QFrame#sidebar {{ background: {sidebar}; border-right: 1px solid {border}; }}
QFrame#topbar, QFrame#statusbar {{ background: {bg}; }}
QFrame#topbar {{ border-bottom: 1px solid {border}; }}
QFrame#composer {{ background: {panel}; border: 1px solid {border}; border-radius: 14px; }}
QFrame#composer QPlainTextEdit {{ background: transparent; border: none; font-size: 14px; }}
QFrame#memoryPanel {{ background: {sidebar}; border-left: 1px solid {border}; }}
QListWidget#conversations {{ background: transparent; border: none; outline: none; }}
QListWidget#conversations::item {{ padding: 6px 8px; border-radius: 8px; }}
QListWidget#conversations::item:selected {{ background: {hover}; color: {text}; }}
QListWidget#conversations::item:hover:!selected {{ background: {hover}; }}
QLineEdit#search {{ border: 1px solid {border}; border-radius: 8px; padding: 5px 8px; background: {bg}; }}
QToolButton[chip="true"] {{ background: {chip}; border: 1px solid {border}; border-radius: 12px;
                            padding: 3px 10px; color: {text}; }}
QToolButton[chip="true"]:hover {{ border-color: {accent}; }}
QPushButton#send {{ background: {accent}; color: {accentText}; border: none; border-radius: 10px; padding: 6px 14px; }}
QPushButton#send:disabled {{ background: {border}; color: {muted}; }}
QPushButton#newChat {{ border: 1px solid {border}; border-radius: 8px; padding: 6px; background: {bg}; }}
QPushButton#newChat:hover {{ background: {hover}; border-color: {accent}; }}
QDialog, QMessageBox {{ background: {bg}; }}
QDialog QLabel[help="true"] {{ color: {muted}; font-size: 11px; }}
QDialog QPushButton, QMessageBox QPushButton {{ background: {chip}; color: {text}; border: 1px solid {border};
                                                border-radius: 8px; padding: 5px 16px; min-width: 64px; }}
QDialog QPushButton:hover, QMessageBox QPushButton:hover {{ border-color: {accent}; }}
QDialog QPushButton:default, QMessageBox QPushButton:default {{ background: {accent}; color: {accentText};
                                                                border-color: {accent}; }}
QDialog QPushButton[kind="accent"] {{ background: {accent}; color: {accentText}; border-color: {accent}; }}
QDialog QPushButton[kind="danger"] {{ background: {danger}; color: {dangerText}; border-color: {danger}; }}
QDialog QPushButton[kind="plain"] {{ background: {chip}; color: {text}; border-color: {border}; }}
QDialog QPushButton[kind="plain"]:hover {{ border-color: {accent}; }}
QLabel#sheetTitle {{ font-size: 20px; font-weight: 600; color: {text}; }}
QLabel#sheetSubtitle {{ font-size: 13px; color: {muted}; }}
QLabel#sheetText {{ font-size: 13px; color: {text}; }}
QLabel#sheetSection {{ font-size: 13px; font-weight: 600; color: {text}; }}
QFrame#sheetCard {{ background: {panel}; border: 1px solid {border}; border-radius: 12px; }}
QFrame#sheetCard QLabel {{ background: transparent; }}
QFrame#sheetCard QListWidget {{ background: {bg}; border: 1px solid {border}; border-radius: 8px; padding: 4px; }}
QFrame#sheetCard QPlainTextEdit {{ background: {bg}; border: 1px solid {border}; border-radius: 8px; padding: 4px; }}
QDialog QLineEdit, QInputDialog QLineEdit {{ border: 1px solid {border}; border-radius: 8px; padding: 5px 8px;
                                             background: {panel}; color: {text}; }}
QDialog QLineEdit:focus {{ border-color: {accent}; }}
QDialogButtonBox {{ dialogbuttonbox-buttons-have-icons: 0; }}
QComboBox {{ combobox-popup: 0; }}
QDialog QCheckBox::indicator {{ width: 14px; height: 14px; border: 1px solid {muted}; border-radius: 4px;
                               background: {panel}; }}
QDialog QCheckBox::indicator:hover {{ border-color: {accent}; }}
QDialog QCheckBox::indicator:checked {{ background: {accent}; border-color: {accent}; image: url({check}); }}
QComboBox QAbstractItemView {{ background: {panel}; color: {text}; border: 1px solid {border};
                               selection-background-color: {hover}; selection-color: {text}; outline: none; }}
QFrame#attachmentChip {{ background: {chip}; border: 1px solid {border}; border-radius: 10px; }}
QFrame#attachmentChip[tooLong="true"] {{ border-color: {danger}; }}
QFrame#attachmentChip[tooLong="true"] QLabel {{ color: {danger}; }}
QLabel[muted="true"] {{ color: {muted}; }}
QScrollBar:vertical {{ background: transparent; width: 10px; margin: 2px; }}
QScrollBar::handle:vertical {{ background: {border}; border-radius: 3px; min-height: 24px; }}
QScrollBar::handle:vertical:hover {{ background: {muted}; }}
QScrollBar::add-line:vertical, QScrollBar::sub-line:vertical {{ height: 0; border: none; }}
QScrollBar::add-page:vertical, QScrollBar::sub-page:vertical {{ background: none; }}
"""


def system_scheme() -> Qt.ColorScheme:
    return QGuiApplication.styleHints().colorScheme()


def scheme_is_dark(mode: str) -> bool:
    if mode == "dark":
        return True
    if mode == "light":
        return False
    return system_scheme() == Qt.ColorScheme.Dark


def palette(dark: bool) -> QPalette:
    c = COLOURS[dark]
    p = QPalette()
    for role, key in ((QPalette.Window, "bg"), (QPalette.Base, "bg"), (QPalette.AlternateBase, "panel"),
                      (QPalette.Button, "chip"), (QPalette.WindowText, "text"), (QPalette.Text, "text"),
                      (QPalette.ButtonText, "text"), (QPalette.ToolTipBase, "panel"), (QPalette.ToolTipText, "text"),
                      (QPalette.Highlight, "accent"), (QPalette.HighlightedText, "accentText"),
                      (QPalette.PlaceholderText, "muted"), (QPalette.Mid, "border"), (QPalette.Link, "accent")):
        p.setColor(role, QColor(c[key]))
    for role in (QPalette.WindowText, QPalette.Text, QPalette.ButtonText):
        p.setColor(QPalette.Disabled, role, QColor(c["muted"]))
    return p


class Theme(QObject):
    """``colours`` and ``dark`` for QML; ``mode`` is the user's choice (system, light or dark)."""
    changed = Signal()

    def __init__(self, mode: str = "system"):
        super().__init__()
        self._mode = mode if mode in MODES else "system"
        self._dark = scheme_is_dark(self._mode)
        # a bound slot, not a lambda: Qt drops the connection when this theme is deleted
        QGuiApplication.styleHints().colorSchemeChanged.connect(self._on_system_scheme)

    @property
    def mode(self) -> str:
        return self._mode

    @Slot(Qt.ColorScheme)
    def _on_system_scheme(self, _scheme) -> None:
        self.set_mode(self._mode)

    def set_mode(self, mode: str) -> None:
        self._mode = mode if mode in MODES else "system"
        self._dark = scheme_is_dark(self._mode)
        self.apply()
        self.changed.emit()

    def apply(self) -> None:
        """The widgets' look: Fusion with this palette, plus the few rounded parts Fusion lacks."""
        app = QGuiApplication.instance()
        app.setPalette(palette(self._dark))
        if hasattr(app, "setStyleSheet"):
            colours = COLOURS[self._dark]
            app.setStyleSheet(STYLE_SHEET.format(**colours, check=tinted_file("check", colours["accentText"])))

    def _get_dark(self) -> bool:
        return self._dark

    def _get_colours(self) -> dict:
        return COLOURS[self._dark]

    dark = Property(bool, _get_dark, notify=changed)
    colours = Property("QVariantMap", _get_colours, notify=changed)
