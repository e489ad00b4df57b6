"""A setting that applies without reloading (context, memory saving, headroom), changed while a
reply streams: the engine rebuilds its pool only once no reply runs, and the window says so until
it has."""
from kvchat.app.controllers.model_choice import PENDING

from qt_helpers import held_reply


def test_a_live_setting_changed_mid_reply_says_it_applies_after_the_reply(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    pace = held_reply(qtbot, win, bridge)
    assert bridge.busy
    dialog = win.models.settings_dialog()
    qtbot.addWidget(dialog)
    dialog.context.setValue(1024)
    dialog.precision.setCurrentText("int8")
    with qtbot.assertNotEmitted(bridge.reconfigured, wait=300):  # held behind the reply
        win.models.apply_settings(dialog)
    assert win.notice_label.text() == PENDING + "context length, memory saving"
    with qtbot.waitSignal(bridge.reconfigured, timeout=60000):
        pace.free()  # the reply ends; the engine applies the settings
    assert not win.notice_label.text().startswith(PENDING)
    assert bridge.settings["max_context"] == 1024
    # with no reply running, it applies at once and nothing is said of waiting
    dialog = win.models.settings_dialog()
    qtbot.addWidget(dialog)
    dialog.context.setValue(2048)
    with qtbot.waitSignal(bridge.reconfigured, timeout=60000):
        win.models.apply_settings(dialog)
    assert not win.notice_label.text().startswith(PENDING)
