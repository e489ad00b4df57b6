"""Launching the app: the window shows before the engine is made (torch imports on a worker
thread), and what goes wrong at launch (a damaged database, a saved model that is gone, an engine
that cannot be made) is said, not a window loading for ever. The real launcher where no model loads;
the fake backend (tests/support) where one does."""
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QLabel

from kvchat.app.controllers.replies import WAITING_NOTE
from kvchat.app.store import Store
from kvchat.app.views.main_window import MainWindow
from kvchat.app.views.sheet import Sheet
from kvchat.cli.launcher import local_engine
from kvchat.core.config import SamplingParams

from qt_helpers import qml_items, shown


def test_a_corrupt_database_at_start_is_reported_and_kept(qtbot, tmp_path, monkeypatch):
    from kvchat.app import main

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.db").write_bytes(b"this is not a database " * 200)
    shown = []
    monkeypatch.setattr(main.QMessageBox, "critical", lambda parent, title, text: shown.append(text))
    assert main.run(local_engine) == 1
    assert len(shown) == 1 and "damaged" in shown[0]
    backups = [p for p in (tmp_path / "data").iterdir() if p.name != "chat.db"]
    assert backups and backups[0].read_bytes() == b"this is not a database " * 200


def test_a_saved_model_that_fails_at_launch_is_reported_not_loading_for_ever(qtbot, tmp_path, monkeypatch):
    from kvchat.app import main

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    Store(tmp_path / "data" / "chat.db").set_setting("engine", {"model": str(tmp_path / "moved-away.gguf")})
    seen = {}

    def event_loop(app):  # main.run's app.exec(): look at the window as the user would, then quit
        win = next(w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible())
        qtbot.waitUntil(lambda: "could not be loaded" in win.notice_label.text(), timeout=10000)
        seen.update(label=win.precision_label.text(), bar=win.load_bar.isVisible(),
                    boxes=[label.text() for sheet in win.findChildren(Sheet) if sheet.isVisible()
                           for label in sheet.findChildren(QLabel, "sheetText")])
        win.close()
        return 0

    monkeypatch.setattr(QApplication, "exec", event_loop)
    assert main.run(local_engine) == 0
    assert "loading" not in seen["label"] and not seen["bar"]
    assert any("no such model file" in text and "Settings" in text for text in seen["boxes"])


def test_the_app_imports_no_torch_before_its_window_shows():
    """The window's modules leave torch and transformers to the engine's worker thread: imported
    with them, the window waited 4 s for any frame."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import kvchat.cli.launcher, kvchat.app.main, kvchat.app.views.main_window, kvchat.app.controllers.engine_bridge\n"
            "print(sorted(m for m in ('torch', 'transformers', 'kvchat.engine.engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_window_works_before_the_engine_exists_and_takes_it_over(qtbot, tmp_path):
    """The engine is made on a worker thread after the window shows: until then the window says it
    is loading, a message waits for the model, and a context change is kept for the engine."""
    import threading

    from kvchat.app.controllers.engine_bridge import EngineBridge
    from kvchat.app.controllers.engine_starter import EngineStarter
    from kvchat.core.config import EngineConfig

    from support.fake_backend import FakeBackend

    imported = threading.Event()  # stands for the seconds torch and transformers take to import
    made = []

    def make(config):
        assert imported.wait(60)
        made.append(FakeBackend(config))
        return made[0]

    starter = EngineStarter(EngineConfig(max_context=512), make)
    bridge = EngineBridge(starter)
    store = Store(tmp_path / "chat.db")
    win = MainWindow(store, bridge, SamplingParams(max_new_tokens=8, temperature=0))
    qtbot.addWidget(win)
    shown(qtbot, win)
    starter.start()
    try:
        assert win.load_bar.isVisible() and win.model_chip.text() == "loading…"
        win.input.setPlainText("Hello")
        qtbot.keyClick(win.input, Qt.Key_Return)
        assert [i.property("text") for i in qml_items(win, "note")] == [WAITING_NOTE]
        changed = starter.reconfigure(max_context=384)  # kept until the engine exists
        assert not changed.done() and not made
        imported.set()
        qtbot.waitUntil(lambda: len(store.messages(win.conversation_id)) == 2 and win.send_button.isEnabled(),
                        timeout=60000)
        assert store.messages(win.conversation_id)[-1].content and not win.load_bar.isVisible()
        assert changed.result(30)["max_context"] == 384 and starter.config.max_context == 384
        assert starter.model is made[0].model and not qml_items(win, "note")
    finally:
        imported.set()
        starter.close()


def test_an_engine_that_cannot_be_made_is_reported_like_a_failed_load(qtbot, tmp_path):
    from kvchat.app.controllers.engine_bridge import EngineBridge
    from kvchat.app.controllers.engine_starter import EngineStarter
    from kvchat.core.config import EngineConfig

    def broken(config):
        raise ImportError("libtorch_cpu.so: cannot open shared object file")

    starter = EngineStarter(EngineConfig(), broken)
    win = MainWindow(Store(tmp_path / "chat.db"), EngineBridge(starter))
    qtbot.addWidget(win)
    with qtbot.waitSignal(win.bridge.load_failed, timeout=10000) as failed:
        starter.start()
    assert "engine could not start" in failed.args[0] and "libtorch_cpu" in failed.args[0]
    qtbot.waitUntil(lambda: "no model" in win.model_chip.text(), timeout=5000)
    assert not win.load_bar.isVisible()


def test_launch_shows_the_window_before_making_the_engine(qtbot, tmp_path, monkeypatch):
    from kvchat.app import main
    from kvchat.app.controllers.engine_starter import EngineStarter
    from kvchat.app.controllers.replies import ReplyController

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    order = []
    monkeypatch.setattr(EngineStarter, "start", lambda self: order.append(
        any(w.isVisible() for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow))) or self)

    def event_loop(app):
        qtbot.waitUntil(lambda: bool(order), timeout=5000)
        for w in QApplication.topLevelWidgets():
            w.close()
        return 0

    monkeypatch.setattr(QApplication, "exec", event_loop)
    monkeypatch.setattr(ReplyController, "save_so_far", lambda self: order.append("saved"))
    assert main.run(local_engine) == 0
    assert order == [True, "saved"]  # one engine, made once the window was on screen; the reply saved at quit
