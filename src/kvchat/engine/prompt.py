"""A request's prompt as token ids: its messages rendered by the chat template, fitted to the
context (the oldest messages left out, a message alone past it refused), and the context limit
itself; the API's plain prompts tokenized on the engine thread."""
from kvchat.core.commands import Tokenize
from kvchat.core.errors import first_line
from kvchat.core.events import EngineError, Request
from kvchat.core.kv_sizes import lowest_precision
from kvchat.engine.chat import ChatError, longest_content


class PromptBuilder:
    def __init__(self, engine):
        self.engine = engine  # a weak proxy: the engine owns this

    def tokenize(self, command: Tokenize) -> None:
        try:
            command.future.set_result(self.engine.formatter.prompt_ids(command.text, self.context_limit()))
        except Exception as error:  # the future resolves whatever happens
            command.future.set_exception(error if isinstance(error, ChatError)
                                         else EngineError(f"internal error: {first_line(error)}"))

    def context_limit(self) -> int:
        """Tokens a sequence may reach: the context setting, and what the pool holds at the lowest
        precision it may step down to."""
        e = self.engine
        floor = lowest_precision(e.kvpool.shape, e.kvpool.precision, e.auto)
        return min(e.config.max_context, e.kvpool.tokens_for(floor))

    def prompt_ids(self, request: Request) -> tuple[list[int], int, int]:
        """The prompt's token ids, how many of them are the persona (the system message), and how
        many of the oldest messages were left out so that the rest fits the context."""
        e = self.engine
        limit = self.context_limit()
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            vocab = e.loaded.model.config.vocab_size
            if not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ChatError(f"prompt_ids must be a non-empty list of token ids below {vocab}")
            if len(ids) >= limit:
                raise EngineError(f"the prompt is {len(ids)} tokens, longer than the context of {limit}")
            return ids, 0, 0
        messages, trimmed = request.messages, 0
        cap = e.formatter.max_chars(limit)
        while longest_content(messages) > cap:  # a message alone past the context: trimmed or refused, untokenized
            shorter = drop_oldest(messages)
            if shorter is None:
                raise EngineError(f"a message is longer than the context of {limit} tokens ({cap:,} characters "
                                  "at most)")
            trimmed += len(messages) - len(shorter)
            messages = shorter
        room = min(request.sampling.max_new_tokens, limit // 4)
        encoded = e.formatter.encode(messages)
        while len(encoded.token_ids) + room > limit:
            shorter = drop_to_fit(messages, encoded, limit - room)
            if shorter is None:
                raise EngineError(f"the prompt is {len(encoded.token_ids)} tokens, longer than the context of "
                                  f"{limit} (with room for a {room}-token reply)")
            trimmed += len(messages) - len(shorter)
            messages = shorter
            encoded = e.formatter.encode(messages)
        if trimmed:
            e.notice("trim", f"{trimmed} oldest message(s) are outside the context of {limit} tokens")
        persona_len = 0
        if messages[0]["role"] == "system":
            persona_len = encoded.message_starts[1] if len(messages) > 1 else encoded.prompt_start
        return encoded.token_ids, persona_len, trimmed


def drop_oldest(messages: list[dict]) -> list[dict] | None:
    """The conversation without its oldest exchange; the persona and the last message stay. None
    when nothing is left to drop."""
    head = 1 if messages[0]["role"] == "system" else 0
    if len(messages) - head <= 1:
        return None
    rest = messages[head + 1:]
    while len(rest) > 1 and rest[0]["role"] != "user":  # start the history on a user turn
        rest = rest[1:]
    return messages[:head] + rest


def drop_to_fit(messages: list[dict], encoded, budget: int) -> list[dict] | None:
    """The conversation without as many of its oldest exchanges as its messages' token counts say
    must go for it to fit ``budget`` tokens: one re-encoding, not one per dropped message. None
    when nothing is left to drop."""
    ends = encoded.message_starts[1:] + [encoded.prompt_start]
    size = {id(m): end - start for m, start, end in zip(messages, encoded.message_starts, ends)}
    extra = len(encoded.token_ids) - encoded.prompt_start  # the generation prompt
    shorter = drop_oldest(messages)
    while shorter is not None:
        if sum(size[id(m)] for m in shorter) + extra <= budget:
            return shorter
        fewer = drop_oldest(shorter)
        if fewer is None:
            return shorter
        shorter = fewer
    return None
