"""The embeddings route's fast path (routes.BareEndpoint, matched before FastAPI's route of the same
paths) answers exactly as its reference, the FastAPI route: two live servers on the same fake engine,
one with the bare routes taken out, get the same requests, and must give the same status, headers and
body, success or error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.routes import BareEndpoint
from tests.support.fake_engine import FakeEngine, image_part, live, make_settings

# Headers that differ between any two answers: the request id, timings, the date.
VARYING = {"x-request-id", "x-queue-time-ms", "x-inference-time-ms", "date"}

CASES: list[tuple[str, str, dict[str, str], bytes]] = [
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
def servers() -> Iterator[tuple[str, str]]:
    settings = make_settings(max_request_items=8)
    with live(settings, FakeEngine()) as fast, live(settings, FakeEngine()) as reference:
        routes = reference.app.router.routes
        routes[:] = [r for r in routes if not isinstance(getattr(r, "endpoint", None), BareEndpoint)]
        assert len(routes) == len(fast.app.router.routes) - 2
        yield fast.url, reference.url


def answer(url: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], Any]:
    response = httpx.post(url + path, content=body, headers={"content-type": "application/json", **headers})
    kept = {k: v for k, v in response.headers.items() if k not in VARYING}
    return response.status_code, kept, response.json()


@pytest.mark.parametrize(("name", "path", "headers", "body"), CASES, ids=[c[0] for c in CASES])
def test_the_bare_route_answers_as_the_fastapi_route(
    servers: tuple[str, str], name: str, path: str, headers: dict[str, str], body: bytes
) -> None:
    fast, reference = servers
    assert answer(fast, path, headers, body) == answer(reference, path, headers, body)


def test_the_bare_route_serves_and_is_counted_under_its_route(servers: tuple[str, str]) -> None:
    fast, _ = servers
    assert httpx.get(fast + "/v1/embeddings").status_code == 405  # POST only, as the FastAPI route
    before = _served(fast)
    assert httpx.post(fast + "/v1/embeddings", json={"input": "a"}).status_code == 200
    assert _served(fast) == before + 1


def _served(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    prefix = 'eg2_requests_total{route="/v1/embeddings",status="200"}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))
