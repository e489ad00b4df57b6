"""Long input as an attachment (issue 29): a paste over about 2,000 characters becomes a chip in the
composer and in the sent message (name, estimated tokens, expandable), not a wall of text; the model
still reads it. Its prefill shows tokens done of total with an estimate, and Stop stops it between
two chunks. On the fake backend (tests/support), whose prefill goes in chunks of 64 word tokens."""
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from kvchat.app.models.attachments import chip as chip_text

from qt_helpers import qml_click, qml_items, settled, shown

WORDS = ("kvcache", "paging", "prefix", "rotation", "quantize", "governor", "snapshot", "blocks")


def document(words: int = 240) -> str:
    """A pasted page: a title line, then prose (about 10 characters a word)."""
    body = " ".join(f"{WORDS[i % len(WORDS)]}{i}" for i in range(words))
    return "Quarterly report on the cache\n" + body


def paste(qtbot, win, text):
    QApplication.clipboard().setText(text)
    win.input.setFocus()
    qtbot.keyClick(win.input, Qt.Key_V, Qt.ControlModifier)


def test_a_long_paste_becomes_a_chip_in_the_composer_and_the_message(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    doc = document()
    assert len(doc) > 2000
    qtbot.keyClicks(win.input, "Summarise this:")
    paste(qtbot, win, doc)
    assert win.input.typed() == "Summarise this:"  # the page is not in the box's text
    # an estimate at once, then the model's own count as its tokenizer gives it (the fake's: words)
    assert chip_text("Quarterly report on the cache", doc)["size"] == f"≈{-(-len(doc) // 4):,} tokens · {len(doc):,} characters"
    counted = len(bridge.engine.tokenize(doc).result(10))
    qtbot.waitUntil(lambda: "estimated" not in win.input.chips()[0].label.toolTip(), timeout=10000)
    [chip] = win.input.chips()
    assert not chip.icon.pixmap().isNull()
    assert chip.label.text() == f"Quarterly report on the cache · {counted:,} tokens · {len(doc):,} characters"
    assert "as the model's tokenizer counts it" in chip.label.toolTip() and not chip.property("tooLong")
    qtbot.mouseClick(chip.remove_button, Qt.LeftButton)
    assert not win.input.chips() and not win.input.attachments
    paste(qtbot, win, doc)
    paste(qtbot, win, "short text")  # a short paste stays text
    assert win.input.typed() == "Summarise this:short text" and len(win.input.chips()) == 1
    qtbot.mouseClick(win.send_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: win.send_button.isEnabled() and not bridge.busy, timeout=30000)
    assert not win.input.chips() and win.input.typed() == ""
    sent = [m for m in store.messages(win.conversation_id) if m.role == "user"][0].content
    assert sent.startswith("Summarise this:short text") and doc in sent  # the model reads the page
    assert "kvcache0 paging1" not in win.chat_view.toPlainText()  # the bubble shows the typed text only
    [chip_item] = qml_items(win, "attachmentChip")
    assert chip_item.property("label") == "Quarterly report on the cache"
    assert not qml_items(win, "attachmentText")
    qml_click(qtbot, win, chip_item)
    [body] = qml_items(win, "attachmentText")
    assert body.property("plain") == doc
    qml_click(qtbot, win, chip_item)
    assert not qml_items(win, "attachmentText")


def test_an_edited_message_brings_its_attachment_back_as_a_chip(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    doc = document()
    paste(qtbot, win, doc)
    qtbot.mouseClick(win.send_button, Qt.LeftButton)  # a document alone, no typed text
    qtbot.waitUntil(lambda: win.send_button.isEnabled() and not bridge.busy, timeout=30000)
    [message] = [m for m in store.messages(win.conversation_id) if m.role == "user"]
    win.replies.begin_edit(message.position)
    assert win.input.typed() == "" and [name for name, _ in win.input.attachments] == ["Quarterly report on the cache"]


def test_a_long_prompt_shows_its_prefill_and_stop_stops_it(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    fake = bridge.engine
    fake.pace.hold_prefill(1)  # one chunk, then it waits: the prompt is being read
    paste(qtbot, win, document())
    qtbot.mouseClick(win.send_button, Qt.LeftButton)

    def note():
        notes = [i.property("text") for i in qml_items(win, "note")]
        return notes[-1] if notes else ""

    qtbot.waitUntil(lambda: note().startswith("Reading your message: 64 of "), timeout=30000)
    total = int(note().split(" of ")[1].split()[0].replace(",", ""))
    assert total > 200 and ("left" in note() or "estimating" in note())
    assert win.stop_button.isVisible()
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=30000)
    settled(bridge)
    assert fake.prefilled == 64  # the engine stopped between two chunks: the rest was never computed
    assert not note().startswith("Reading")
    fake.pace.hold_prefill(None)


def test_a_paste_longer_than_the_context_warns_on_its_chip_and_is_not_sent(qtbot, engine_parts):
    """The real engine's tokenizer, at a context of 512 tokens: a page of about a thousand tokens is
    counted too long before it is sent; Send says why and keeps the message in the box."""
    win, store, bridge, _ = engine_parts
    shown(qtbot, win)
    doc = document(400)
    qtbot.keyClicks(win.input, "Summarise this:")
    paste(qtbot, win, doc)
    qtbot.waitUntil(lambda: win.input.chips()[0].property("tooLong"), timeout=30000)
    [chip] = win.input.chips()
    assert chip.label.text() == f"Quarterly report on the cache · too long · {len(doc):,} characters"
    assert "longer than the context of 512" in chip.label.toolTip()
    qtbot.mouseClick(win.send_button, Qt.LeftButton)
    assert win.notice_label.text().startswith("Not sent: an attachment is longer than the context.")
    assert win.input.typed() == "Summarise this:" and win.input.attachments and not bridge.busy
    assert win.conversation_id is None or not store.messages(win.conversation_id)
