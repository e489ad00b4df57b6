"""Start the desktop app: the database, the window, then the engine.

The window shows first, about a second after launch: nothing before ``show()`` imports torch or
transformers. The engine (those imports, then the model) is made on a worker thread once the
window's first frame is on screen (controllers/engine_starter.py); the window says "loading model" until
it is ready. No splash: a splash shown first took the window activation under X without a window
manager, and keys typed into the new window went nowhere."""
import os
import sys
import time

from PySide6.QtCore import QEvent, QObject, QTimer
from PySide6.QtWidgets import QApplication, QMessageBox

from kvchat.app.controllers.engine_starter import EngineStarter
from kvchat.app.store import Store, StoreError

TRACE = "KVCHAT_STARTUP_TRACE"  # set: say on stderr when the first frame was exposed (tools/window_time.py)
START_AT_THE_LATEST_MS = 1000  # no expose event (a window that starts hidden): start the engine anyway


class FirstFrame(QObject):
    """Calls ``then`` once the window's first frame is exposed: the engine's imports hold the GIL
    for seconds, and started earlier they would slow the window's first paint."""

    def __init__(self, window, then):
        super().__init__(window)
        self.then, self.done = then, False
        window.windowHandle().installEventFilter(self)
        QTimer.singleShot(START_AT_THE_LATEST_MS, self.fire)

    def eventFilter(self, obj, event) -> bool:
        if event.type() == QEvent.Expose and obj.isExposed() and not self.done:
            QTimer.singleShot(0, self.fire)  # after this expose has painted the frame
        return False

    def fire(self) -> None:
        if not self.done:
            self.done = True
            if os.environ.get(TRACE):
                print(f"kvchat: first frame {process_age():.2f} s after the process started", file=sys.stderr,
                      flush=True)
            self.then()


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), else since Python started."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter()


def run(local_engine) -> int:
    """``local_engine(config)`` makes the local engine; it runs on the starter's worker thread."""
    from kvchat.core.paths import data_dir

    from kvchat.app.views.theme import Theme

    app = QApplication.instance() or QApplication(sys.argv)
    app.setApplicationName("kvchat")
    app.setStyle("Fusion")
    try:
        store = Store(data_dir() / "chat.db")
    except StoreError as e:
        QMessageBox.critical(None, "kvchat", str(e))
        return 1
    theme = Theme(store.setting("theme") or "system")
    from kvchat.app.controllers.engine_bridge import EngineBridge, settings_config
    from kvchat.app.views.main_window import MainWindow

    def make_engine(settings: dict) -> EngineStarter:
        """An engine for the settings panel's values, made on its own thread; it loads the model there."""
        return EngineStarter(settings_config(settings), local_engine).start()

    engine = EngineStarter(settings_config(store.setting("engine") or {}), local_engine)
    window = MainWindow(store, EngineBridge(engine, make_engine), theme=theme)
    window.show()
    FirstFrame(window, engine.start)
    code = app.exec()
    window.replies.save_so_far()
    window.bridge.engine.close()
    return code
