"""Messages -> token ids, one message at a time, so that appending never changes earlier tokens.

Each message's tokens are the tokenization of the text that the chat template adds for it: the
difference between the rendering of the conversation up to it and up to the one before. An
assistant message that carries ``token_ids`` (what the engine generated) keeps them verbatim:
only the template's text around its content is tokenized.
"""
from dataclasses import dataclass

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


class ChatError(ValueError):
    pass


@dataclass
class Encoded:
    token_ids: list[int]
    message_starts: list[int]  # token offset where each message begins
    prompt_start: int  # where the generation prompt begins


class ChatFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.template = getattr(tokenizer, "chat_template", None) or FALLBACK_TEMPLATE
        self.uses_fallback = not getattr(tokenizer, "chat_template", None)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if not messages and not add_generation_prompt:
            return ""
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        return self.tokenizer.apply_chat_template(plain, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def encode(self, messages: list[dict], add_generation_prompt: bool = True) -> Encoded:
        validate(messages, need_user=add_generation_prompt)
        ids: list[int] = []
        starts = []
        before = ""
        for i, message in enumerate(messages):
            starts.append(len(ids))
            after = self.render(messages[:i + 1])
            ids += self._message_tokens(messages[:i], message, before, after)
            before = after
        prompt_start = len(ids)
        if add_generation_prompt:
            ids += self.tokenize(_delta(before, self.render(messages, add_generation_prompt=True)))
        return Encoded(ids, starts, prompt_start)

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
        return self.tokenize(_delta(before, after))


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
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ChatError(f"message {i} needs a role ({', '.join(ROLES)}) and a string content")
    if not need_user:
        return
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise ChatError("the conversation has no non-empty user message")
    if messages[-1]["role"] == "user" and not messages[-1]["content"].strip():
        raise ChatError("the last message is empty")
