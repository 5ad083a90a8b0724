"""The endpoints: validate -> service -> response, no logic of their own.

Every route is behind the API key (app/middleware.py) except /health and /ready, and /metrics when
the operator says so. Errors are raised, never returned: app/errors.py answers them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Coroutine
from typing import Annotated, Any, Literal, TypeVar, cast

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

import eg2_runtime
from app.bare_route import BareRoute
from app.errors import ClientGone, Unavailable, error_body
from app.media import MediaResolver
from app.schemas import (
    EmbeddingResponse,
    ErrorBody,
    ModelCard,
    ModelList,
    SegmentRows,
    TokenizeData,
    TokenizePart,
    TokenizeRequest,
    TokenizeResponse,
    TokenizeSegment,
    Usage,
    encode_embeddings,
    parse_body,
    parse_request,
)
from app.service import Service, State
from eg2_runtime.api import matryoshka
from eg2_runtime.errors import InputError
from eg2_runtime.inputs import MATRYOSHKA_DIMS, MediaKind

T = TypeVar("T")
router = APIRouter()


def service_of(request: Request) -> Service:
    return cast(Service, request.app.state.service)


async def get_service(request: Request) -> Service:
    # async: FastAPI runs a plain `def` dependency on its thread pool, a thread hop per request.
    return service_of(request)


ServiceDep = Annotated[Service, Depends(get_service)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": what}
    for status, what in {
        400: "invalid request",
        401: "missing or wrong API key",
        404: "unknown model",
        413: "request too large",
        415: "a Content-Encoding other than identity: bodies are not decompressed",
        429: "overloaded, see Retry-After",
        503: "loading, draining, timed out or engine failure",
    }.items()
}
# The body is parsed by the route itself (pydantic's JSON parser, with the item limit as context);
# this documents it in the OpenAPI schema. main.py adds the referenced component.
_EMBEDDING_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/EmbeddingRequest"}}},
    }
}
_TOKENIZE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TokenizeRequest"}}},
    }
}
# The runtime's media kinds -> the part types a request names them by.
PART_TYPES: dict[MediaKind, Literal["image_url", "input_audio", "video_url"]] = {
    "image": "image_url",
    "audio": "input_audio",
    "video": "video_url",
}


def _check_json(content_type: str | None) -> None:
    media_type = (content_type or "application/json").split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise InputError("the request body must be JSON (Content-Type: application/json)")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work` in this request's own task; a watcher cancels that task if the client goes away
    first (its items never reach the GPU). One extra task a request, not two and an asyncio.wait."""
    route = asyncio.current_task()
    assert route is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _wait_disconnect(request)
        gone = True
        route.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise  # cancelled from outside (shutdown): not ours to turn into an error
        route.uncancel()
        raise ClientGone("the client disconnected") from None
    finally:
        watcher.cancel()


@router.post(
    "/v1/embeddings",
    response_model=EmbeddingResponse,
    responses=_ERRORS,
    openapi_extra=_EMBEDDING_BODY,
    summary="Embed text, images, audio and video",
)
@router.post("/embeddings", response_model=EmbeddingResponse, include_in_schema=False)
async def create_embeddings(request: Request) -> Response:
    # Also served by a BareRoute (bare_routes): the Request is its only parameter, and it uses no
    # FastAPI dependency (app/bare_route.py).
    # The service read here, not injected: FastAPI's dependency solving, per request, is a
    # measurable share of the service's own CPU on its hot routes (docs/PERF.md).
    service = service_of(request)
    service.check_ready()
    _check_json(request.headers.get("content-type"))
    body = parse_request(await request.body(), max_items=service.settings.max_request_items)
    service.check_model(body.model)
    options = service.prepare_options(body)
    items = await MediaResolver(service.settings, service.engine.modalities).items(body)
    result = await _unless_disconnected(request, service.embed(items, options))
    dim = body.dimensions
    cut = (lambda v: v) if dim is None or dim == result.vectors.shape[1] else (lambda v: matryoshka(v, dim))
    content = encode_embeddings(
        cut(result.vectors),
        encoding_format=body.encoding_format,
        model=service.settings.served_name,
        num_tokens=result.num_tokens,
        embedding_type=body.embedding_type,
        segments={
            i: SegmentRows([(span.start, span.end) for span in spans], cut(rows))
            for i, (spans, rows) in result.segments.items()
        },
    )
    headers = {
        "x-queue-time-ms": f"{result.queue_s * 1000:.2f}",
        "x-inference-time-ms": f"{result.inference_s * 1000:.2f}",
    }
    return Response(content, media_type="application/json", headers=headers)


