"""The embeddings route's fast path (app/bare_route.py, matched before FastAPI's route of the same
paths) answers exactly as its reference, the FastAPI route: two live servers, each on a fake engine,
one built without the bare routes, get the same requests, and must give the same status, headers and
body, success or error. And the fast path is the one that serves."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match

import app.main
from app.bare_route import BareRoute
from tests.support.fake_engine import FakeEngine, image_part, live, make_settings

# Headers that differ between any two answers: the request id, timings, the date.
VARYING = {"x-request-id", "x-queue-time-ms", "x-inference-time-ms", "date"}

POSTS: list[tuple[str, str, dict[str, str], bytes]] = [
    ("one text", "/v1/embeddings", {}, json.dumps({"input": "a river", "model": "eg2"}).encode()),
    (
        "texts, base64, 256 dims",
        "/v1/embeddings",
        {},
        json.dumps({"input": ["a", "b c"], "encoding_format": "base64", "dimensions": 256}).encode(),
    ),
    (
        "an image and a text",
        "/v1/embeddings",
        {},
        json.dumps({"input": [image_part(), "the stone"]}).encode(),
    ),
    ("the unversioned alias", "/embeddings", {}, json.dumps({"input": "north"}).encode()),
    ("not JSON", "/v1/embeddings", {}, b"{not json"),
    ("unknown model", "/v1/embeddings", {}, json.dumps({"input": "a", "model": "gpt-4"}).encode()),
    ("unknown field", "/v1/embeddings", {}, json.dumps({"input": "a", "colour": "red"}).encode()),
    ("wrong dimensions", "/v1/embeddings", {}, json.dumps({"input": "a", "dimensions": 300}).encode()),
    ("empty input", "/v1/embeddings", {}, json.dumps({"input": []}).encode()),
    ("too many items", "/v1/embeddings", {}, json.dumps({"input": ["a"] * 9}).encode()),
    ("not JSON content type", "/v1/embeddings", {"content-type": "text/plain"}, b'{"input": "a"}'),
]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Any, Any]]:
    settings = make_settings(max_request_items=8)
    with live(settings, FakeEngine()) as fast, pytest.MonkeyPatch.context() as patch:
        patch.setattr(app.main, "bare_routes", list)  # the reference: FastAPI's routes alone
        with live(settings, FakeEngine()) as reference:
            assert not any(isinstance(r, BareRoute) for r in reference.app.router.routes)
            yield fast, reference


def answer(
    url: str, method: str, path: str, headers: dict[str, str], body: bytes
) -> tuple[int, dict[str, str], str]:
    response = httpx.request(
        method, url + path, content=body, headers={"content-type": "application/json", **headers}
    )
    kept = {k: v for k, v in response.headers.items() if k not in VARYING}
    return response.status_code, kept, response.text


@pytest.mark.parametrize(("name", "path", "headers", "body"), POSTS, ids=[c[0] for c in POSTS])
def test_the_bare_route_answers_as_the_fastapi_route(
    servers: tuple[Any, Any], name: str, path: str, headers: dict[str, str], body: bytes
) -> None:
    fast, reference = servers
    assert answer(fast.url, "POST", path, headers, body) == answer(reference.url, "POST", path, headers, body)


@pytest.mark.parametrize("method", ["GET", "HEAD", "PUT", "OPTIONS"])
def test_other_methods_get_the_same_405(servers: tuple[Any, Any], method: str) -> None:
    fast, reference = servers
    got = answer(fast.url, method, "/v1/embeddings", {}, b"")
    assert got[0] == 405 and got == answer(reference.url, method, "/v1/embeddings", {}, b"")


def test_the_bare_route_is_the_one_serving_and_counted_under_its_path(
    servers: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, _ = servers
    served: list[str] = []
    for route in fast.app.router.routes:
        if isinstance(route, BareRoute):
            endpoint: Any = route.endpoint

            async def counting(request: Request, handler: Any = endpoint.handler) -> Response:
                served.append(request.url.path)
                response: Response = await handler(request)
                return response

            monkeypatch.setattr(endpoint, "handler", counting)
    before = _served(fast.url, "/v1/embeddings"), _served(fast.url, "/embeddings")
    for path in ("/v1/embeddings", "/embeddings"):
        assert httpx.post(fast.url + path, json={"input": "a"}).status_code == 200
    assert served == ["/v1/embeddings", "/embeddings"]
    assert (_served(fast.url, "/v1/embeddings"), _served(fast.url, "/embeddings")) == (
        before[0] + 1,
        before[1] + 1,
    )


def _served(url: str, route: str) -> float:
    prefix = f'eg2_requests_total{{route="{route}",status="200"}}'
    return sum(
        float(line.split()[-1])
        for line in httpx.get(url + "/metrics").text.splitlines()
        if line.startswith(prefix)
    )


@pytest.mark.parametrize(("method", "match"), [("POST", Match.FULL), ("GET", Match.PARTIAL)])
def test_a_bare_route_names_itself_in_the_scope(method: str, match: Match) -> None:
    """As FastAPI's routes do, on a 405 too: the request metrics label by scope["route"]."""

    async def handler(request: Request) -> Response:
        return Response()

    route = BareRoute("/v1/embeddings", handler, name="embeddings")
    scope = {"type": "http", "method": method, "path": "/v1/embeddings", "root_path": ""}
    got, child = route.matches(scope)
    assert got is match and child["route"] is route
