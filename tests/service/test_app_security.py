"""Security and hostile input at the HTTP edge: the API key on every route, CORS, no stack traces, logs
without secrets or media, and bodies that are too big, too slow or lying about their size."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.routing import iter_route_contexts

import app.middleware
from app.logs import JsonFormatter
from tests.support.fake_engine import (
    PREPARE_BUG,
    FakeEngine,
    LiveServer,
    assert_error,
    image_part,
    live,
    make_settings,
)

KEY = "sk-test-Secret-9f8e7d"
PUBLIC = {"/health", "/ready"}


@pytest.fixture(scope="module")
def keyed() -> Iterator[LiveServer]:
    settings = make_settings(api_key=KEY, max_request_bytes=64 * 1024, body_read_timeout_s=0.5)
    with live(settings, FakeEngine()) as s:
        yield s


def routes_of(server: LiveServer) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, read from its route table (included routers too)."""
    out = []
    for route in iter_route_contexts(server.app.routes):
        assert route.path is not None and "{" not in route.path, f"walk needs values for {route.path}"
        out += [(method, route.path) for method in sorted(route.methods or ()) if method != "HEAD"]
    return out


def test_route_table_is_what_we_think(keyed: LiveServer) -> None:
    paths = {p for _, p in routes_of(keyed)}
    assert {"/v1/embeddings", "/embeddings", "/v1/models", "/health", "/ready", "/metrics", "/info"} <= paths


def test_every_route_but_probes_requires_the_key(keyed: LiveServer) -> None:
    """Walks the route table: a route added later is covered without anyone listing it here."""
    routes = routes_of(keyed)
    assert len(routes) >= 8
    with httpx.Client(base_url=keyed.url) as c:
        for method, path in routes:
            body = {"json": {"input": "x"}} if method == "POST" else {}
            for headers in (
                {},
                {"authorization": "Bearer wrong"},
                {"authorization": KEY},
                {"authorization": f"Basic {KEY}"},
            ):
                r = c.request(method, path, headers=headers, **body)
                if path in PUBLIC:
                    assert r.status_code == 200, (method, path, headers)
                else:
                    assert_error(r, 401, "authentication_error")
                    assert r.headers["www-authenticate"] == "Bearer"
            good = c.request(method, path, headers={"authorization": f"Bearer {KEY}"}, **body)
            assert good.status_code == 200, (method, path, good.text)
        # Unknown paths too: the key is checked before routing.
        assert_error(c.get("/v1/secret-new-route"), 401, "authentication_error")
        assert_error(
            c.get("/v1/secret-new-route", headers={"authorization": f"Bearer {KEY}"}),
            404,
            "invalid_request_error",
        )


def test_openai_sdk_with_key(keyed: LiveServer) -> None:
    import openai

    with openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0) as good:
        assert len(good.embeddings.create(model="eg2", input="x").data) == 1
    with (
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError) as info,
    ):
        bad.embeddings.create(model="eg2", input="x")
    assert info.value.status_code == 401 and info.value.code == "authentication_error"


def test_metrics_follows_its_setting() -> None:
    with live(make_settings(api_key=KEY, metrics_require_key=False)) as s:
        assert httpx.get(s.url + "/metrics").status_code == 200
        assert httpx.get(s.url + "/info").status_code == 401


def test_key_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = app.middleware.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app.middleware.hmac, "compare_digest", spy)
    auth = app.middleware.AuthMiddleware(None, api_key=KEY, public_paths=frozenset())  # type: ignore[arg-type]
    for header in (f"Bearer {KEY}", "Bearer x", "Bearer " + "y" * 5000, "", None, f"Token {KEY}"):
        auth.authorized(header)
    assert len(calls) == 6, "every attempt goes through compare_digest"
    assert {len(a) for a, _ in calls} == {32}, "digests: the compared length never depends on the input"
    assert auth.authorized(f"Bearer {KEY}") and auth.authorized(f"bearer  {KEY} ")
    assert not auth.authorized(f"Token {KEY}") and not auth.authorized(KEY)