def bare_routes() -> list[BareRoute]:
    """POST /v1/embeddings and /embeddings without FastAPI's request handling (app/bare_route.py), for
    create_app to match before the router's FastAPI routes of the same paths; those stay, for the
    OpenAPI schema and as the reference path (tests/service/test_app_bare_route.py)."""
    return [
        BareRoute(path, create_embeddings, name=f"create_embeddings_bare{path.replace('/', '_')}")
        for path in ("/v1/embeddings", "/embeddings")
    ]


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    response_model_exclude_none=True,
    responses=_ERRORS,
    openapi_extra=_TOKENIZE_BODY,
    summary="Count each item's tokens as an embeddings request would, without running the model",
)
async def tokenize(request: Request) -> TokenizeResponse:
    service = service_of(request)
    service.check_ready()
    _check_json(request.headers.get("content-type"))
    body = parse_body(await request.body(), TokenizeRequest, max_items=service.settings.max_request_items)
    service.check_model(body.model)
    options = service.prepare_options(body)
    items = await MediaResolver(service.settings, service.engine.modalities).items(body)
    counts = await _unless_disconnected(request, service.tokenize(items, options))
    data = [
        TokenizeData(
            index=i,
            tokens=c.tokens,
            truncated=c.truncated,
            ids=list(c.ids) if c.ids is not None else None,
            parts=[TokenizePart(type=PART_TYPES[kind], tokens=n) for kind, n in c.parts] or None,
            segments=[TokenizeSegment(start=s.start, end=s.end, tokens=n) for s, n in c.spans] or None,
        )
        for i, c in enumerate(counts)
    ]
    total = sum(c.tokens for c in counts)
    return TokenizeResponse(
        model=service.settings.served_name, data=data, usage=Usage(prompt_tokens=total, total_tokens=total)
    )


@router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
async def list_models(service: ServiceDep) -> ModelList:
    card = ModelCard(id=service.settings.served_name, created=service.started_at, owned_by="eg2-serve")
    return ModelList(data=[card])


@router.get("/health", responses={503: {"model": ErrorBody}})
async def health(service: ServiceDep) -> JSONResponse:
    problem = service.health_problem()
    if problem is not None:
        return JSONResponse(error_body(problem, "unavailable"), status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready", responses={503: {"model": ErrorBody}})
async def ready(service: ServiceDep) -> JSONResponse:
    if service.state is not State.READY:
        return JSONResponse(error_body(f"not ready: {service.state.value}", "unavailable"), status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(service: ServiceDep) -> Response:
    service.refresh_metrics()
    return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/info", responses=_ERRORS)
async def info(service: ServiceDep) -> dict[str, Any]:
    if service.state is State.LOADING:
        raise Unavailable("the model is loading; retry shortly")
    s = service.settings
    engine = service.engine
    return {
        "model": s.served_name,
        "aliases": s.aliases,
        "demo": service.demo,
        "state": service.state.value,
        "version": eg2_runtime.__version__,
        "modalities": sorted(engine.modalities),
        "dimensions": sorted(MATRYOSHKA_DIMS),
        "prompts": sorted(engine.prompts),
        "max_text_tokens": engine.max_text_tokens,
        "limits": {
            "max_batch_tokens": service.batch_tokens(),
            "max_prepared_media_tokens": service.prepared_media_tokens(),
            "max_batch_items": s.max_batch_items,
            "max_queued_items": s.max_queued_items,
            "max_request_items": s.max_request_items,
            "max_request_bytes": s.max_request_bytes,
            "max_item_parts": s.max_item_parts,
            "max_request_media": s.max_request_media,
            "max_request_tokens": s.max_request_tokens,
            **dataclasses.asdict(s.media_limits()),
            "request_timeout_s": s.request_timeout_s,
        },
        "process": {"gil_switch_interval_ms": round(sys.getswitchinterval() * 1000, 6)},
        "engine": engine.info(),
        "memory": engine.memory(),
        "graphs": engine.graph_stats(),
    }
