"""Long pasted text as an attachment: a chip in the message instead of a wall of text. The model
reads it inside the message, between tags that name it; the chat view and the composer read the
tags back into chips. A message is stored as that one text, so an edit, a resend and the prompt the
engine renders all carry the document without a column of their own."""
import math
import re

LONG_PASTE = 2000  # characters: a paste longer than this becomes an attachment
CHARS_PER_TOKEN = 4  # the estimate's ratio (English prose in a Llama/Qwen tokenizer: 3.5-4.5)
TAG = re.compile(r'\n*<attachment name="([^"\n]*)">\n(.*?)\n</attachment>', re.S)


def estimate_tokens(text: str) -> int:
    """The app cannot tokenize (the tokenizer lives in the engine): an estimate from the length."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def name_for(text: str) -> str:
    """Its first line, shortened: what a reader recognises a pasted document by."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "Pasted text")
    first = first.replace('"', "'")
    return first if len(first) <= 40 else first[:39].rstrip() + "…"


def encode(typed: str, attachments: list[tuple[str, str]]) -> str:
    """The message as the model and the store hold it: the typed text, then each document."""
    parts = [typed] if typed else []
    parts += [f'<attachment name="{name}">\n{text}\n</attachment>' for name, text in attachments]
    return "\n\n".join(parts)


def decode(content: str) -> tuple[str, list[tuple[str, str]]]:
    """The typed text and the (name, text) of each attachment."""
    found = [(m.group(1), m.group(2)) for m in TAG.finditer(content)]
    return TAG.sub("", content).strip("\n"), found


def chip(name: str, text: str, counted: tuple[int | None, str] | None = None) -> dict:
    """What a chip shows: its name, its size, and its text to expand. ``counted``: the model's own
    count of its tokens, or why it does not fit the context (``EngineBridge.tokens_counted``)."""
    tokens, problem = counted or (None, "")
    if problem:
        return {"name": name, "text": text, "size": f"too long · {len(text):,} characters",
                "problem": problem,
                "tip": f"Longer than the context: {problem}. The model cannot read it whole: shorten it, or "
                       "raise the context length in Settings."}
    if tokens is not None:
        return {"name": name, "text": text, "size": f"{tokens:,} tokens · {len(text):,} characters", "problem": "",
                "tip": f"{tokens:,} tokens, as the model's tokenizer counts it. Click to show or hide the text."}
    tokens = estimate_tokens(text)
    return {"name": name, "text": text, "size": f"≈{tokens:,} tokens · {len(text):,} characters", "problem": "",
            "tip": f"About {tokens:,} tokens, estimated from its {len(text):,} characters (the model's "
                   "tokenizer counts it exactly when it is sent). Click to show or hide the text."}
