"""Defaults from the model (issue 10, deliverable 6): sampling from generation_config.json or the
fallbacks, a reply stopped when it loops, the settings estimate capped at the trained context."""
from types import SimpleNamespace

from PySide6.QtCore import Qt
from transformers import GenerationConfig

from kvchat.app.controllers.engine_bridge import EngineBridge
from kvchat.app.controllers.loop_guard import LoopGuard
from kvchat.app.views.main_window import MainWindow
from kvchat.app.models.sampling_defaults import model_defaults
from kvchat.app.store import Store
from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.engine.host import generation_settings

from qt_helpers import last_stats
from support.fake_backend import FakeBackend
from support.fake_model import STARTER_GENERATION


def own(generation_config) -> dict:
    """What the engine's ModelReady carries for a model with this generation config."""
    return generation_settings(SimpleNamespace(generation_config=generation_config))


def test_sampling_defaults_come_from_the_models_generation_config():
    assert model_defaults(own(GenerationConfig(temperature=0.3, top_p=0.8, repetition_penalty=1.2))) | {} == {
        "temperature": 0.3, "top_p": 0.8, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.2,
        "max_new_tokens": 1024, "seed": None}
    assert model_defaults(own(GenerationConfig(do_sample=False)))["temperature"] == 0.0
    # transformers' own defaults (top_k 50, temperature 1.0) are not the model's: the fallbacks apply
    fallback = model_defaults(own(GenerationConfig()))
    assert (fallback["temperature"], fallback["top_p"], fallback["top_k"], fallback["repetition_penalty"],
            fallback["max_new_tokens"]) == (0.7, 0.9, 0, 1.1, 1024)


def test_a_new_window_uses_the_starters_defaults_until_the_user_changes_them(qtbot, tmp_path):
    engine = FakeBackend(EngineConfig(max_context=512))
    store = Store(tmp_path / "chat.db")
    win = MainWindow(store, EngineBridge(engine))
    qtbot.addWidget(win)
    try:
        qtbot.waitUntil(lambda: win.models.config is not None, timeout=60000)
        qtbot.waitUntil(lambda: win.gauge.updates >= 1, timeout=15000)  # the planner needs the memory
        expected = model_defaults(STARTER_GENERATION)
        assert vars(win.sampling) | {"stop": [], "ignore_eos": False} == vars(SamplingParams(**expected))
        dialog = win.models.settings_dialog()
        qtbot.addWidget(dialog)
        assert dialog.max_new.value() == 1024 and dialog.repetition.value() == expected["repetition_penalty"]
        # the starter was trained on 8,192 tokens: no precision is offered more, and more warns
        assert "capped at the trained 8,192" in dialog.estimate.text() and "917" not in dialog.estimate.text()
        assert dialog.warning.isHidden()
        dialog.context.setValue(16384)
        assert not dialog.warning.isHidden() and "8,192 this model was trained on" in dialog.warning.text()
        dialog.temperature.setValue(0.2)
        win.models.apply_settings(dialog)
        assert store.setting("sampling")["temperature"] == 0.2
    finally:
        engine.close()
    again = MainWindow(store, EngineBridge(FakeBackend(EngineConfig(max_context=512))))
    qtbot.addWidget(again)
    try:
        qtbot.waitUntil(lambda: again.models.config is not None, timeout=60000)
        assert again.sampling.temperature == 0.2  # the user's choice outlives the model's defaults
    finally:
        again.bridge.engine.close()


def test_the_loop_guard_fires_on_a_verbatim_repeat_of_its_window():
    guard = LoopGuard(window=64)
    assert not any(guard.add(i) for i in range(500))  # no repeat: never
    guard = LoopGuard(window=64)
    fired = [n for n, token in enumerate([1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 20) if guard.add(token)]
    assert fired[0] == 64 + 10 - 1  # the first 64-token tail seen before, one period later


def test_a_looping_reply_stops_with_a_notice_and_is_kept_whole(qtbot, app_parts):
    win, store, _, _ = app_parts
    win.sampling = SamplingParams(max_new_tokens=400, temperature=0, repetition_penalty=1.0, ignore_eos=True)
    win.input.setPlainText("Say 'la' over and over: la la la la la la la la la la la la")
    qtbot.keyClick(win.input, Qt.Key_Return)
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=120000)
    reply = store.messages(win.conversation_id)[-1]
    assert 64 < len(reply.token_ids) < 400 and not reply.interrupted
    assert reply.stats["finish_reason"] == "loop"
    assert any("repeating" in line for line in win.notices)
    assert "repeating itself" in last_stats(win)[-1]


def test_the_settings_estimate_assumes_the_weights_auto_chose_for_the_loaded_model(qtbot):
    """On the CPU Auto measures which weights decode fastest (int4 on an AVX2 machine, say): the
    estimate counts those weights' bytes, not int8's, while the weights setting stays auto; another
    setting picked in the dialog counts its own."""
    from transformers import LlamaConfig

    from kvchat.app.views.settings_dialog import SettingsDialog
    from kvchat.core.memory import GiB, plan

    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=1 << 20)
    config.kvchat_weights = "int4"
    memory = 6 * GiB
    figure = lambda weights: f"fp16 {plan(config, memory, 8192, weights, GiB).max_context['fp16']:,}"
    assert figure("int4") != figure("int8")  # the weights' bytes move the fp16 context
    dialog = SettingsDialog(None, {"weights": "auto", "max_context": 8192, "headroom_gib": 1.0}, {}, config, memory)
    qtbot.addWidget(dialog)
    assert figure("int4") in dialog.estimate.text()
    dialog.weights.setCurrentText("int8")
    assert figure("int8") in dialog.estimate.text()
    loaded_as_int8 = SettingsDialog(None, {"weights": "int8", "max_context": 8192, "headroom_gib": 1.0}, {}, config,
                                    memory)
    qtbot.addWidget(loaded_as_int8)
    loaded_as_int8.weights.setCurrentText("auto")  # auto's own pick for this model is not known yet
    assert figure("int8") in loaded_as_int8.estimate.text()
