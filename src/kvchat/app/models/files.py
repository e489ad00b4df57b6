"""A file attached to a message, read into text here: it then rides in the message as a paste does
(models/attachments.py). Text of any kind (prose, source code, Markdown, CSV, logs) as it is, from
UTF-8 or UTF-16; a PDF's text through pypdf; what holds no text (an image, an archive, a program,
a scanned PDF) is refused with one line that says why and what can be attached."""
import io
from pathlib import Path

from kvchat.core.errors import first_line

MAX_BYTES = 20 << 20  # a file larger than this is refused before it is read: far past any context
KINDS = "text, code, Markdown, CSV or PDF files"


class Unreadable(Exception):
    """Why a file cannot be attached, in one line for the notice line."""


def read_text(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise Unreadable(f"{path.name}: not a file (attach {KINDS})")
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise Unreadable(f"{path.name} is {size / 2**20:,.0f} MiB: attach files up to {MAX_BYTES >> 20} MiB")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Unreadable(f"{path.name}: {e.strerror or first_line(e)}") from None
    if data.startswith(b"%PDF-"):
        return _pdf_text(path.name, data)
    text = decoded(data)
    if text is None:
        raise Unreadable(f"{path.name} is not text (a binary file): attach {KINDS}")
    if not text.strip():
        raise Unreadable(f"{path.name} is empty")
    return text


def decoded(data: bytes) -> str | None:
    """The text of ``data``, or None where it is not text (a NUL, or control bytes past one in 20):
    UTF-16 by its byte-order mark, else UTF-8 (a Windows text file in its legacy code page as
    Latin-1 rather than refused, where it has next to no control bytes)."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError:
            return None
    head = data[:65536]
    controls = sum(b < 32 and b not in b"\t\n\r\f\x1b" for b in head)  # ESC: a coloured log's
    if b"\x00" in head or controls > len(head) // 20:
        return None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("latin-1") if controls <= len(head) // 1000 else None


def _pdf_text(name: str, data: bytes) -> str:
    from pypdf import PdfReader  # only when a PDF comes: its import costs a start nothing

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise Unreadable(f"{name} is a password-protected PDF: open it, save a copy without the password")
        text = "\n\n".join((page.extract_text() or "").strip() for page in reader.pages).strip()
    except Unreadable:
        raise
    except Exception as e:  # noqa: BLE001 - pypdf's errors for a damaged file are many kinds
        raise Unreadable(f"{name}: this PDF cannot be read ({first_line(e)})") from None
    if not text:
        raise Unreadable(f"{name} has no text to read (a scanned PDF holds pictures of pages)")
    return text
