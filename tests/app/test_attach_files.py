"""Files attached to a message (issue 49, point 7): the paper clip's picker, a drop or a paste of
files; text of any kind and a PDF's text ride in the message as a paste does, and a file with no
text is refused in one line, the others still attached."""
from pathlib import Path

import pytest
from PySide6.QtCore import QMimeData, Qt, QUrl
from PySide6.QtWidgets import QFileDialog

from kvchat.app.models.files import MAX_BYTES, Unreadable, decoded, read_text

from qt_helpers import shown


def pdf_with(*pages: str) -> bytes:
    """A PDF whose pages each show one line of text in Helvetica (written by hand: the offsets of
    its cross-reference table are counted here)."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", None, "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for text in pages:
        stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode() if text else b""
        objects.append(f"<< /Length {len(stream)} >>\nstream\n{stream.decode()}\nendstream")
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {len(objects)} 0 R "
                       "/Resources << /Font << /F1 3 0 R >> >> >>")
        kids.append(f"{len(objects)} 0 R")
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(kids)} >>"
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n{body}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{o:010d} 00000 n \n" for o in offsets).encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def test_text_of_any_encoding_and_a_pdfs_text_are_read(tmp_path):
    (tmp_path / "code.py").write_text("def f(x):\n    return x  # é\n", encoding="utf-8")
    (tmp_path / "notes.txt").write_text("Größe: 3 m²\n", encoding="utf-16")
    (tmp_path / "legacy.csv").write_bytes("name;città\nAnna;Genève\n".encode("latin-1"))
    (tmp_path / "report.pdf").write_bytes(pdf_with("Quarterly report", "Second page"))
    assert read_text(tmp_path / "code.py") == "def f(x):\n    return x  # é\n"
    assert read_text(tmp_path / "notes.txt") == "Größe: 3 m²\n"
    assert read_text(tmp_path / "legacy.csv") == "name;città\nAnna;Genève\n"
    assert read_text(tmp_path / "report.pdf") == "Quarterly report\n\nSecond page"


@pytest.mark.parametrize("name, data, why", [
    ("photo.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)), "photo.png is not text (a binary file)"),
    ("scan.pdf", pdf_with(""), "scan.pdf has no text to read (a scanned PDF"),
    ("cut.pdf", b"%PDF-1.4\n1 0 obj << /Type", "cut.pdf: this PDF cannot be read"),
    ("empty.md", b"\n\n", "empty.md is empty"),
])
def test_a_file_with_no_text_is_refused_in_one_line(tmp_path, name, data, why):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(Unreadable) as refused:
        read_text(tmp_path / name)
    assert str(refused.value).startswith(why) and "\n" not in str(refused.value)


def test_a_file_too_large_or_missing_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "dump.log"
    with big.open("wb") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: nothing written
    with pytest.raises(Unreadable, match="dump.log is 20 MiB: attach files up to 20 MiB"):
        read_text(big)
    with pytest.raises(Unreadable, match="gone.txt: not a file"):
        read_text(tmp_path / "gone.txt")
    assert decoded(b"plain\x01\x02\x03\x04 bytes" * 10) is None  # control bytes: not legacy text


def test_the_paper_clip_and_a_drop_attach_files_and_the_message_carries_them(qtbot, app_parts, tmp_path, monkeypatch):
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    (tmp_path / "todo.md").write_text("# Todo\n- ship the attach button\n")
    (tmp_path / "report.pdf").write_bytes(pdf_with("Revenue rose by a third"))
    (tmp_path / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    picked = [str(tmp_path / "todo.md"), str(tmp_path / "photo.png")]
    monkeypatch.setattr(QFileDialog, "getOpenFileNames", staticmethod(lambda *a, **k: (picked, "")))
    assert not win.attach_button.icon().isNull()
    qtbot.mouseClick(win.attach_button, Qt.LeftButton)
    assert [name for name, _ in win.input.attachments] == ["todo.md"]
    assert win.notice_label.text().startswith("photo.png is not text (a binary file)")  # the other still came
    drop = QMimeData()
    drop.setUrls([QUrl.fromLocalFile(str(tmp_path / "report.pdf"))])
    assert win.input.canInsertFromMimeData(drop)
    win.input.insertFromMimeData(drop)  # what a drop (or a file manager's copy, pasted) hands the box
    assert [name for name, _ in win.input.attachments] == ["todo.md", "report.pdf"]
    assert [c.label.text().split(" · ")[0] for c in win.input.chips()] == ["todo.md", "report.pdf"]
    qtbot.keyClicks(win.input, "Summarise both")
    qtbot.keyClick(win.input, Qt.Key_Return)
    qtbot.waitUntil(lambda: win.send_button.isEnabled() and not bridge.busy, timeout=30000)
    sent = [m for m in store.messages(win.conversation_id) if m.role == "user"][0].content
    assert sent.startswith("Summarise both") and "- ship the attach button" in sent and "Revenue rose by a third" in sent
    assert '<attachment name="report.pdf">' in sent and not win.input.attachments
