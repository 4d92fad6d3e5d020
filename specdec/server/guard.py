"""The ASGI middleware around the app: API keys and the Host check, body limits, the replica
header, and counting requests that end before any sequence is queued."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.server.protocol import error_body

if TYPE_CHECKING:
    from specdec.server.app import ServerState

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Answers without a key: an orchestrator's liveness probe learns that the process serves, nothing more.
LIVENESS_PATH = "/health/live"


def allowed_hosts(bind_host: str | None) -> frozenset[str] | None:
    """The names a server bound to `bind_host` answers in the Host header: for a loopback address,
    the loopback names only, so that a web page whose DNS name is rebound to 127.0.0.1 cannot reach
    it from a browser on this machine (its requests carry the page's own name); else any (None)."""
    if bind_host is None:
        return None
    name = bind_host.strip("[]")
    try:
        loopback = ipaddress.ip_address(name).is_loopback
    except ValueError:
        loopback = name == "localhost"
    return frozenset({"localhost", "127.0.0.1", "::1", name}) if loopback else None


def _host_name(headers: dict[bytes, bytes]) -> str:
    host = headers.get(b"host", b"").decode("latin-1").strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _key_matches(headers: dict[bytes, bytes], keys: tuple[str, ...]) -> bool:
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").strip().partition(" ")
    given = token.strip().encode()
    # Every key is compared, each in constant time: how long a check takes says nothing of a key.
    matches = [hmac.compare_digest(given, key.encode()) for key in keys]
    return scheme.lower() == "bearer" and any(matches)


class _BodyTooLarge(Exception):
    pass


class _BodyTimeout(Exception):
    pass


class RequestGuard:
    """ASGI middleware around the app.

    0. Refuses a request with two Host headers with 400 (RFC 9112), and, with `allowed` names (a
       server bound to loopback), one that names another host; with
       API keys configured, refuses a request without one of them (OpenAI's `Authorization:
       Bearer KEY`) with 401, on every path but the liveness probe `/health/live`.
    1. Refuses a body over `max_request_bytes` with 413 and the JSON error body: at once when
       Content-Length says so, else once the bytes read pass it; and one not all there within
       `request_body_timeout_s` with 408 (the connection then closes). The body is read here (the
       handlers read all of it anyway) and handed on unchanged; a client that leaves mid-body is
       an abort, and the app never sees the request.
    2. Under Ray Serve, names the replica that answered in the header x-specdec-replica.
    3. Counts a request to a generation endpoint that ends before any of its sequences was
       queued in `specdec_requests_total`: "rejected" (a 4xx), "error" (a 5xx or an exception)
       or "abort" (the client left first). Once sequences are queued, the scheduler counts
       each of them instead, so nothing is counted twice.
    """

    def __init__(self, app: ASGIApp, state: ServerState, allowed: frozenset[str] | None = None) -> None:
        self.app = app
        self.state = state
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_state = scope.setdefault("state", {})
        status = 0
        failed = False

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if self.state.replica is not None:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"x-specdec-replica", self.state.replica.encode())]}
            await send(message)

        try:
            headers = dict(scope["headers"])
            if sum(name == b"host" for name, _ in scope["headers"]) > 1:  # RFC 9112 3.2: a 400
                body = error_body("the request has more than one Host header", param="Host", code="invalid_host")
                await JSONResponse(body, status_code=400)(scope, receive, observed)
                return
            host = _host_name(headers)  # none at all (HTTP/1.0) is no browser's: answered
            if self.allowed is not None and host and host not in self.allowed:
                body = error_body("this server answers only to its loopback names in the Host header", param="Host",
                                  code="invalid_host")
                await JSONResponse(body, status_code=400)(scope, receive, observed)
                return
            keys = self.state.config.api_keys
            if keys and scope["path"] != LIVENESS_PATH and not _key_matches(headers, keys):
                body = error_body("a valid API key is needed: send it as 'Authorization: Bearer KEY'",
                                  code="invalid_api_key")
                refused = JSONResponse(body, status_code=401, headers={"www-authenticate": "Bearer"})
                await refused(scope, receive, observed)
                return
            try:
                replay = await self._read_body(scope, headers, receive)
            except _BodyTooLarge:
                limit = self.state.config.max_request_bytes
                body = error_body(f"the request body exceeds the server's limit of {limit} bytes", code="request_too_large")
                await JSONResponse(body, status_code=413)(scope, receive, observed)
                return
            except _BodyTimeout:
                wait = self.state.config.request_body_timeout_s
                body = error_body(f"the request body did not arrive within {wait:g} s", code="request_timeout")
                await JSONResponse(body, status_code=408, headers={"connection": "close"})(scope, receive, observed)
                return
            if replay is None:  # the client left mid-body: an abort, nothing to answer
                return
            await self.app(scope, replay, observed)
        except Exception:
            failed = True
            raise
        finally:
            if scope["path"] in GENERATION_PATHS and not request_state.get("submitted"):
                reason = None
                if failed or status >= 500:
                    reason = "error"
                elif status >= 400:
                    reason = "rejected"
                elif status == 0:  # cancelled before it answered: the client went away
                    reason = "abort"
                if reason is not None:
                    self.state.metrics.requests.labels(request_state.get("route", ""), reason).inc()

    async def _read_body(self, scope: Scope, headers: dict[bytes, bytes], receive: Receive) -> Receive | None:
        """Read the whole body (at most the limit, within the timeout), and return a `receive`
        that replays it and then passes on to the client's (for disconnects); None when the
        client left before the body was all there."""
        limit = self.state.config.max_request_bytes
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > limit:
            raise _BodyTooLarge
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.state.config.request_body_timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                raise _BodyTimeout from None
            if message["type"] != "http.request":  # http.disconnect
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        return replay
