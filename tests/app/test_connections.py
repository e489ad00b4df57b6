"""The app on a connection: ``kvchat serve`` as a separate process with an API key is the server; the
connection is added, used, chatted on, stopped and regenerated through the window's own widgets.
Keys go to an in-memory keyring, never the machine's."""
import json

import httpx
import keyring
import pytest
from keyring.backends.fail import Keyring as NoKeyring
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialogButtonBox

from kvchat.app.views.connection_box import LOCAL, MANAGE
from kvchat.app.views.sheet import Question, TextAsk
from kvchat.core.config import SamplingParams
from kvchat.core.connections import Connection, Connections, get_key
from kvchat.remote.metrics import parse

from fake_keyring import MemoryKeyring
from qt_helpers import answering, hover, last_stats, qml_click, qml_items, send, shown, yes
from serve_process import kvchat_serve

KEY = "app-remote-key"
PERSONA = "You are Ada, a patient tutor of mathematics who answers in one short sentence. " * 30


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with kvchat_serve(tmp_path_factory.mktemp("serve"), KEY) as url:
        yield url


@pytest.fixture
def ring(monkeypatch, tmp_path):
    """A fake keyring, and connections saved under this test's own home."""
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    before, fake = keyring.get_keyring(), MemoryKeyring()
    keyring.set_keyring(fake)
    yield fake
    keyring.set_keyring(before)


def choose(qtbot, box, text):
    """Pick an entry of a combo box as a user does: open its list, click the entry."""
    box.showPopup()
    view = box.view()
    qtbot.waitUntil(view.isVisible, timeout=5000)
    rect = view.visualRect(box.model().index(box.findText(text), 0))
    qtbot.mouseClick(view.viewport(), Qt.LeftButton, pos=rect.center())


def add_connection(qtbot, win, url, key=KEY, name="lab"):
    """Manage connections, Add, type the fields, ask the server for its models, pick one, Save."""
    choose(qtbot, win.connection_box, MANAGE)
    dialog = win.connection_box.dialog
    qtbot.waitUntil(dialog.isVisible, timeout=5000)
    qtbot.mouseClick(dialog.add_button, Qt.LeftButton)
    editor = dialog.editor
    qtbot.waitUntil(editor.isVisible, timeout=5000)
    qtbot.keyClicks(editor.name, name)
    qtbot.keyClicks(editor.url, url)
    qtbot.keyClicks(editor.key, key)
    qtbot.mouseClick(editor.fetch, Qt.LeftButton)
    qtbot.waitUntil(lambda: editor.model.count() > 1 or "answered" in editor.status.text(), timeout=30000)
    return dialog, editor


def use(qtbot, win, dialog, name="lab"):
    item = next(dialog.list.item(i) for i in range(dialog.list.count()) if dialog.list.item(i).data(Qt.UserRole) == name)
    qtbot.mouseClick(dialog.list.viewport(), Qt.LeftButton, pos=dialog.list.visualItemRect(item).center())
    qtbot.mouseClick(dialog.use_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: win.bridge.server is not None and not win.bridge.switching, timeout=30000)


def cancelled_on(server):
    return parse(httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text)[
        "kvchat:requests_cancelled_total"]


def test_a_connection_added_in_the_app_chats_stops_regenerates_and_edits(qtbot, ring, server, app_parts):
    win, store, bridge, _ = app_parts
    dialog, editor = add_connection(qtbot, win, server)
    served = editor.model.itemText(1)
    assert served == "SmolLM2-135M-Instruct" and "1 model" in editor.status.text()
    editor.model.setCurrentIndex(1)
    qtbot.mouseClick(editor.buttons.button(QDialogButtonBox.Save), Qt.LeftButton)
    assert not editor.isVisible() and Connections().get("lab") == Connection("lab", server, served)
    assert get_key("lab") == KEY and KEY not in (Connections().path.read_text() + json.dumps(store.setting("connection")))
    use(qtbot, win, dialog)
    assert win.connection_box.currentText() == "lab" and store.setting("connection") == "lab"
    assert served in win.model_chip.toolTip() and not win.context_chip.isVisible()
    host = server.split("//")[1]
    assert win.chat_view.item("whereNote").property("text") == f"Replies come from {host}: what you type is sent there."

    # a reply streams from the server, with its stats; no token id is kept for it
    tokens = []
    bridge.token.connect(lambda key, text, tid: tokens.append((text, tid)))
    send(qtbot, win, "What is the capital of France?")
    user, reply = store.messages(win.conversation_id)
    assert not reply.interrupted and reply.content == "".join(t for t, _ in tokens) and "Paris" in reply.content
    assert {tid for _, tid in tokens} == {-1} and reply.token_ids is None
    assert reply.stats["cached_reported"] and reply.stats["prompt_tokens"] > 0
    assert "on the server" in last_stats(win)[0] and "not reported" not in last_stats(win)[0]

    # regenerate through the reply's own action: the same greedy reply, its prompt from the server's cache
    shown(qtbot, win)
    regenerate = qml_items(win, "regenerate")[0]
    hover(qtbot, win, regenerate)
    qml_click(qtbot, win, regenerate)
    qtbot.waitUntil(lambda: win.send_button.isEnabled() and not win.replies.live, timeout=60000)
    again = store.messages(win.conversation_id)
    assert len(again) == 2 and again[1].content == reply.content
    assert again[1].stats["cached_tokens"] >= reply.stats["prompt_tokens"] - 16  # all but the last block
    assert f"{again[1].stats['cached_tokens']} cached" in last_stats(win)[0]

    # stop: the stream closes, the server cancels, the partial reply is kept marked interrupted
    before = cancelled_on(server)
    win.sampling = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    stop = lambda *_: win.stop_button.click()  # noqa: E731
    bridge.token.connect(stop)
    send(qtbot, win, "Write a very long story.")
    bridge.token.disconnect(stop)
    stopped = store.messages(win.conversation_id)[-1]
    assert stopped.interrupted and stopped.content and stopped.token_ids is None
    qtbot.waitUntil(lambda: cancelled_on(server) == before + 1, timeout=30000)

    # edit the first message and resend: what followed it is replaced
    win.sampling = SamplingParams(max_new_tokens=12, temperature=0)
    qml_click(qtbot, win, qml_items(win, "editMessage")[0])
    assert win.send_button.text() == "Resend"
    send(qtbot, win, "What is the capital of Italy?")
    messages = store.messages(win.conversation_id)
    assert [m.role for m in messages] == ["user", "assistant"] and "Rome" in messages[1].content


