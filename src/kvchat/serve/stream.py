"""The server-sent events of a streamed reply, in OpenAI's chunk shapes."""
import json

from kvchat.core.events import Error, Finished, TokenDelta


def finish_reason(done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _stream(events, make, include_usage: bool, usage):
    """``make(text, finish)`` builds one chunk; the final usage chunk has no choices."""
    async for event in events:
        if isinstance(event, TokenDelta) and event.text:
            yield _sse(make(event.text, None))
        elif isinstance(event, Finished):
            yield _sse(make("", finish_reason(event)))
            if include_usage:
                last = make("", None)
                last["choices"] = []
                last["usage"] = usage(event.stats)
                yield _sse(last)
        elif isinstance(event, Error):
            yield _sse({"error": {"message": event.message, "type": "server_error", "param": None, "code": None}})
    yield "data: [DONE]\n\n"


async def chat_chunks(events, cid: str, created: int, model: str, include_usage: bool, usage):
    def make(text, finish):
        delta = {"content": text} if text else {}
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    opening = make("", None)
    opening["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    yield _sse(opening)
    async for line in _stream(events, make, include_usage, usage):
        yield line


async def completion_chunks(events, cid: str, created: int, model: str, include_usage: bool, usage):
    def make(text, finish):
        return {"id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

    async for line in _stream(events, make, include_usage, usage):
        yield line
