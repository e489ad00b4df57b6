"""The window on a real engine over the starter model: the paths the fake backend stands in for
everywhere else, each walked once end to end (a reply streamed into the view and saved in SQLite,
a stop, a settings change reaching the engine; a model switch is test_model_library's hub load, the
persona cache test_badge's)."""
from PySide6.QtCore import Qt

from kvchat.app.store import Store
from kvchat.app.views.main_window import MainWindow
from kvchat.core.config import SamplingParams

from qt_helpers import click_chat, hover, last_stats, qml_click, qml_items, send, shown


def test_send_streams_the_reply_and_saves_it(qtbot, engine_parts):
    win, store, bridge, _ = engine_parts
    tokens = []
    bridge.token.connect(lambda key, text, tid: tokens.append(text))
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


def test_two_chats_answer_at_once_and_stop_and_regenerate_act_on_their_own_chat(qtbot, engine_parts):
    """A message in a second chat starts while the first chat's reply streams (the engine batches
    them); Stop and Regenerate in the second leave the first streaming to its own end."""
    win, store, bridge, _ = engine_parts
    # sampled: a greedy story from the starter repeats itself, and the loop guard would end it early
    win.sampling = SamplingParams(max_new_tokens=160, temperature=1.0, seed=7, ignore_eos=True)
    keys = []
    bridge.token.connect(lambda key, text, tid: keys.append(key))
    win.input.setPlainText("Write a very long story.")
    qtbot.keyClick(win.input, Qt.Key_Return)
    qtbot.waitUntil(lambda: bool(keys), timeout=60000)
    first, first_key = win.conversation_id, keys[0]
    qtbot.mouseClick(win.new_button, Qt.LeftButton)
    assert win.send_button.isVisible() and not win.stop_button.isVisible()  # this chat has no reply running
    assert win.running_button.isVisible() and win.running_button.text() == "1 reply running"
    win.input.setPlainText("Tell me about the sea.")
    qtbot.keyClick(win.input, Qt.Key_Return)
    second = win.conversation_id
    qtbot.waitUntil(lambda: len(set(keys)) == 2, timeout=60000)
    second_key = next(k for k in keys if k != first_key)
    qtbot.waitUntil(lambda: keys.count(second_key) >= 3 and keys[-1] == first_key, timeout=60000)  # both stream
    assert second != first and win.running_button.text() == "2 replies running"

    qtbot.mouseClick(win.running_button, Qt.LeftButton)  # the next chat with a reply running: the first
    assert win.conversation_id == first and win.stop_button.isVisible()
    assert win.conversation_list.currentItem().text() == "Write a very long story."
    click_chat(qtbot, win, "Tell me about the sea.")
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)  # stops this chat's reply only
    qtbot.waitUntil(lambda: win.replies.of(second) is None, timeout=30000)
    assert win.replies.of(first) is not None and win.running_button.text() == "1 reply running"
    stopped = store.messages(second)[-1]
    assert stopped.interrupted and win.send_button.isVisible()

    regenerate = qml_items(win, "regenerate")[0]  # in this chat, while the first still streams
    hover(qtbot, win, regenerate)
    qml_click(qtbot, win, regenerate)
    assert win.replies.of(second) is not None and win.replies.of(first) is not None
    # the regenerated reply streams beside the first (a batch's order of rows puts either token last)
    qtbot.waitUntil(lambda: any(keys.count(k) >= 2 for k in set(keys) - {first_key, second_key}), timeout=60000)
    # opening the chat asked the persona badge's question: held until no reply ran, it made the
    # regenerated reply wait for the first's end (measured: 390 of its 400 tokens)
    assert keys.count(first_key) < 160 and win.replies.of(first) is not None
    qtbot.keyClick(win.input, Qt.Key_Escape)
    qtbot.waitUntil(lambda: win.replies.of(second) is None, timeout=30000)
    assert store.messages(second)[-1].id == stopped.id and store.messages(second)[-1].versions == 2

    qtbot.waitUntil(lambda: not bridge.busy, timeout=120000)  # the first runs to its own end
    reply = store.messages(first)[-1]
    assert not reply.interrupted and len(reply.token_ids) == 160  # max_new_tokens: nothing cut it short
    assert not win.running_button.isVisible()


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
    assert bridge.engine.session.precision.value == "int4" and bridge.engine.config.max_context == 4096
    assert bridge.engine.loaded.model is model and win.sampling.temperature == 0.0
    assert bridge.engine.config.headroom_bytes == 1 << 29
    assert store.setting("engine")["kv_precision"] == "int4" and store.setting("sampling")["temperature"] == 0.0
    send(qtbot, win, "Hi again")
    assert last_stats(win)[-1].endswith("KV int4")  # the engine's own stats say the new precision


CODE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i}" for i in range(6))


def test_speculation_shows_in_the_stats_and_the_settings_checkbox_turns_it_off(qtbot, engine_parts):
    """A reply that repeats the chat's code keeps proposed tokens (once the batch a check runs in is
    compiled), and its stats say how many; the box, clicked off, reaches the next reply (no
    reload) and the saved settings."""
    from kvchat.bench.engine import at_full_speed

    win, store, bridge, _ = engine_parts
    at_full_speed(bridge.engine, batch=8)  # a check runs in a compiled batch: compiled once, in an idle moment
    win.sampling = SamplingParams(max_new_tokens=48, temperature=0)
    send(qtbot, win, f"Copy this code exactly, then stop.\n\n```python\n{CODE}\n```")
    first = store.messages(win.conversation_id)[-1]
    assert first.stats["accepted_prediction_tokens"] > 0
    assert "proposed tokens kept" in last_stats(win)[-1] and "tok/s effective" in last_stats(win)[-1]
    dialog = win.models.settings_dialog()
    qtbot.addWidget(dialog)
    dialog.show()
    qtbot.waitExposed(dialog)
    dialog.max_new.setValue(48)
    dialog.temperature.setValue(0.0)
    assert dialog.speculate.isChecked()  # on by default
    qtbot.mouseClick(dialog.speculate, Qt.LeftButton)
    assert not dialog.speculate.isChecked()
    win.models.apply_settings(dialog)
    assert store.setting("sampling")["speculate"] is False and not win.sampling.speculate
    send(qtbot, win, f"Copy this code exactly, then stop.\n\n```python\n{CODE}\n```")
    second = store.messages(win.conversation_id)[-1]
    assert second.stats["accepted_prediction_tokens"] == second.stats["rejected_prediction_tokens"] == 0
    assert "proposed" not in last_stats(win)[-1]


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
