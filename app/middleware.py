"""Pure ASGI middleware, outermost first:

    RequestContext  request id (echoed or generated), access log (settings.access_log), request
                    metrics by route (a request refused before routing counts under the route it
                    was for), last-resort 500
    CORS            only when origins are configured (starlette's)
    Auth            bearer key on every path but the public ones, constant-time compare
    Body            the whole body read up front: 415 for a Content-Encoding other than identity (no
                    content coding is decoded), 413 past the byte limit (from Content-Length, or while
                    streaming), 408 when it arrives too slowly; then replayed to the app

Deny by default: auth and the body limit sit in front of routing, so a new route is covered without
anyone remembering to add a dependency, and an unknown path answers 401 before 404.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi.routing import iter_route_contexts
from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import clip, error_body, internal_error_response
from app.logs import request_id_var
from app.metrics import Metrics

access_log = logging.getLogger("eg2.access")
log = logging.getLogger("eg2.http")

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


async def _send_error(
    send: Send,
    status: int,
    name: str,
    message: str,
    *,
    close: bool = False,
    extra: dict[str, str] | None = None,
) -> None:
    headers = dict(extra or {})
    if close:  # the rest of the body is not wanted: make the server drop the connection
        headers["connection"] = "close"
    response = JSONResponse(error_body(message, name), status_code=status, headers=headers)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


def route_template(scope: Scope, routes: Sequence[Any]) -> str:
    """The template of the route this request is for: the router's choice when it ran, else matched
    here (the request was refused before routing: 401, 408, 413); `unmatched` when none serves its
    path. A route that serves the path with another method (405) counts as that route."""
    if (route := scope.get("route")) is not None:
        return str(getattr(route, "path", "unmatched"))
    partial = None
    for candidate in routes:
        match, _ = candidate.matches(scope)
        if match is Match.FULL:
            return str(candidate.path)
        if match is Match.PARTIAL and partial is None:
            partial = str(candidate.path)
    return partial or "unmatched"


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[BaseRoute], access_log: bool) -> None:
        self.app = app
        self.metrics = metrics
        # Built with the middleware stack, at the first request: every route is in by then. Included
        # routers are flattened into their routes (FastAPI's own walk).
        self.routes = list(iter_route_contexts(routes))
        self.log_access = access_log  # settings.access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        token = request_id_var.set(request_id)
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.monotonic()
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            # A bug: the detail goes to the log under the request id, the client gets a generic 500.
            log.error("unhandled %s", type(exc).__name__, exc_info=exc, extra={"request_id": request_id})
            if status == 0:
                response = internal_error_response()
                await send_with_id(
                    {"type": "http.response.start", "status": 500, "headers": response.raw_headers}
                )
                await send_with_id({"type": "http.response.body", "body": response.body})
            status = status or 500
        finally:
            status = status or 499  # no answer sent: the client left while its body was being read
            self.metrics.requests.labels(route_template(scope, self.routes), str(status)).inc()
            if self.log_access:
                access_log.info(
                    "%s %s %d",
                    scope["method"],
                    scope["path"],
                    status,
                    extra={
                        "request_id": request_id,
                        "status": status,
                        "ms": round((time.monotonic() - start) * 1000, 2),
                    },
                )
            request_id_var.reset(token)


class AuthMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, public_paths: frozenset[str]) -> None:
        self.app = app
        # Compare digests: equal length whatever the client sends, so the time says nothing of the key.
        self._digest = hashlib.sha256(api_key.encode()).digest()
        self._public = public_paths

    def authorized(self, header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        presented = hashlib.sha256(token.strip().encode()).digest()
        # Always run the comparison, even for a wrong scheme: same work on every path.
        return hmac.compare_digest(presented, self._digest) and scheme.lower() == "bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._public:
            await self.app(scope, receive, send)
            return
        if not self.authorized(Headers(scope=scope).get("authorization")):
            await _send_error(
                send,
                401,
                "authentication_error",
                "missing or wrong API key: send Authorization: Bearer <key>",
                extra={"www-authenticate": "Bearer"},
            )
            return
        await self.app(scope, receive, send)


class BodyMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        # No content coding is decoded (a gzip body would need a bound on what it inflates to): one that
        # is not identity would be read as if it were, so it is refused before the body is read.
        codings = [c.strip() for h in headers.getlist("content-encoding") for c in h.split(",")]
        if coded := [c for c in codings if c and c.lower() != "identity"]:
            await _send_error(
                send,
                415,
                "invalid_request_error",
                f"Content-Encoding {clip(coded[0])} is not supported: send the body uncompressed",
                close=True,
                extra={"accept-encoding": "identity"},
            )
            return
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await _send_error(send, 400, "invalid_request_error", "invalid Content-Length", close=True)
                return
            if int(declared) > self.max_bytes:
                await self._too_large(send)
                return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # nobody to answer
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        await self._too_large(send)
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await _send_error(
                send,
                408,
                "request_timeout",
                f"request body not received within {self.timeout_s:g} s",
                close=True,
            )
            return
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, send: Send) -> None:
        await _send_error(
            send,
            413,
            "request_too_large",
            f"request body over {self.max_bytes} bytes (max_request_bytes)",
            close=True,
        )


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands the buffered body once, then waits on the real one (for disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def public_paths(metrics_require_key: bool) -> frozenset[str]:
    paths = {"/health", "/ready"}
    if not metrics_require_key:
        paths.add("/metrics")
    return frozenset(paths)