def test_personas_hit_the_servers_cache_and_the_memory_panel_shows_the_servers_figures(qtbot, ring, server,
                                                                                       app_parts):
    win, store, bridge, _ = app_parts
    Connections().save(Connection("lab", server), api_key=KEY)
    win.connection_box.fill()
    choose(qtbot, win.connection_box, "lab")
    qtbot.waitUntil(lambda: bridge.server is not None and not bridge.switching, timeout=30000)
    ada = store.add_persona("Ada", PERSONA)
    win.personas.reload(select=ada)
    replies = []
    for question in ("What is 2 + 2?", "What is a prime number?"):
        qtbot.mouseClick(win.new_button, Qt.LeftButton)
        send(qtbot, win, question)
        replies.append(store.messages(win.conversation_id)[-1])
    qtbot.waitUntil(lambda: win.persona_badge.text() == "cached by the server", timeout=5000)
    cold, warm = (r.stats for r in replies)
    assert cold["prompt_tokens"] > 300 and warm["cached_tokens"] >= cold["prompt_tokens"] - 32  # the persona's blocks

    qtbot.mouseClick(win.memory_button, Qt.LeftButton)
    panel = win.memory_panel.server
    qtbot.waitUntil(lambda: "hit rate" in panel.text(), timeout=10000)
    assert panel.isVisible() and not win.memory_panel.local.isVisible()
    assert "server's KV-cache usage" in panel.text() and "(kvchat)" in panel.text() and server in panel.text()
    assert "%" in panel.text().split("hit rate")[1]

    # back on this computer: the local engine answers, and its replies keep their token ids again
    win.resize(1600, 900)  # beside the open memory panel, room in the top bar for every chip
    choose(qtbot, win.connection_box, LOCAL)
    qtbot.waitUntil(lambda: bridge.server is None and not bridge.switching and bridge.engine.ready.is_set(),
                    timeout=60000)
    assert store.setting("connection") is None and win.context_chip.isVisible()
    assert "nothing you type leaves it" in win.chat_view.item("whereNote").property("text")
    win.persona_box.setCurrentIndex(0)  # a short persona: Ada's is longer than the local test engine's context
    qtbot.mouseClick(win.new_button, Qt.LeftButton)
    send(qtbot, win, "What is 3 + 3?")
    local = store.messages(win.conversation_id)[-1]
    assert local.content and local.token_ids and local.stats["kv_precision"] != "server"
    qtbot.waitUntil(lambda: win.memory_panel.local.isVisible(), timeout=10000)


def test_the_editor_says_why_it_cannot_save(qtbot, ring, server, app_parts):
    win, _, _, _ = app_parts
    dialog, editor = add_connection(qtbot, win, server, key="wrong-key")
    assert "401" in editor.status.text() and editor.model.count() == 1  # the wrong key, in one line
    editor.name.clear()
    qtbot.mouseClick(editor.buttons.button(QDialogButtonBox.Save), Qt.LeftButton)
    assert editor.isVisible() and "needs a name" in editor.status.text() and Connections().all() == []
    qtbot.keyClicks(editor.name, "lab")
    keyring.set_keyring(NoKeyring())  # a machine with no keyring: the key is kept for this session only
    qtbot.mouseClick(editor.buttons.button(QDialogButtonBox.Save), Qt.LeftButton)
    status = editor.status
    assert editor.isVisible() and "kept for this session only" in status.text()
    assert status.height() >= status.heightForWidth(status.width())  # every line shown, none clipped
    assert [c.name for c in Connections().all()] == ["lab"] and get_key("lab") == "wrong-key"
    assert dialog.list.count() == 1
    qtbot.mouseClick(editor.buttons.button(QDialogButtonBox.Cancel), Qt.LeftButton)  # now "Close"
    assert not editor.isVisible()
    with answering(Question, yes) as asked:
        qtbot.mouseClick(dialog.remove_button, Qt.LeftButton)
    assert "lab" in asked[0] and Connections().all() == [] and dialog.list.count() == 0


