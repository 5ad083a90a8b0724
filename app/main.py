"""The application: `create_app(settings, engine=None)` wires settings, lifecycle, middleware, routes and errors.

Pass an engine to serve it (tests inject a fake one); without, the lifespan loads one from
`settings.model` (or the demo checkpoint) in the background once the server listens. Start it with
`eg2 serve` (app/cli.py -> app/server.py), which also turns SIGTERM into a graceful drain.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.middleware.cors import CORSMiddleware

from app.errors import install_error_handlers
from app.metrics import Metrics
from app.middleware import AuthMiddleware, BodyMiddleware, RequestContextMiddleware, public_paths
from app.routes import bare_routes, router
from app.schemas import EmbeddingRequest, TokenizeRequest
from app.service import Service
from app.settings import Settings
from eg2_runtime.api import EngineAPI


def create_app(settings: Settings, engine: EngineAPI | None = None) -> FastAPI:
    metrics = Metrics()
    service = Service(settings, metrics, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(
        title="eg2-serve",
        summary="OpenAI-compatible embeddings for EmbeddingGemma 2: text, images, audio and video",
        lifespan=lifespan,
        docs_url=None,  # no CDN-loaded pages; the schema itself is at /openapi.json (behind the key)
        redoc_url=None,
        # `/v1/models/` is a 404, not a 307 to `/v1/models`: Starlette builds that redirect's Location
        # from the client's Host header, so anyone could make this server answer with a link to theirs.
        # Clients call the documented paths; none relies on the redirect.
        redirect_slashes=False,
        # FastAPI's built-in OpenTelemetry hooks look up the global providers on every request
        # (~4% of the event loop's samples under load, py-spy); the service reports through its own
        # /metrics and logs.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.service = service
    install_error_handlers(app)
    app.include_router(router)
    app.router.routes[:0] = bare_routes()  # matched first: the hot route without FastAPI's handling

    # add_middleware wraps: the last added is the outermost.
    app.add_middleware(
        BodyMiddleware, max_bytes=settings.max_request_bytes, timeout_s=settings.body_read_timeout_s
    )
    if settings.api_key is not None:
        app.add_middleware(
            AuthMiddleware,
            api_key=settings.api_key.get_secret_value(),
            public_paths=public_paths(settings.metrics_require_key),
        )
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type", "x-request-id"],
            expose_headers=["x-request-id", "x-queue-time-ms", "x-inference-time-ms"],
        )
    app.add_middleware(
        RequestContextMiddleware, metrics=metrics, routes=app.routes, access_log=settings.access_log
    )

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            # The request bodies are parsed by hand (see routes.py); publish their schemas as components.
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (EmbeddingRequest, TokenizeRequest):
                request_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(request_schema.pop("$defs", {}))
                components[model.__name__] = request_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
