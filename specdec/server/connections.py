"""The HTTP connections under the app: a request's head must arrive in time, and the health
probes are answered past the connection cap.

uvicorn waits for a request's head (its request line and headers) as long as the client keeps
the socket open, and counts every open connection against `max_connections`. So a few hundred
sockets that each send half a header (slowloris) held every slot, and every request, the health
probes included, got a 503 for as long as they stayed. Here a head not complete within
`request_head_timeout_s` of its first byte (or of the connection's start) gets a 408 and its
connection is closed, and `/health/live` and `/health` are served even at the cap.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Answered even when the connection cap is reached: an orchestrator must be able to tell that the
# process serves (and how loaded it is) while it sheds load.
PROBE_PATHS = (b"/health/live", b"/health")
TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                    b"content-length: 33\r\nconnection: close\r\n\r\nthe request head came too slowly")


class HeadTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request's head (class attribute
    `head_timeout_s`, set by :func:`protocol_class`) and the probes past the connection cap."""

    head_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_too_slow)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.write(TIMEOUT_RESPONSE)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # the first request's head, from the connection's start

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # a later request's head on a kept-alive connection, from its first byte

    def on_headers_complete(self) -> None:
        self._disarm()
        if self.url.split(b"?", 1)[0] in PROBE_PATHS and self.limit_concurrency is not None:
            limit, self.limit_concurrency = self.limit_concurrency, None
            try:
                super().on_headers_complete()
            finally:
                self.limit_concurrency = limit
            return
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def protocol_class(head_timeout_s: float) -> type[HeadTimeoutProtocol]:
    """The protocol class for uvicorn's `http` setting, with this deadline for a request's head."""
    return type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout_s": float(head_timeout_s)})
