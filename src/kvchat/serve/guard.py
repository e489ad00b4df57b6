"""Who may talk to the local API: a Host-header allow-list (a web page that rebinds its own DNS
name to 127.0.0.1 still sends that name as Host), an Origin allow-list (a browser names the page
that sends a request; none but --cors-origin's may) and, when a key is set, Bearer auth on every
route. Plain ASGI, so that streamed responses and their cancellation pass through untouched.

Starlette's TrustedHostMiddleware does the first check, but not the rule that a server bound to
every interface takes any IP literal, nor an OpenAI-shaped error; this is as short."""
import hmac
import ipaddress
import socket

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from kvchat.serve.schema import error_body

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("", "0.0.0.0", "::")


def host_name(header: str) -> str:
    """'[::1]:8000' -> '::1', 'Example.com.:80' -> 'example.com'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        header = header.split(":")[0]
    return header.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class Guard:
    def __init__(self, app, api_key: str | None = None, bound_host: str = "127.0.0.1",
                 allow_hosts: tuple[str, ...] = (), origins: tuple[str, ...] = ()):
        self.app = app
        self.origins = {o.rstrip("/").lower() for o in origins}
        self.key = api_key.encode() if api_key else None
        self.allowed = {host_name(h) for h in (*LOOPBACK_NAMES, bound_host, *allow_hosts) if h}
        # Bound to every interface, the server is meant to be reached by this machine's addresses
        # and name; an IP literal cannot be a rebound name, so any is let through.
        self.any_ip = bound_host in WILDCARDS
        if self.any_ip:
            self.allowed.add(socket.gethostname().lower())

    def host_allowed(self, header: str | None) -> bool:
        if not header:
            return False
        name = host_name(header)
        return name in self.allowed or (self.any_ip and _is_ip(name))

    def key_ok(self, header: str | None) -> bool:
        if self.key is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(errors="replace"), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if not self.host_allowed(headers.get("host")):
            response = JSONResponse(error_body(
                "Host header not allowed (a guard against DNS rebinding); add the name with --allow-host",
                param="host", code="host_not_allowed"), status_code=400)
        elif "origin" in headers and headers["origin"].rstrip("/").lower() not in self.origins:
            response = JSONResponse(error_body(
                "requests from web pages are refused unless kvchat serve names their origin with --cors-origin",
                param="origin", code="origin_not_allowed"), status_code=403)
        elif not self.key_ok(headers.get("authorization")):
            response = JSONResponse(error_body("a valid API key is needed: Authorization: Bearer <key>",
                                               code="invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
        else:
            return await self.app(scope, receive, send)
        response.headers["Connection"] = "close"  # its body, if any, is not read
        await response(scope, receive, send)
