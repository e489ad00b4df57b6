"""Messages -> token ids, one message at a time, so that appending never changes earlier tokens.

Each message's tokens are the tokenization of the text that the chat template adds for it: the
difference between the rendering of the conversation up to it and up to the one before. An
assistant message that carries ``token_ids`` (what the engine generated) keeps them verbatim:
only the template's text around its content is tokenized. A message whose text holds one of the
tokenizer's control tokens (``<|im_start|>`` pasted into a message) has it tokenized as text: as
the real token it could close its turn and open a system turn of its own.
"""
import re
from collections import OrderedDict
from dataclasses import dataclass

from kvchat.core.config import MAX_MESSAGES

# Used when a model ships no chat template: ChatML, which most instruction-tuned small models
# have seen, with plain role names.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant")
_SENTINEL = "\x00kvchat-content\x00"
SEGMENT_CACHE = 4096  # messages whose text and tokens are remembered (a long chat has a few hundred)
# and at most this many bytes of them: entries are as large as the messages, and a client of the API
# sending distinct 7.8 MiB messages added 87 MB each while the cap was a count alone
SEGMENT_CACHE_BYTES = 64 << 20


class ChatError(ValueError):
    pass


class Stopped(Exception):
    """The request was cancelled while its messages were being encoded."""


@dataclass
class Encoded:
    token_ids: list[int]
    message_starts: list[int]  # token offset where each message begins
    prompt_start: int  # where the generation prompt begins


