"""The server-sent events of a streamed reply, in OpenAI's chunk shapes, and the response that
sends them.

Starlette's StreamingResponse, not sse-starlette: under uvicorn (ASGI 2.3) it already listens for
the client's disconnect while it streams and ends the stream at once (1 ms, measured), and the
framing is one f-string. sse-starlette 3.7 cost 5-10 us more server CPU a chunk (its encoder and
a cancel scope around every send), patches uvicorn's signal handler when imported and polls for
shutdown every 0.5 s; what it adds (pings, ending streams on Ctrl-C) is uvicorn's
timeout_graceful_shutdown here (transport.py), or not needed before a proxy kvchat does not use.
JSON goes out ASCII-escaped: a client that splits lines as str.splitlines does (httpx's
iter_lines) would cut a raw U+2028 or U+0085 in a token in two."""
import json

from starlette.responses import StreamingResponse

from kvchat.core.events import Error, Finished, TokenDelta


class EventStream(StreamingResponse):
    """A streamed reply whose request is cancelled however the response ends: finished, the
    client gone mid-stream (or stopped reading: transport.STALL_S), or never started because the
    client left first."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


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
