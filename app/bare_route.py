"""A route served without FastAPI's request handling, ahead of the FastAPI route it stands in for.

FastAPI wraps each route's function in its own request handling: a request-response wrapper,
dependency solving, a route-level exception wrapper and exit stacks. On the embeddings route that was
a measurable share of the service's CPU per request (docs/PERF.md). A `BareRoute` runs a
`handler(request) -> Response` as a bare ASGI app instead. Matched before the router's FastAPI routes,
it takes their requests; those routes stay for the OpenAPI schema and as the reference path.

What the handler must not rely on, since FastAPI does not run around it: parameters other than the
Request (a `Header()` or `Depends()` would silently keep its default), dependencies, background
tasks. Its exceptions raise through to the app's exception handlers, as from a FastAPI route, with
one difference: a handler gets the Request the app's ExceptionMiddleware built, not the route's, so
it must not read the body (none does, app/errors.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

Handler = Callable[[Request], Awaitable[Response]]


class _Endpoint:
    """`handler` as an ASGI app: Starlette runs an endpoint that is not a function as one."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.handler(Request(scope, receive))
        await response(scope, receive, send)


class BareRoute(Route):
    """POST `path` served by `handler` as a bare ASGI app; not in the OpenAPI schema."""

    def __init__(self, path: str, handler: Handler, name: str) -> None:
        super().__init__(
            path, endpoint=_Endpoint(handler), methods=["POST"], name=name, include_in_schema=False
        )

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        # As FastAPI's routes do (its router leaves it to them): the request metrics label a request,
        # a 405 included, by scope["route"] (middleware.route_template).
        match, child_scope = super().matches(scope)
        if match is not Match.NONE:
            child_scope["route"] = self
        return match, child_scope
