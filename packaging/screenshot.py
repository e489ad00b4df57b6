"""Take the README's screenshot: the real window, a short chat on the starter model.
Run under a display, e.g. ``xvfb-run -s "-screen 0 1280x800x24" .venv/bin/python packaging/screenshot.py``."""
import sys
import tempfile
from pathlib import Path

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from kvchat.app.engine_bridge import EngineBridge
from kvchat.app.main_window import MainWindow
from kvchat.app.store import Store
from kvchat.engine.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine


def main(out: str) -> int:
    app = QApplication(sys.argv)
    store = Store(Path(tempfile.mkdtemp()) / "chat.db")
    engine = Engine(EngineConfig(max_context=2048, kv_precision="auto"))
    window = MainWindow(store, EngineBridge(engine), SamplingParams(max_new_tokens=120, temperature=0))
    window.show()
    steps = iter(["Give me a Python function that reverses a string, with a short explanation.",
                  "Now make it handle None."])

    def next_step():
        text = next(steps, None)
        if text is None:
            window.grab().save(out)
            app.quit()
            return
        window.input.setPlainText(text)
        window.send()

    window.bridge.finished.connect(lambda _: QTimer.singleShot(1500, next_step))
    window.bridge.ready.connect(lambda: QTimer.singleShot(500, next_step))
    app.exec()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/screenshot.png"))
