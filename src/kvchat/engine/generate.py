"""One request's life on the engine thread: its prompt fitted to the context, its cached prefix
matched, the rest prefilled in chunks, tokens sampled and streamed until a stop, then its blocks
released (the persona kept). Every request ends with exactly one Finished or Error."""
import logging
import weakref
import time

from kvchat.core.commands import Tokenize
from kvchat.core.config import ConfigError, Precision
from kvchat.core.errors import first_line
from kvchat.core.events import EngineError, Error, Finished, PrefillProgress, Request, RequestHandle, Stats, TokenDelta
from kvchat.engine.chat import ChatError, longest_content
from kvchat.engine.detok import StopChecker, StreamDetokenizer
from kvchat.engine.kv.block_pool import PoolExhausted
from kvchat.engine.kv.manager import Sequence
from kvchat.engine.sampler import Sampler

log = logging.getLogger("kvchat.engine")


class RequestRunner:
    def __init__(self, engine):
        self.engine = weakref.proxy(engine)  # the engine owns this: no cycle keeps a closed engine's model alive

    def serve(self, handle: RequestHandle) -> None:
        """Run one request; its blocks are released before the last event, so a caller that saw
        Finished or Error sees the pool as the engine leaves it."""
        e = self.engine
        seq, persona_len = None, 0
        e.handle = handle
        evictions = e.kvpool.pool.evictions
        try:
            if handle.cancelled or e.switching():  # cancelled while queued: not even tokenized
                last = Finished("", [], "cancelled", Stats(kv_precision=e.precision.value))
            else:
                prompt, persona_len, trimmed = self.prompt_ids(handle.request)
                seq = Sequence(list(prompt))
                last = self.generate(handle, seq, len(prompt), persona_len, handle.sent)
                last.stats.trimmed_messages = trimmed
        except (ChatError, ConfigError, PoolExhausted, EngineError) as error:
            last = Error(str(error))
        except Exception as error:
            log.exception("request failed")
            last = Error(f"internal error: {type(error).__name__}: {error}", internal=True)
        finally:
            if seq is not None:
                self.release(seq, persona_len)
            e.handle = None
        evicted = e.kvpool.pool.evictions - evictions
        if evicted:
            e.notice("evict", f"{evicted} cached block(s) ({evicted * e.config.block_size} tokens of earlier "
                              "prefixes) evicted to make room")
        handle.put(last)

    def release(self, seq: Sequence, persona_len: int) -> None:
        """After the reply (never before the first token): pin the persona, persist, free blocks."""
        kvpool = self.engine.kvpool
        persona_blocks = 0
        try:
            persona_blocks = kvpool.personas.remember(seq, persona_len)
        except Exception:
            log.exception("could not remember the persona")
        kvpool.tiers.persist(seq, persona_blocks)  # the turn's new full blocks on disk: a restart resumes the chat
        kvpool.manager.free(seq, keep_tail=True)  # the next turn goes on from the last computed token

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
        floor = Precision.INT4 if e.auto else e.kvpool.precision
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

    def reserve(self, seq: Sequence, tokens: int) -> None:
        """Blocks for ``tokens``; when the pool is full (unreferenced cached blocks already evicted),
        Auto steps the precision down and tries again."""
        e = self.engine
        while True:
            try:
                return e.kvpool.manager.reserve(seq, tokens)
            except PoolExhausted:
                old = e.precision
                if not e.auto or e.kvpool.downshift([seq]) is None:
                    raise
                e.notice("downshift", f"KV cache full: {old.value} -> {e.precision.value}, "
                                      f"room for {e.kvpool.tokens_for(e.precision):,} tokens")

    def generate(self, handle: RequestHandle, seq: Sequence, prompt_len: int, persona_len: int,
                 start: float) -> Finished:
        e = self.engine
        kvpool, cfg, sp = e.kvpool, e.config, handle.request.sampling
        stats = Stats(prompt_tokens=prompt_len)
        limit = self.context_limit()
        stats.ram_tokens, stats.disk_tokens = kvpool.match(seq)  # pool, RAM, disk
        stats.cached_tokens = seq.num_computed
        logits = None
        while seq.num_computed < prompt_len:
            if handle.cancelled:
                return Finished("", [], "cancelled", stats)
            handle.put(PrefillProgress(seq.num_computed, prompt_len))
            end = min(seq.num_computed + cfg.prefill_chunk, prompt_len)
            self.reserve(seq, end)  # may step the pool down: its runner and manager are read after
            logits = kvpool.runner.forward(seq, end, want_logits=end == prompt_len)
            kvpool.manager.commit(seq)
        handle.put(PrefillProgress(prompt_len, prompt_len))
        sampler = Sampler(sp, device=e.loaded.device)
        detok, stops = StreamDetokenizer(e.loaded.tokenizer), StopChecker(sp.stop)
        text, generated, reason = [], [], "length"
        first_at = None
        while True:
            token = sampler(logits, seq.token_ids)
            if first_at is None:
                first_at = time.perf_counter()
            seq.token_ids.append(token)
            generated.append(token)
            if token in e.eos_ids and not sp.ignore_eos:
                reason = "stop"
                break
            delta = stops.feed(detok.add(token))
            text.append(delta)
            handle.put(TokenDelta(delta, token))
            if stops.stopped:
                reason = "stop"
                break
            if len(generated) >= sp.max_new_tokens or len(seq) >= limit:
                break
            if handle.cancelled:
                reason = "cancelled"
                break
            e.governor.tick([seq])
            # after the first token, not before it: a compile shares the GIL with the prefill
            # (bench startup, warm: first token 5.9 s when the compile started before the prefill)
            e.host.prepare_decode(between_tokens=True)
            self.reserve(seq, len(seq))
            logits = kvpool.runner.forward(seq, len(seq), want_logits=True)
            kvpool.manager.commit(seq)
        if not stops.stopped:
            tail = stops.flush()
            if tail:
                text.append(tail)
                handle.put(TokenDelta(tail, -1))
        done = time.perf_counter()
        stats.ttft_ms = (first_at - start) * 1000
        stats.decode_tok_s = (len(generated) - 1) / (done - first_at) if len(generated) > 1 else 0.0
        stats.generated_tokens = len(generated)
        stats.kv_precision = e.precision.value
        return Finished("".join(text), generated, reason, stats)


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
