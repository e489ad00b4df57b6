"""One request's life in the fake backend, as engine/job.py lives it: the prompt fitted to the
context (oldest messages trimmed, with a notice), its cached prefix matched, tokens streamed until
EOS, max_new_tokens, the context's end or a cancel, one Finished or Error at the end."""
from kvchat.core.config import ConfigError
from kvchat.core.events import EngineError, Error, Finished, PrefillProgress, Stats, TokenDelta

from support.fake_model import EOS, persona_ids

PREFILL_CHUNK = 64  # the fake's prefill chunk, in its word tokens: a pasted page takes a few


def serve(fake, handle) -> None:
    fake.handle = handle
    fake.pace.begin(handle)
    try:
        if handle.cancelled or fake.switching():  # cancelled while queued
            last = Finished("", [], "cancelled", Stats(kv_precision=fake.precision.value))
        else:
            last = generate(fake, handle)
    except (ConfigError, EngineError) as error:
        last = Error(str(error))
    except Exception as error:  # a device failing mid-reply: the engine's last resort
        last = Error(f"internal error: {type(error).__name__}: {error}", internal=True)
    finally:
        fake.handle = None
    handle.put(last)


def fit(fake, request) -> tuple[list[dict], list[int], int]:
    """The messages that fit the context with room for the reply, their ids, how many were left out."""
    limit = fake.config.max_context
    messages, trimmed = list(request.messages), 0
    room = min(request.sampling.max_new_tokens, limit // 4)
    ids, _ = fake.model.encode(messages)
    while len(ids) + room > limit:
        head = 1 if messages[0]["role"] == "system" else 0
        if len(messages) - head <= 1:
            raise EngineError(f"the prompt is {len(ids)} tokens, longer than the context of {limit} "
                              f"(with room for a {room}-token reply)")
        rest = messages[head + 1:]
        while len(rest) > 1 and rest[0]["role"] != "user":
            rest = rest[1:]
        trimmed += len(messages) - head - len(rest)
        messages = messages[:head] + rest
        ids, _ = fake.model.encode(messages)
    if trimmed:
        fake.notice("trim", f"{trimmed} oldest message(s) are outside the context of {limit} tokens")
    return messages, ids, trimmed


def generate(fake, handle) -> Finished:
    model, sampling = fake.model, handle.request.sampling
    messages, prompt, trimmed = fit(fake, handle.request)
    stats = Stats(prompt_tokens=len(prompt), trimmed_messages=trimmed)
    persona = persona_ids(model, messages[0]["content"]) if messages[0]["role"] == "system" else []
    stats.cached_tokens = fake.cache.matched(prompt)
    if persona and stats.cached_tokens < len(persona) and fake.disk is not None and fake.disk.has(fake.disk_key(persona)):
        stats.cached_tokens = len(persona)  # restored from disk, not computed
    stats.ttft_ms = 5.0 + 0.01 * stats.computed_tokens
    fake.prefilled = stats.cached_tokens
    while fake.prefilled < len(prompt):  # in chunks, as the engine's prefill; a cancel stops it between two
        handle.put(PrefillProgress(fake.prefilled, len(prompt)))
        if not fake.pace.take_chunk(handle):
            return Finished("", [], "cancelled", stats)
        fake.prefilled = min(fake.prefilled + PREFILL_CHUNK, len(prompt))
    handle.put(PrefillProgress(len(prompt), len(prompt)))
    stream = model.replies(messages, sampling)
    text, generated, reason = [], [], "length"
    while True:
        if not fake.pace.take(handle):
            reason = "cancelled"
            break
        delta, token = model.forward(stream)
        generated.append(token)
        if token == EOS and not sampling.ignore_eos:
            reason = "stop"
            break
        text.append(delta)
        handle.put(TokenDelta(delta, token))
        if len(generated) >= sampling.max_new_tokens or len(prompt) + len(generated) >= fake.config.max_context:
            break
        if handle.cancelled:
            reason = "cancelled"
            break
    fake.cache.add(prompt + generated[:-1] if reason == "stop" else prompt + generated)
    if persona and fake.disk is not None:
        fake.disk.add(fake.disk_key(persona))
    stats.generated_tokens = len(generated)
    stats.decode_tok_s = 50.0 if len(generated) > 1 else 0.0
    stats.kv_precision = fake.precision.value
    return Finished("".join(text), generated, reason, stats)