def test_cors_off_by_default_on_when_configured() -> None:
    preflight = {"origin": "https://evil.example", "access-control-request-method": "POST"}
    with live(make_settings()) as s:
        r = httpx.options(s.url + "/v1/embeddings", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        r = httpx.post(
            s.url + "/v1/embeddings", json={"input": "x"}, headers={"origin": "https://evil.example"}
        )
        assert "access-control-allow-origin" not in r.headers
    with live(make_settings(cors_origins="https://app.example", api_key=KEY)) as s:
        ok = {"origin": "https://app.example", "access-control-request-method": "POST"}
        r = httpx.options(
            s.url + "/v1/embeddings", headers=ok | {"access-control-request-headers": "authorization"}
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert (
            "access-control-allow-origin"
            not in httpx.options(s.url + "/v1/embeddings", headers=preflight).headers
        )


def test_500_has_no_stack_trace_and_the_log_has_it(
    keyed: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    r = httpx.post(
        keyed.url + "/v1/embeddings",
        json={"input": PREPARE_BUG},
        headers={"authorization": f"Bearer {KEY}", "x-request-id": "trace-500"},
    )
    error = assert_error(r, 500, "internal_error")
    assert "trace-500" in error["message"] and "RuntimeError" not in r.text
    logged = [json.loads(JsonFormatter().format(rec)) for rec in caplog.records if rec.exc_info]
    assert any(e.get("request_id") == "trace-500" and "Traceback" in e["exc"] for e in logged), logged


def test_logs_never_contain_the_key_or_media(keyed: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    marker = b"MEDIA-BYTES-THAT-MUST-NOT-BE-LOGGED"
    part = image_part(b"\x89PNG" + marker)
    url = keyed.url + "/v1/embeddings"
    good = {"authorization": f"Bearer {KEY}"}
    httpx.post(url, json={"input": [part]}, headers=good)  # success
    httpx.post(url, json={"input": [part]}, headers={"authorization": f"Bearer {KEY}x"})  # wrong key
    bad_uri = part["image_url"]["url"].replace("base64,", "base64,@")
    httpx.post(url, json={"input": [{"type": "image_url", "image_url": {"url": bad_uri}}]}, headers=good)
    httpx.post(url, json={"input": [part, PREPARE_BUG]}, headers=good)  # 500 with a traceback
    httpx.post(url, json={"input": [part], "dimensions": 5}, headers=good)  # validation error
    text = "\n".join(JsonFormatter().format(rec) for rec in caplog.records)
    assert caplog.records, "nothing logged"
    encoded = part["image_url"]["url"].split(",", 1)[1]
    for secret in (KEY, marker.decode(), encoded[:40], encoded[-40:]):
        assert secret not in text, f"{secret[:20]}... leaked into the logs"


# --- raw HTTP: sizes, timing, framing --------------------------------------------------------------


def raw(server: LiveServer, request: bytes, *, timeout: float = 5) -> tuple[bytes, float]:
    """Send bytes, read the answer until the server closes (or the timeout); (answer, seconds)."""
    assert server.server is not None
    with socket.create_connection(("127.0.0.1", server.server.port), timeout=timeout) as sock:
        start = time.monotonic()
        sock.sendall(request)
        chunks = []
        with contextlib.suppress(TimeoutError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks), time.monotonic() - start


def head(length: int | str, extra: str = "") -> bytes:
    return (
        f"POST /v1/embeddings HTTP/1.1\r\nhost: t\r\nauthorization: Bearer {KEY}\r\n"
        f"content-type: application/json\r\ncontent-length: {length}\r\n{extra}\r\n"
    ).encode()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def body_of(answer: bytes) -> dict[str, Any]:
    return dict(json.loads(answer.split(b"\r\n\r\n", 1)[1]))


def test_oversized_content_length_gets_413_before_the_body(keyed: LiveServer) -> None:
    answer, seconds = raw(keyed, head(10 * 1024 * 1024))  # announces 10 MiB, sends none of it
    assert status_of(answer) == 413 and seconds < 1
    assert body_of(answer)["error"]["type"] == "request_too_large"
    assert b"connection: close" in answer.lower()


def test_chunked_body_over_the_limit_gets_413_while_streaming(keyed: LiveServer) -> None:
    """No Content-Length to go by: the limit is counted as chunks arrive, and the body is never ended."""
    assert keyed.server is not None
    with socket.create_connection(("127.0.0.1", keyed.server.port), timeout=5) as sock:
        sock.sendall(
            f"POST /v1/embeddings HTTP/1.1\r\nhost: t\r\nauthorization: Bearer {KEY}\r\n"
            "content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n".encode()
        )
        chunk = b"x" * 16384
        start = time.monotonic()
        for _ in range(5):  # 80 KiB > 64 KiB, paced so the server reads each chunk as it comes
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            time.sleep(0.02)
        answer = sock.recv(65536)
        assert status_of(answer) == 413 and time.monotonic() - start < 2
        assert sock.recv(65536) == b"", "the server closes the connection"


def test_slow_body_is_cut_off(keyed: LiveServer) -> None:
    assert keyed.server is not None
    with socket.create_connection(("127.0.0.1", keyed.server.port), timeout=5) as sock:
        start = time.monotonic()
        sock.sendall(head(100))
        for _ in range(3):  # slowloris: a byte now and then, never the whole body
            sock.sendall(b" ")
            time.sleep(0.2)
        answer = sock.recv(65536)
        seconds = time.monotonic() - start
    assert status_of(answer) == 408 and seconds < 2
    assert body_of(answer)["error"]["type"] == "request_timeout"


def test_lying_content_length(keyed: LiveServer) -> None:
    body = b'{"input": "x"}'
    answer, seconds = raw(keyed, head(len(body) + 50) + body)  # promises more than it sends
    assert status_of(answer) == 408 and seconds < 2
    answer, _ = raw(keyed, head(5, "connection: close\r\n") + body)  # says less: the body is cut, not JSON
    assert status_of(answer) == 400
    answer, _ = raw(keyed, head("12abc") + body)
    assert status_of(answer) == 400


def test_ten_thousand_items_and_big_json(keyed: LiveServer) -> None:
    with live(make_settings(max_request_bytes=1 << 20)) as s:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": ["x"] * 10_000})
        assert "10000" in assert_error(r, 413, "request_too_large", "input")["message"]
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "ok"}).status_code == 200


def test_server_keeps_serving_after_hostile_input(keyed: LiveServer) -> None:
    r = httpx.post(
        keyed.url + "/v1/embeddings", json={"input": "fine"}, headers={"authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200
