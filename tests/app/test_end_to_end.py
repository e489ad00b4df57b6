"""The window on a real engine over the starter model: the paths the fake backend stands in for
everywhere else, each walked once end to end (a reply streamed into the view and saved in SQLite,
a stop, a settings change reaching the engine; a model switch is test_model_library's hub load, the
persona cache test_badge's)."""
from kvchat.app.store import Store
from kvchat.app.views.main_window import MainWindow
from kvchat.core.config import SamplingParams

from qt_helpers import last_stats, send, shown


def test_send_streams_the_reply_and_saves_it(qtbot, engine_parts):
    win, store, bridge, _ = engine_parts
    tokens = []
    bridge.token.connect(lambda text, tid: tokens.append(text))
    send(qtbot, win, "What is the capital of France?")
    user, reply = store.messages(win.conversation_id)
    assert user.content == "What is the capital of France?" and not reply.interrupted
    assert len(tokens) > 1 and reply.content == "".join(tokens)
    assert reply.token_ids and reply.stats["prompt_tokens"] > 0
    assert "Paris" in win.chat_view.toPlainText()
    stats = last_stats(win)
    assert len(stats) == 1 and "TTFT" in stats[0] and "cached" in stats[0]  # the reply's stats tooltip


def test_stop_keeps_the_partial_reply_marked_interrupted(qtbot, engine_parts):
    win, store, bridge, _ = engine_parts
    win.sampling = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    bridge.token.connect(lambda *a: win.stop_button.click())
    send(qtbot, win, "Write a very long story.")
    reply = store.messages(win.conversation_id)[-1]
    assert reply.interrupted and 0 < len(reply.token_ids) < 400


def test_settings_show_the_planner_live_and_apply_without_reload(qtbot, engine_parts):
    win, store, bridge, _ = engine_parts
    qtbot.waitUntil(lambda: win.gauge.updates >= 1, timeout=10000)
    dialog = win.models.settings_dialog()
    qtbot.addWidget(dialog)
    assert "Auto would pick: fp16" in dialog.estimate.text()
    dialog.context.setValue(1_000_000)  # 1M tokens x 23 KB at fp16 is more than this machine's RAM
    assert "Auto would pick: fp16" not in dialog.estimate.text()
    dialog.context.setValue(4096)
    dialog.precision.setCurrentText("int4")
    dialog.headroom.setValue(0.5)
    dialog.temperature.setValue(0.0)
    model = bridge.engine.loaded.model
    with qtbot.waitSignal(bridge.reconfigured, timeout=60000):
        win.models.apply_settings(dialog)
    assert bridge.engine.precision.value == "int4" and bridge.engine.config.max_context == 4096
    assert bridge.engine.loaded.model is model and win.sampling.temperature == 0.0
    assert bridge.engine.config.headroom_bytes == 1 << 29
    assert store.setting("engine")["kv_precision"] == "int4" and store.setting("sampling")["temperature"] == 0.0
    send(qtbot, win, "Hi again")
    assert last_stats(win)[-1].endswith("KV int4")  # the engine's own stats say the new precision


def test_the_model_chip_counts_the_parameters_as_the_library_does(qtbot, tmp_path):
    """int8 weights (the CPU's 'auto') give the tied head its own copy and untie the config, which
    then counted the embedding twice: the chip read 163M, the library 135M for the same starter."""
    from kvchat.app.controllers.engine_bridge import EngineBridge
    from kvchat.core.config import EngineConfig
    from kvchat.core.model_source import starter_path
    from kvchat.engine.engine import Engine

    engine = Engine(EngineConfig(max_context=512, weights="int8"), disk_tier=None)
    bridge = EngineBridge(engine, lambda settings: None)
    win = shown(qtbot, MainWindow(Store(tmp_path / "chat.db"), bridge, SamplingParams(max_new_tokens=4)))
    qtbot.addWidget(win)
    try:
        qtbot.waitUntil(lambda: "weights" in win.model_chip.full, timeout=120000)  # its words when wide
        assert engine.loaded.model.config.tie_word_embeddings is False  # the case that read 163M
        folder = tmp_path / "models"
        folder.mkdir()
        (folder / "smollm2.gguf").symlink_to(starter_path())
        library = win.models.library(roots=[(folder, "here")])
        qtbot.addWidget(library)
        library.show()
        qtbot.waitUntil(lambda: bool(library.items("modelCard")), timeout=30000)
        in_library = library.list_model.rows[0]["details"].split(" · ")[1]
        assert in_library == "135M parameters" and win.model_chip.full.split(" · ")[1] == "135M"
    finally:
        engine.close()
