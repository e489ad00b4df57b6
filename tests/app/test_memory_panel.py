"""The memory panel speaks of the chat too (issue 29): this conversation's tokens against the
context, and what the prefix cache saved today (prompt tokens not computed), from the replies' stats."""
from PySide6.QtCore import Qt

from qt_helpers import click_chat, shown


def send(qtbot, win, bridge, text):
    qtbot.keyClicks(win.input, text)
    qtbot.mouseClick(win.send_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: win.send_button.isEnabled() and not bridge.busy, timeout=30000)


def test_the_panel_shows_the_chats_tokens_and_the_prefix_caches_savings(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    qtbot.mouseClick(win.memory_button, Qt.LeftButton)
    panel = win.memory_panel
    assert "no reply yet" in panel.chat.text() and "<b>0</b> tokens" in panel.saved.text()
    send(qtbot, win, bridge, "What is the capital of France?")
    first = [m for m in store.messages(win.conversation_id) if m.role == "assistant"][-1].stats
    tokens = first["prompt_tokens"] + first["generated_tokens"]
    assert f"{tokens:,} of 512 tokens" in panel.chat.text()
    assert panel.chat_bar.isVisible() and (panel.chat_bar.value(), panel.chat_bar.maximum()) == (tokens, 512)
    send(qtbot, win, bridge, "And of Italy?")  # the first turn is served from the prefix cache
    second = [m for m in store.messages(win.conversation_id) if m.role == "assistant"][-1].stats
    saved = first["cached_tokens"] + second["cached_tokens"]
    assert second["cached_tokens"] > 0 and f"<b>{saved:,}</b> tokens reused" in panel.saved.text()
    assert f"{second['prompt_tokens'] + second['generated_tokens']:,} of 512 tokens" in panel.chat.text()
    qtbot.mouseClick(win.new_button, Qt.LeftButton)  # another chat: its own tokens, the day's savings
    assert "no reply yet" in panel.chat.text() and f"<b>{saved:,}</b>" in panel.saved.text()
    click_chat(qtbot, win, "What is the capital of France?")
    assert f"{second['prompt_tokens'] + second['generated_tokens']:,} of 512 tokens" in panel.chat.text()


def test_kvchat_itself_is_a_row_and_the_rows_add_up_to_the_machine(qtbot, app_parts):
    """Python, Qt and torch in a row of their own (the fake's RUNTIME), not in "free"."""
    from kvchat.core.memory import GiB

    from support.fake_model import MACHINE_RAM, RUNTIME

    win, _, _, _ = app_parts
    shown(qtbot, win)
    qtbot.mouseClick(win.memory_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: win.gauge.updates >= 1, timeout=15000)
    panel, snap = win.memory_panel, win.gauge.snapshot
    assert panel.keys["kvchat itself"].isVisible() and "Python, Qt and torch" in panel.keys["kvchat itself"].toolTip()
    assert panel.values["kvchat itself"].text() == f"{RUNTIME / GiB:.2f} GiB"  # 600 MiB: 0.59 GiB
    rows = ("other_processes", "runtime", "weights", "kv_total", "activations_reserve", "free")
    assert snap["runtime"] == RUNTIME and sum(snap[k] for k in rows) == MACHINE_RAM


def test_opening_the_panel_in_a_1000_px_window_keeps_its_width_and_the_top_bar_whole(qtbot, app_parts):
    """The trial's window grew to 1,095 px when the panel opened (the chat column's share went under
    the top bar's minimum), and at 1,000 px the bar's chips were clipped."""
    win, *_ = app_parts
    win.resize(1000, 700)
    qtbot.waitUntil(lambda: win.width() == 1000)
    win.memory_button.click()
    qtbot.waitUntil(lambda: win.memory_panel.isVisible() and win.splitter.sizes()[2] > 0)
    qtbot.wait(100)  # a growth would come with the layout's next pass
    assert win.width() == 1000
    side, centre, panel = win.splitter.sizes()
    assert panel == win.memory_panel.width() and centre >= win.top_bar.minimumSizeHint().width()
    row = win.top_bar.layout()
    shown = [row.itemAt(i).widget() for i in range(row.count())
             if row.itemAt(i).widget() is not None and row.itemAt(i).widget().isVisible()]
    spans = sorted((w.geometry().left(), w.geometry().right()) for w in shown)
    assert spans[-1][1] < win.top_bar.width()  # nothing past the bar's edge
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:]))  # nor over its neighbour
    win.memory_button.click()
    qtbot.waitUntil(lambda: not win.memory_panel.isVisible())
    assert win.width() == 1000
