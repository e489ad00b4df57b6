"""Start the desktop app: the database, the engine on its thread, the window."""
import sys

from PySide6.QtWidgets import QApplication, QMessageBox

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.paths import data_dir

from .engine_bridge import EngineBridge
from .main_window import MainWindow
from .store import Store, StoreError


def run() -> int:
    app = QApplication(sys.argv)
    app.setApplicationName("kvchat")
    try:
        store = Store(data_dir() / "chat.db")
    except StoreError as e:
        QMessageBox.critical(None, "kvchat", str(e))
        return 1
    settings = store.setting("engine") or {}
    engine = Engine(EngineConfig(model=settings.get("model", "starter"),
                                 kv_precision=settings.get("kv_precision", "auto"),
                                 max_context=settings.get("max_context", 8192)))
    window = MainWindow(store, EngineBridge(engine))
    window.show()
    code = app.exec()
    engine.close()
    return code