class ChatFormatter:
    """Each message's text is what the template adds for it after the message before: one render
    of two messages, cached, so a turn of a long chat costs one new render plus one full render to
    check the pieces add up. A template for which they do not (one that rewrites history, or
    numbers its messages) is rendered prefix by prefix instead, as a whole conversation must be."""

    def __init__(self, tokenizer, cache_entries: int = SEGMENT_CACHE, cache_bytes: int = SEGMENT_CACHE_BYTES):
        self.tokenizer = tokenizer
        self.template = getattr(tokenizer, "chat_template", None) or FALLBACK_TEMPLATE
        self.uses_fallback = not getattr(tokenizer, "chat_template", None)
        self.folds_system = not self._takes_system()
        self.cache_entries, self.cache_bytes = cache_entries, cache_bytes
        self._segments: OrderedDict[tuple, tuple[str, list[int]]] = OrderedDict()
        self._sizes: dict[tuple, int] = {}
        self.cached_bytes = 0
        # the texts the tokenizer makes one token of wherever they occur, longest first
        added = sorted((t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                        if getattr(t, "content", "")), key=len, reverse=True)
        self._control = re.compile("|".join(map(re.escape, added))) if added else None
        # No token spans more characters than the longest one in the vocabulary (special tokens
        # included), so a text of more than ``limit * longest_token`` characters is more than
        # ``limit`` tokens: it can be refused without being tokenized.
        try:
            self.longest_token = max(map(len, tokenizer.get_vocab())) or 1
        except (AttributeError, TypeError, ValueError, NotImplementedError):
            self.longest_token = 1 << 20  # unknown: no refusal on characters alone

    def max_chars(self, limit: int) -> int:
        """Characters past which a text is surely more than ``limit`` tokens."""
        return limit * self.longest_token

    def prompt_ids(self, text: str, limit: int) -> list[int]:
        """A plain prompt's tokens (special tokens added, as a completion's prompt has them); one of
        ``limit`` tokens or more is refused, on its characters first when they suffice."""
        if len(text) > self.max_chars(limit):
            raise ChatError(f"the prompt is {len(text):,} characters, longer than the context of {limit:,} tokens")
        ids = self.tokenizer(text)["input_ids"]
        if len(ids) >= limit:
            raise ChatError(f"the prompt is {len(ids):,} tokens, longer than the context of {limit:,} tokens")
        return ids

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if not messages and not add_generation_prompt:
            return ""
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        return self.tokenizer.apply_chat_template(plain, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _takes_system(self) -> bool:
        """Whether the template renders a system message; Gemma 2's raises "System role not
        supported", and Gemma 3's puts it at the head of the first user turn."""
        try:
            self.render([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}], True)
        except Exception:  # the template's raise_exception, whatever its type
            return False
        return True

    def _folded(self, messages: list[dict]) -> list[dict]:
        """For a template with no system role, the system message at the head of the first user
        turn, as Gemma 3's own template puts it."""
        if not self.folds_system or messages[0]["role"] != "system":
            return messages
        system, rest = messages[0]["content"], messages[1:]
        if not rest or rest[0]["role"] != "user":
            return [{"role": "user", "content": system}] + rest
        return [{"role": "user", "content": f"{system}\n\n{rest[0]['content']}"}] + rest[1:]

    def persona_length(self, messages: list[dict], encoded: Encoded) -> int:
        """How many of ``encoded``'s first tokens every chat with this persona shares: the system
        message's, or where the template has no system role, what the first user turn holds before
        its own text. With no system message, the template's own preamble (SmolLM2's default system
        prompt), which every chat without a persona shares."""
        system = messages[:1] if messages[0]["role"] == "system" else []
        if system and len(messages) < 2:
            return 0
        if system and not self.folds_system:
            return encoded.message_starts[1]
        for filler in ("", "."):  # a template may refuse an empty turn; the filler is past the shared part
            try:
                alone = self.encode(system + [{"role": "user", "content": filler}], add_generation_prompt=False)
                break
            except Exception:
                continue
        else:  # nothing shared is found: deleting a chat would delete its persona's blocks too
            raise ChatError("this model's chat template refuses a one-character message")
        return next((i for i, (a, b) in enumerate(zip(alone.token_ids, encoded.token_ids)) if a != b),
                    len(alone.token_ids))

    def tokenize(self, text: str, plain: bool = False) -> list[int]:
        """``plain``: control tokens written in ``text`` are tokenized as the text they are."""
        if not text:
            return []
        kw = {"split_special_tokens": True} if plain else {}
        return self.tokenizer(text, add_special_tokens=False, **kw)["input_ids"]

    def encode(self, messages: list[dict], add_generation_prompt: bool = True, stop=None) -> Encoded:
        """``stop()``, asked before each message's render: True raises ``Stopped`` (a client that
        hung up does not hold the engine thread for the rest of its messages)."""
        validate(messages, need_user=add_generation_prompt)
        stop = stop or _never
        folded = self._folded(messages)
        # a system message merged into the first user turn starts where that turn starts: it has no
        # tokens of its own
        starts = [0] if len(folded) < len(messages) else []
        messages = folded
        pieces = (self._by_pairs(messages, add_generation_prompt, stop)
                  or self._by_prefixes(messages, add_generation_prompt, stop))
        ids: list[int] = []
        for tokens in pieces[:len(messages)]:
            starts.append(len(ids))
            ids += tokens
        prompt_start = len(ids)
        if add_generation_prompt:
            ids += pieces[-1]
        return Encoded(ids, starts, prompt_start)

    def _by_pairs(self, messages: list[dict], add_generation_prompt: bool, stop) -> list[list[int]] | None:
        """Per-message tokens from renders of (previous message, message); None when the template
        does not compose that way."""
        try:
            pieces = []
            for i, m in enumerate(messages):
                _check(stop)
                pieces.append(self._piece(messages[i - 1] if i else None, m))
            if add_generation_prompt:
                last = messages[-1:]
                pieces.append((_delta(self.render(last), self.render(last, True)), None))
            whole = self.render(messages, add_generation_prompt)
        except Stopped:
            raise
        except Exception:  # a template that insists on its own message order (raise_exception)
            return None
        if "".join(text for text, _ in pieces) != whole:
            return None
        return [tokens if tokens is not None else self.tokenize(text) for text, tokens in pieces]

    def _piece(self, previous: dict | None, message: dict) -> tuple[str, list[int]]:
        key = (_key(previous), _key(message))
        hit = self._segments.get(key)
        if hit is not None:
            self._segments.move_to_end(key)
            return hit
        history = [previous] if previous is not None else []
        before = self.render(history)
        after = self.render(history + [message])
        text = _delta(before, after)
        piece = (text, self._message_tokens(history, message, before, after))
        size = _size(key, piece)
        if size <= self.cache_bytes // 4:  # one huge message does not flush a chat's worth of small ones
            self._segments[key], self._sizes[key] = piece, size
            self.cached_bytes += size
            while len(self._segments) > self.cache_entries or self.cached_bytes > self.cache_bytes:
                old, _ = self._segments.popitem(last=False)
                self.cached_bytes -= self._sizes.pop(old)
        return piece

    def _by_prefixes(self, messages: list[dict], add_generation_prompt: bool, stop) -> list[list[int]]:
        pieces = []
        before = ""
        for i, message in enumerate(messages):
            _check(stop)
            after = self.render(messages[:i + 1])
            pieces.append(self._message_tokens(messages[:i], message, before, after))
            before = after
        if add_generation_prompt:
            pieces.append(self.tokenize(_delta(before, self.render(messages, add_generation_prompt=True))))
        return pieces

    def _message_tokens(self, history, message, before: str, after: str) -> list[int]:
        generated = message.get("token_ids")
        if message["role"] == "assistant" and generated:
            marked = _delta(before, self.render(history + [{"role": "assistant", "content": _SENTINEL}]))
            if marked.count(_SENTINEL) == 1:
                head, tail = marked.split(_SENTINEL)
                body = list(generated)
                tail_ids = self.tokenize(tail)
                # The reply was cut by the end-of-turn token the template also writes: keep one.
                while body and tail_ids and body[-1] == tail_ids[0]:
                    body.pop()
                return self.tokenize(head) + body + tail_ids
        text = _delta(before, after)
        content = message.get("content") or ""
        if self._control is None or not self._control.search(content):
            return self.tokenize(text)
        marked = _delta(before, self.render(history + [{**message, "content": _SENTINEL}]))
        if marked.count(_SENTINEL) == 1:
            head, tail = marked.split(_SENTINEL)
            for body in (content, content.strip()):  # a template may strip a message's text
                if head + body + tail == text:
                    return self.tokenize(head) + self.tokenize(body, plain=True) + self.tokenize(tail)
        raise ChatError("a message contains the model's control tokens, and this model's chat template "
                        "changes message text, so they cannot be kept as plain text")


