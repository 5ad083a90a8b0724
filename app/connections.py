"""Connection-level defences: uvicorn's httptools protocol with limits on how long and how large a
request's headers may be and on how many connections may be open, before any request reaches the app.

    accept ── at max_connections open: the connection waiting longest for a request (idle keep-alive,
       │       or still sending its headers) is closed to make room; when every one has a request in
       │       flight, the new one gets a 503 at once and is closed
       └─► request line and headers: complete within header_read_timeout_s of the connection's
           opening or the request's first byte (else 408, or a plain close when nothing was sent) and
           at most max_header_bytes (else 431), both checked as bytes arrive
             └─► the app (API key, body limit and body timeout: app/middleware.py)

Why in the protocol: the parser hands a request to the app only once its headers are complete, so
nothing in the app (the API key included) sees a client that never completes them; uvicorn has no
header timeout or size limit for httptools, and its `limit_concurrency` answers 503 only to clients
that complete their headers, accepting every connection meanwhile. The answers written here carry
the OpenAI error body, `connection: close` and an `x-request-id`, as the app's do; each is counted
in eg2_connections_closed_total by reason, and eg2_open_connections is the count now.

Why the 503 is written before the request is read: nothing in the request can change the answer, and
reading it would hold the descriptor that the cap is there to protect. A client that has sent its
request reads the 503; one still sending a large body may see the connection reset instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from app.errors import error_body
from app.metrics import Metrics

log = logging.getLogger("eg2.connections")
WARN_EVERY_S = 10.0  # one log line per reason at most this often; the counter has every one


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    max_header_bytes: int


def answer(status: int, name: str, message: str, *headers: str) -> bytes:
    """A complete HTTP/1.1 response with the OpenAI error body, closing the connection."""
    body = json.dumps(error_body(message, name)).encode()
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        f"x-request-id: {uuid.uuid4().hex}",
        *headers,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Connections:
    """What the connections of one server share: the open ones, and those waiting for a request
    (no request in flight), longest-waiting first: the ones closed to make room at the cap."""

    def __init__(self, limits: ConnectionLimits, metrics: Metrics) -> None:
        self.limits = limits
        self._metrics = metrics
        self._open: set[GuardedProtocol] = set()
        self._waiting: dict[GuardedProtocol, None] = {}  # insertion-ordered: oldest first
        self._next_warning: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, conn: GuardedProtocol) -> bool:
        """Take a new connection, closing the longest-waiting one if at the cap; False if none waits."""
        if len(self._open) >= self.limits.max_connections:
            if not self._waiting:
                self.closed("over_limit")
                return False
            oldest = next(iter(self._waiting))
            self.forget(oldest)
            oldest.evict()
            self.closed("evicted")
        self._open.add(conn)
        self._waiting[conn] = None
        self._metrics.open_connections.set(len(self._open))
        return True

    def busy(self, conn: GuardedProtocol) -> None:
        self._waiting.pop(conn, None)

    def waiting(self, conn: GuardedProtocol) -> None:
        if conn in self._open:
            self._waiting.pop(conn, None)
            self._waiting[conn] = None  # to the back: waiting since now

    def forget(self, conn: GuardedProtocol) -> None:
        self._open.discard(conn)
        self._waiting.pop(conn, None)
        self._metrics.open_connections.set(len(self._open))

    def closed(self, reason: str) -> None:
        self._metrics.connections_closed.labels(reason).inc()
        now = time.monotonic()
        if now >= self._next_warning.get(reason, 0.0):
            self._next_warning[reason] = now + WARN_EVERY_S
            log.warning(
                "closing connections: %s (counted in eg2_connections_closed_total; logged at most every %g s)",
                reason,
                WARN_EVERY_S,
                extra={"reason": reason, "open": len(self._open), "limits": vars(self.limits)},
            )


class _Answered(Exception):
    """Raised from a parser callback once this module has answered: stops the parser mid-buffer."""


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with the limits of its server's `Connections` (set by
    protocol_class: uvicorn builds one instance per connection from the class alone)."""

    tracker: Connections  # not `connections`: uvicorn gives each protocol that name for its own set

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, object],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._refused = False  # answered 503 at accept: uvicorn's connection state was never set up
        self._header_timer: asyncio.TimerHandle | None = None
        self._reading_headers = True  # the next bytes belong to a request line or headers
        self._header_bytes = 0  # bytes received while reading them (at most one read short)
        self._request_begun = False  # a byte of the current request has arrived
        self._running: RequestResponseCycle | None = None  # the request whose app task runs now

    # --- accept and close -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if not self.tracker.admit(self):
            self._refused = True
            message = "the server is at its connection limit (max_connections); retry later"
            transport.write(answer(503, "unavailable", message, "retry-after: 1"))
            transport.close()
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self.tracker.forget(self)
        if self._refused:
            return
        # uvicorn marks only the newest parsed request disconnected. With requests pipelined, the one
        # running can be an older one: marked too, its app hears the disconnect (the embeddings route
        # cancels its work) and its answer is not written to the closed transport.
        running = self._running
        if running is not None and running is not self.cycle and not running.response_complete:
            running.disconnected = True
            running.message_event.set()
        super().connection_lost(exc)

    def evict(self) -> None:
        """Closed to make room for a new connection (this one has no request in flight)."""
        self._cancel_header_timer()
        if self.transport.get_write_buffer_size():  # a client not reading its last answer
            self.transport.abort()
        elif self._request_begun:
            self._close_with(503, "unavailable", "closed to make room: the server is at its connection limit")
        else:
            self.transport.close()

    def _close_with(self, status: int, name: str, message: str) -> None:
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started or self.pipeline or self._reading_headers:
                # Mid-answer to a request, or a request still running or queued while the bytes that
                # failed are a later request's: an answer here would be taken for that request's.
                self.transport.abort()
                return
            # The request's own body failed (a malformed chunk), before any answer: this is its answer.
            # Its app hears the disconnect now and writes nothing after it (uvloop takes writes after
            # close() until the buffer drains).
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.write(answer(status, name, message))
        self.transport.close()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        """uvicorn's, remembering which request's app task runs (connection_lost)."""
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    # --- bytes in ---------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        """uvicorn's, with the header-size count, its 400 in the OpenAI error shape, and no warning
        per Upgrade request (a log line per request is a client's to multiply)."""
        if self._refused:
            return
        if self._reading_headers:
            self._header_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Answered):
                self._invalid(exc)
            return
        except httptools.HttpParserError as exc:
            self._invalid(exc)
            return
        except httptools.HttpParserUpgrade:
            return  # no WebSocket routes (ws="none"): the request was served as plain HTTP
        if self._reading_headers and self._header_bytes > self.tracker.limits.max_header_bytes:
            self._too_large()

    def _invalid(self, exc: Exception) -> None:
        log.debug("invalid HTTP request: %s", type(exc).__name__)
        self._close_with(400, "invalid_request_error", "invalid HTTP request")

    def _too_large(self) -> None:
        limit = self.tracker.limits.max_header_bytes
        self.tracker.closed("header_too_large")
        self._close_with(
            431, "request_too_large", f"request line and headers over {limit} bytes (max_header_bytes)"
        )

    # --- parser callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._request_begun = True
        self._arm_header_timer()  # a keep-alive connection's next request: counted from its first byte

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        self._reading_headers = False
        # Exact, for a header block that arrived within one read (the running count is per read).
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.tracker.limits.max_header_bytes:
            self._too_large()
            raise _Answered
        self.tracker.busy(self)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_headers, self._header_bytes, self._request_begun = True, 0, False

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.tracker.waiting(self)

    # --- the header timer -------------------------------------------------------------------------

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            timeout = self.tracker.limits.header_timeout_s
            self._header_timer = self.loop.call_later(timeout, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        self.tracker.closed("header_timeout")
        if self._request_begun:
            timeout = self.tracker.limits.header_timeout_s
            self._close_with(408, "request_timeout", f"request headers not received within {timeout:g} s")
        else:
            self.transport.close()  # nothing was asked: nothing to answer


def protocol_class(connections: Connections) -> type[GuardedProtocol]:
    """A protocol class bound to one server's connections (uvicorn takes a class, not an instance)."""

    class EG2HttpProtocol(GuardedProtocol):
        pass

    EG2HttpProtocol.tracker = connections
    return EG2HttpProtocol
