"""A conversation as HTML for the chat view: Qt's own Markdown for text, Pygments for code, and
a copy link under each code block."""
import html
import re
from dataclasses import dataclass

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_by_name, guess_lexer
from pygments.util import ClassNotFound
from PySide6.QtGui import QTextDocument

FENCE = re.compile(r"```([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)  # an unclosed fence is still streaming
FORMATTER = HtmlFormatter(noclasses=True, style="friendly", nowrap=False)


def markdown_html(text: str) -> str:
    doc = QTextDocument()
    doc.setMarkdown(text)
    body = doc.toHtml()
    return body[body.find(">", body.find("<body")) + 1:body.rfind("</body>")]


def code_html(code: str, language: str) -> str:
    try:
        lexer = get_lexer_by_name(language) if language else guess_lexer(code)
    except ClassNotFound:
        lexer = TextLexer()
    return highlight(code, lexer, FORMATTER)


def message_html(content: str, code_blocks: list[str]) -> str:
    """Appends each code block's text to ``code_blocks``; the copy link names its index."""
    out, pos = [], 0
    for m in FENCE.finditer(content):
        if content[pos:m.start()].strip():
            out.append(markdown_html(content[pos:m.start()]))
        code_blocks.append(m.group(2).rstrip("\n"))
        out.append(code_html(code_blocks[-1], m.group(1)))
        out.append(f'<p align="right"><a href="copy:{len(code_blocks) - 1}">copy</a></p>')
        pos = m.end()
    if content[pos:].strip():
        out.append(markdown_html(content[pos:]))
    return "".join(out)


def stats_line(s: dict) -> str:
    """One reply's figures: TTFT, speed, what the prefix cache served, the KV precision."""
    line = (f"TTFT {s['ttft_ms']:.0f} ms · {s['decode_tok_s']:.1f} tok/s · {s['cached_tokens']} cached / "
            f"{s['prompt_tokens'] - s['cached_tokens']} computed prompt tokens · KV {s['kv_precision']}")
    if s.get("trimmed_messages"):
        line += f" · {s['trimmed_messages']} oldest messages outside the context"
    return line


@dataclass
class Turn:
    role: str
    content: str
    position: int
    interrupted: bool = False
    stats: dict | None = None


def conversation_html(turns: list[Turn]) -> tuple[str, list[str]]:
    """The page and its code blocks, in order. A user turn links ``edit:POSITION``; a finished
    reply shows its stats under it."""
    blocks: list[str] = []
    parts = []
    for t in turns:
        who = "You" if t.role == "user" else "Assistant"
        mark = " <i>(interrupted)</i>" if t.interrupted else ""
        edit = f' &nbsp;<a href="edit:{t.position}">edit</a>' if t.role == "user" else ""
        stats = (f'<p><span style="color:#777; font-size:small">{html.escape(stats_line(t.stats))}</span></p>'
                 if t.stats else "")
        parts.append(f"<p><b>{html.escape(who)}</b>{mark}{edit}</p>{message_html(t.content, blocks)}{stats}")
    return "<hr/>".join(parts), blocks