def _never() -> bool:
    return False


def _check(stop) -> None:
    if stop():
        raise Stopped()


def _key(message: dict | None) -> tuple | None:
    if message is None:
        return None
    ids = message.get("token_ids")
    return message["role"], message["content"], tuple(ids) if ids else None


def _size(key: tuple, piece: tuple[str, list[int]]) -> int:
    """About what an entry holds: its strings (up to 4 bytes a character) and a list of ints (an
    8-byte slot and, past 256, a 28-byte int each)."""
    chars = len(piece[0]) + sum(len(m[1]) + 36 * len(m[2] or ()) for m in key if m is not None)
    return 2 * chars + 36 * len(piece[1]) + 256


def _delta(before: str, after: str) -> str:
    """The text a template added; templates that rewrite history (rare) fall back to the common
    prefix, which keeps the tokens right at the cost of a cache miss."""
    if after.startswith(before):
        return after[len(before):]
    n = 0
    while n < min(len(before), len(after)) and before[n] == after[n]:
        n += 1
    return after[n:]


def validate(messages: list[dict], need_user: bool = True) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise ChatError(f"{len(messages):,} messages: at most {MAX_MESSAGES:,} are taken")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ChatError(f"message {i} needs a role ({', '.join(ROLES)}) and a string content")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: bytes that were not UTF-8 (a shell argument)
            raise ChatError(f"message {i} is not valid UTF-8 text") from None
    if not need_user:
        return
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise ChatError("the conversation has no non-empty user message")
    if messages[-1]["role"] == "user" and not messages[-1]["content"].strip():
        raise ChatError("the last message is empty")
