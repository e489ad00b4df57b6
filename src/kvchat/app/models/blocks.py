"""A message as the chat view's blocks: Markdown prose and fenced code, each code block highlighted
once (a streaming reply re-highlights only its open block)."""
import re
from functools import lru_cache

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_by_name
from pygments.util import ClassNotFound

FENCE = re.compile(r"^[ \t]*```([\w+#.-]*)[^\n]*\n(.*?)(?:(?P<close>^[ \t]*```[ \t]*$)|\Z)", re.S | re.M)
# A small model often writes code without a fence; its "# comment" lines must not become page titles
BIG_HEADING = re.compile(r"^(#{1,2})(?=\s)", re.M)
FORMATTERS = {False: HtmlFormatter(noclasses=True, style="friendly", nowrap=True),
              True: HtmlFormatter(noclasses=True, style="monokai", nowrap=True)}


def split(content: str) -> list[dict]:
    """[{kind: text, text} | {kind: code, lang, code, open}] in order; an unclosed fence runs to the
    end (``open``: a streaming reply is still writing it)."""
    out, pos = [], 0
    for m in FENCE.finditer(content):
        if content[pos:m.start()].strip():
            out.append({"kind": "text", "text": tame(content[pos:m.start()])})
        code = m.group(2).rstrip("\n")
        out.append({"kind": "code", "lang": m.group(1).lower() or guess_language(code), "code": code,
                    "open": m.group("close") is None})
        pos = m.end()
    if content[pos:].strip():
        out.append({"kind": "text", "text": tame(content[pos:])})
    return out


def tame(markdown: str) -> str:
    return BIG_HEADING.sub("###", markdown)


# A fence without a language: the language guessed from telling marks, in order (pygments' own
# guess_lexer misfires on short snippets and costs a pass over every lexer)
GUESSES = [("python", r"^\s*(def |class \w+.*:|import \w|from \w+ import|print\(|if __name__)"),
           ("bash", r"^(#!/bin/(ba)?sh|\$ \w|sudo |apt(-get)? |pip install |cd |export \w+=)"),
           ("cpp", r"^#include\s*<|std::"), ("rust", r"^\s*(fn \w+\(|let mut |use std::)|println!"),
           ("go", r"^package \w+|^func \w+\("), ("java", r"^\s*public (static )?(class|void) "),
           ("javascript", r"^\s*(const|let|function) \w+|console\.log|=> \{"),
           ("sql", r"(?i)^\s*(select .+ from|insert into|create table)"), ("html", r"^\s*<(!doctype|html|div|p)\b"),
           ("json", r"^\s*[\[{]\s*\"\w+\"\s*:")]


def guess_language(code: str) -> str:
    """The language of an unfenced (untagged) code block, or "" when nothing tells."""
    return next((name for name, mark in GUESSES if re.search(mark, code, re.M)), "")


@lru_cache(maxsize=512)
def code_html(code: str, language: str, dark: bool) -> str:
    """Highlighted, inside a <pre>; without a language the text stays plain."""
    try:
        lexer = get_lexer_by_name(language) if language else TextLexer()
    except ClassNotFound:
        lexer = TextLexer()
    # pre-wrap: a long line wraps inside the block instead of running past its right edge
    return ('<pre style="margin-top:0; margin-bottom:0; white-space:pre-wrap">'
            + highlight(code, lexer, FORMATTERS[dark]).rstrip("\n") + "</pre>")


def blocks(content: str, dark: bool, streaming: bool = False) -> list[dict]:
    """What the QML delegate shows: code blocks carry their highlighted HTML and their text to copy.
    The block a streaming reply is still writing is plain until its fence closes: highlighted, it
    grew by a few characters a frame and its spans were parsed and laid out whole each time (the
    GUI thread's largest cost while code streams, 1.9-3 ms a frame against 0.2-0.4 for prose)."""
    out = split(content)
    for b in out:
        if b["kind"] == "code":
            b["html"] = code_html(b["code"], "" if streaming and b["open"] else b["lang"], dark)
    return out


def stats_line(s: dict) -> str:
    """One reply's figures: TTFT, speed, what the prefix cache served, the KV precision."""
    if s.get("cached_reported", True):
        cache = f"{s['cached_tokens']} cached / {s['prompt_tokens'] - s['cached_tokens']} computed prompt tokens"
        if s.get("ram_tokens") or s.get("disk_tokens"):  # restored from the tiers under the pool
            cache += f" ({s.get('ram_tokens', 0)} from RAM, {s.get('disk_tokens', 0)} from disk)"
    else:  # a server that gives no cached-token count: zero would be a guess
        cache = f"{s['prompt_tokens']} prompt tokens, cached: not reported"
    where = "on the server" if s["kv_precision"] == "server" else f"KV {s['kv_precision']}"
    speed = f"{s['decode_tok_s']:.1f} tok/s"
    kept, dropped = s.get("accepted_prediction_tokens", 0), s.get("rejected_prediction_tokens", 0)
    if kept + dropped:  # faster than a token a step by the proposed tokens kept: say so
        speed += f" effective ({kept} of {kept + dropped} proposed tokens kept)"
    line = f"TTFT {s['ttft_ms']:.0f} ms · {speed} · {cache} · {where}"
    if s.get("trimmed_messages"):
        line += f" · {s['trimmed_messages']} oldest messages outside the context"
    if s.get("finish_reason") == "loop":
        line += " · stopped: it was repeating itself"
    return line