def test_a_server_without_cached_counts_says_not_reported(qtbot, app_parts):
    win, store, _, _ = app_parts
    chat = store.create_conversation("old")
    store.add_message(chat, "user", "Hi")
    store.add_message(chat, "assistant", "Hello!", token_ids=[-1, -1], stats={
        "prompt_tokens": 30, "cached_tokens": 0, "generated_tokens": 2, "ttft_ms": 80.0, "decode_tok_s": 20.0,
        "kv_precision": "server", "cached_reported": False})
    assert store.messages(chat)[1].token_ids is None  # -1 ids never reach the store
    win.chats.refresh()
    win.chats.open(chat)
    shown(qtbot, win)
    assert last_stats(win) == ["TTFT 80 ms · 20.0 tok/s · 30 prompt tokens, cached: not reported · on the server"]


def test_the_app_reopens_on_the_connection_it_was_using(qtbot, ring, server, tmp_path):
    """As after a restart: the saved choice is used, and the local engine that was to start is closed
    before it loads anything."""
    from kvchat.app.controllers.engine_bridge import EngineBridge
    from kvchat.app.controllers.engine_starter import EngineStarter
    from kvchat.app.views.main_window import MainWindow
    from kvchat.app.store import Store
    from kvchat.core.config import EngineConfig

    Connections().save(Connection("lab", server), api_key=KEY)
    store = Store(tmp_path / "chat.db")
    store.set_setting("connection", "lab")
    made = []
    local = EngineStarter(EngineConfig(), made.append)
    win = MainWindow(store, EngineBridge(local))
    qtbot.addWidget(win)
    qtbot.waitUntil(lambda: win.bridge.server == server + "/v1" and not win.bridge.switching, timeout=30000)
    assert win.connection_box.currentText() == "lab" and not local.alive
    local.start()  # main.run starts it after the first frame: closed by then, it makes nothing
    assert local.close() and made == []  # close() waits for a maker thread, had one started
    win.sampling = SamplingParams(max_new_tokens=4, temperature=0)
    send(qtbot, win, "Hi!")
    assert store.messages(win.conversation_id)[-1].stats["kv_precision"] == "server"
    win.bridge.engine.close()


def test_a_keyed_server_after_a_restart_asks_for_the_key_and_keeps_it(qtbot, ring, server, tmp_path):
    """A key kept for one session only (no keyring then) is gone after a restart: the server answers
    401, and the app asks for the key (hidden as typed) instead of failing for good; with it the
    connection opens and the key is in the keyring for the next start."""
    from PySide6.QtWidgets import QLineEdit

    from kvchat.app.controllers.engine_bridge import EngineBridge
    from kvchat.app.controllers.engine_starter import EngineStarter
    from kvchat.app.views.main_window import MainWindow
    from kvchat.app.store import Store
    from kvchat.core.config import EngineConfig

    Connections().save(Connection("lab", server))  # its key was this session's only: not saved
    store = Store(tmp_path / "chat.db")
    store.set_setting("connection", "lab")
    asked = []

    def type_key(sheet):
        asked.append((sheet.field.echoMode(), sheet.subtitle.text()))
        sheet.field.setText(KEY)
        sheet.action.click()
        return True

    with answering(TextAsk, type_key):
        win = MainWindow(store, EngineBridge(EngineStarter(EngineConfig(), lambda _: None)))
        qtbot.addWidget(win)
        qtbot.waitUntil(lambda: win.bridge.server == server + "/v1" and not win.bridge.switching, timeout=30000)
    assert asked and asked[0][0] == QLineEdit.Password and "lab" in asked[0][1]
    assert get_key("lab") == KEY and win.connection_box.currentText() == "lab"
    win.sampling = SamplingParams(max_new_tokens=4, temperature=0)
    send(qtbot, win, "Hi!")
    assert store.messages(win.conversation_id)[-1].stats["kv_precision"] == "server"
    win.bridge.engine.close()


def test_choosing_the_same_connection_again_retries_it(qtbot, ring, app_parts):
    win, _, bridge, _ = app_parts
    Connections().save(Connection("down", "http://127.0.0.1:9"))  # nothing listens there
    win.connection_box.fill()
    with qtbot.waitSignal(bridge.load_failed, timeout=30000):
        choose(qtbot, win.connection_box, "down")
    assert win.connection_box.currentText() == "down"
    with qtbot.waitSignal(bridge.load_failed, timeout=30000):  # asked again, not ignored
        choose(qtbot, win.connection_box, "down")
