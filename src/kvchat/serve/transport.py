"""How the API meets the network: uvicorn's h11 server with deadlines and a cap on connections,
and one log line per kind of failure.

uvicorn alone, not a proxy in front: a proxy is a second program for a desktop user to install
and run. uvicorn has a keep-alive timeout (after a response), ``limit_concurrency`` (a 503 once
that many connections or requests are open) and h11's cap on a request head's size; it has no
deadline for a request head, so a client that connects and sends nothing, or half a head, was
held for ever (3,000 of them for 90 s in a probe), nor for a client that stops reading a reply.
The protocol below adds those two deadlines; the body's is the app's (``server.read_body``),
where the bytes are counted. On Ctrl-C uvicorn waited for every reply in flight to end (a long
stream: minutes); it now cancels them after SHUTDOWN_S."""
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvchat.serve.schema import error_body

KEEP_ALIVE_S = 5.0  # an idle connection between requests (uvicorn's default, said here)
HEAD_TIMEOUT_S = KEEP_ALIVE_S  # from connecting, or from the last response, to a complete request head
MAX_CONNECTIONS = 512  # open at once; past it a new connection is closed at once
MAX_HEAD_BYTES = 64 << 10  # h11's cap on an unfinished request head
SHUTDOWN_S = 2.0  # on Ctrl-C, what a reply in flight gets to finish before it is cancelled
STALL_S = 30.0  # a peer that drains less than asyncio's 48 KiB (high - low water) in this long is dropped

log = logging.getLogger("kvchat.serve")


class OncePerKind(logging.Filter):
    """Lets the first record of each kind through and counts the rest: a flood of hung-up or
    half-sent clients is one line, not a line (or a traceback) per client."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = str(record.msg) + (type(record.exc_info[1]).__name__ if record.exc_info else "")
        self.seen[kind] = self.seen.get(kind, 0) + 1
        if self.seen[kind] > 1:
            return False
        if record.exc_info:  # the kind is enough; a traceback per client is what filled the log
            record.msg = f"{record.msg} ({type(record.exc_info[1]).__name__}: {record.exc_info[1]}); " \
                         "further ones are counted, not logged"
            record.exc_info = record.exc_text = None
        else:
            record.msg = f"{record.msg} (further ones are counted, not logged)"
        return True


FILTER = OncePerKind()
for name in ("uvicorn.error", "kvchat.serve"):
    logging.getLogger(name).addFilter(FILTER)


def incident(kind: str) -> None:
    """A client's failure (hung up mid-body, too slow, one connection too many): logged once."""
    log.warning(kind)


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on the request head and a cap on connections."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > MAX_CONNECTIONS:
            incident(f"more than {MAX_CONNECTIONS} connections open: new ones are closed")
            transport.close()
            return
        self._head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._head_deadline()

    def pause_writing(self) -> None:
        """The write buffer is full. A peer that leaves it so for STALL_S has stopped reading: it is
        dropped, and the app sees a disconnect. Without this, a streamed reply to it waited for ever
        and held its queue slot (32 such clients: every other request a 429)."""
        super().pause_writing()
        self.paused_at = paused_at = self.loop.time()
        self.loop.call_later(STALL_S, lambda: self.flow.write_paused and self.paused_at == paused_at
                             and self._stalled())

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (``Content-Length: -1``, a broken head) gets the API's JSON
        error, as every other refusal does; uvicorn's own answer is plain text."""
        body = json.dumps(error_body(f"malformed HTTP request: {msg}")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # h11 past the point of answering: close, as uvicorn would
            pass
        self.transport.close()

    def _stalled(self) -> None:
        incident(f"a client stopped reading its reply (write buffer full for {STALL_S:g} s): dropped")
        self.transport.abort()

    def _head_deadline(self) -> None:
        # A new request replaces self.cycle; the same cycle at the deadline means no head came.
        self.loop.call_later(HEAD_TIMEOUT_S, self._head_late, self.cycle)

    def _head_late(self, cycle) -> None:
        if self.cycle is cycle and not self.transport.is_closing():
            incident(f"a connection sent no complete request head in {HEAD_TIMEOUT_S:g} s: closed")
            self.transport.close()


def server_config(app, host: str, port: int, log_level: str = "warning"):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=DeadlineProtocol,
                          timeout_keep_alive=KEEP_ALIVE_S, limit_concurrency=MAX_CONNECTIONS,
                          timeout_graceful_shutdown=SHUTDOWN_S,
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES, ws="none", lifespan="off")
