"""Start the desktop app: the database, the engine on its thread, the window (about 1.5 s here; the
model loads behind it). No splash: a splash shown first took the window activation under X without
a window manager, and keys typed into the new window went nowhere."""
import sys

from PySide6.QtWidgets import QApplication, QMessageBox

from .store import Store, StoreError


def make_engine(settings: dict):
    """An engine for the settings panel's values; it loads the model on its own thread."""
    from kvchat.engine.config import EngineConfig
    from kvchat.engine.engine import Engine
    from kvchat.engine.memory import GiB

    return Engine(EngineConfig(model=settings.get("model", "starter"), kv_precision=settings.get("kv_precision", "auto"),
                               max_context=settings.get("max_context", 8192),
                               weights=settings.get("weights", "auto"),
                               headroom_bytes=int(settings.get("headroom_gib", 1.0) * GiB)))


def run() -> int:
    from kvchat.engine.paths import data_dir

    from .theme import Theme

    app = QApplication.instance() or QApplication(sys.argv)
    app.setApplicationName("kvchat")
    app.setStyle("Fusion")
    try:
        store = Store(data_dir() / "chat.db")
    except StoreError as e:
        QMessageBox.critical(None, "kvchat", str(e))
        return 1
    theme = Theme(store.setting("theme") or "system")
    from .engine_bridge import EngineBridge
    from .main_window import MainWindow

    engine = make_engine(store.setting("engine") or {})
    window = MainWindow(store, EngineBridge(engine, make_engine), theme=theme)
    window.show()
    code = app.exec()
    window.bridge.engine.close()
    return code
