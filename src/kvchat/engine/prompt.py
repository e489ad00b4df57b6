"""A request's prompt as token ids: its messages rendered by the chat template, fitted to the
context (the oldest messages left out, a message alone past it refused), and the context limit
itself; the API's plain prompts tokenized on the engine thread."""
from kvchat.core.commands import Tokenize
from kvchat.core.config import MAX_MESSAGES
from kvchat.core.errors import first_line
from kvchat.core.events import EngineError, Request
from kvchat.engine.chat import ChatError, validate


class PromptBuilder:
    def __init__(self, notice):
        self.notice = notice  # a trim is told to the request's reply and to the listeners

    def tokenize(self, session, command: Tokenize) -> None:
        try:
            command.future.set_result(session.formatter.prompt_ids(command.text, session.context_limit()))
        except Exception as error:  # the future resolves whatever happens
            command.future.set_exception(error if isinstance(error, ChatError)
                                         else EngineError(f"internal error: {first_line(error)}"))

    def prompt_ids(self, session, request: Request, stop=None) -> tuple[list[int], int, int]:
        """The prompt's token ids, how many of them are the persona (the system message), and how
        many of the oldest messages were left out so that the rest fits the context. ``stop()``
        True (the request was cancelled) raises ``chat.Stopped`` between messages."""
        limit = session.context_limit()
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            vocab = session.loaded.model.config.vocab_size
            if not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ChatError(f"prompt_ids must be a non-empty list of token ids below {vocab}")
            if len(ids) >= limit:
                raise EngineError(f"the prompt is {len(ids)} tokens, longer than the context of {limit}")
            return ids, 0, 0
        # a chat longer than the API takes (the window's may grow so) keeps its newest messages
        messages = keep_newest(request.messages, MAX_MESSAGES)
        trimmed = len(request.messages) - len(messages)
        validate(messages)
        cap = session.formatter.max_chars(limit)
        # a message alone past the context: trimmed or refused, untokenized
        shorter = drop_long(messages, cap)
        if shorter is None:
            raise EngineError(f"a message is longer than the context of {limit} tokens ({cap:,} characters at most)")
        trimmed, messages = trimmed + len(messages) - len(shorter), shorter
        room = min(request.sampling.max_new_tokens, limit // 4)
        encoded = session.formatter.encode(messages, stop=stop)
        while len(encoded.token_ids) + room > limit:
            shorter = drop_to_fit(messages, encoded, limit - room)
            if shorter is None:
                raise EngineError(f"the prompt is {len(encoded.token_ids)} tokens, longer than the context of "
                                  f"{limit} (with room for a {room}-token reply)")
            trimmed += len(messages) - len(shorter)
            messages = shorter
            encoded = session.formatter.encode(messages, stop=stop)
        if trimmed:
            self.notice("trim", f"{trimmed} oldest message(s) are outside the context of {limit} tokens")
        persona_len = 0
        if messages[0]["role"] == "system":
            persona_len = encoded.message_starts[1] if len(messages) > 1 else encoded.prompt_start
        return encoded.token_ids, persona_len, trimmed


def _starts(messages: list[dict]) -> tuple[int, list[int]]:
    """Where the history may start once its oldest messages are dropped, oldest first: at each user
    turn after the first message of the history, and at the last message alone; the persona (a
    leading system message) always stays. With the number of persona messages (0 or 1)."""
    head = 1 if messages[0]["role"] == "system" else 0
    last = len(messages) - 1
    starts = [i for i in range(head + 1, last) if messages[i]["role"] == "user"]
    return head, starts + [last] if last > head else []


def keep_newest(messages, most: int):
    """At most ``most`` messages: the persona and the newest from a start (``_starts``). What is not
    a list of messages is left for ``validate`` to refuse."""
    if not isinstance(messages, list) or len(messages) <= most or not isinstance(messages[0], dict):
        return messages
    head = 1 if messages[0].get("role") == "system" else 0
    first = len(messages) - (most - head)
    begin = next((i for i in range(first, len(messages) - 1)
                  if isinstance(messages[i], dict) and messages[i].get("role") == "user"), len(messages) - 1)
    return messages[:head] + messages[begin:]


def drop_long(messages: list[dict], cap: int) -> list[dict] | None:
    """The conversation from its oldest start after the last message of more than ``cap``
    characters (the conversation itself when none is); None when that is the last message or the
    persona. One pass."""
    head, starts = _starts(messages)
    longest = [i for i, m in enumerate(messages) if len(m["content"]) > cap]
    if not longest:
        return messages
    if longest[0] < head or longest[-1] == len(messages) - 1:
        return None
    begin = next(i for i in starts if i > longest[-1])
    return messages[:head] + messages[begin:]


def drop_to_fit(messages: list[dict], encoded, budget: int) -> list[dict] | None:
    """The conversation from its oldest start at which its messages' token counts fit ``budget``
    tokens (at the last message alone when none does): one pass and one re-encoding, not one per
    dropped message. None when nothing is left to drop."""
    head, starts = _starts(messages)
    if not starts:
        return None
    ends = encoded.message_starts[1:] + [encoded.prompt_start]
    sizes = [end - start for start, end in zip(encoded.message_starts, ends)]
    kept = sum(sizes[:head]) + len(encoded.token_ids) - encoded.prompt_start  # the persona, the generation prompt
    tail = [0] * (len(sizes) + 1)  # tail[i]: the tokens of messages i and after
    for i in range(len(sizes) - 1, -1, -1):
        tail[i] = tail[i + 1] + sizes[i]
    begin = next((i for i in starts if kept + tail[i] <= budget), starts[-1])
    return messages[:head] + messages[begin:]
