"""Start the desktop app: the database, the engine on its thread, the window."""
import sys

from PySide6.QtWidgets import QApplication, QMessageBox

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.memory import GiB
from kvchat.engine.paths import data_dir

from .engine_bridge import EngineBridge
from .main_window import MainWindow
from .store import Store, StoreError


def make_engine(settings: dict) -> Engine:
    """An engine for the settings panel's values; it loads the model on its own thread."""
    return Engine(EngineConfig(model=settings.get("model", "starter"), kv_precision=settings.get("kv_precision", "auto"),
                               max_context=settings.get("max_context", 8192),
                               weights=settings.get("weights", "auto"),
                               headroom_bytes=int(settings.get("headroom_gib", 1.0) * GiB)))


def run() -> int:
    app = QApplication.instance() or QApplication(sys.argv)
    app.setApplicationName("kvchat")
    try:
        store = Store(data_dir() / "chat.db")
    except StoreError as e:
        QMessageBox.critical(None, "kvchat", str(e))
        return 1
    engine = make_engine(store.setting("engine") or {})
    window = MainWindow(store, EngineBridge(engine, make_engine))
    window.show()
    code = app.exec()
    window.bridge.engine.close()
    return code
