"""Connection-level defences, before a request reaches the app: how long and how large a request's
headers may be, how many connections may be open, and what the server writes about a client.

Each test reproduces one finding of issue 13 (probe of 2026-12-01 on the tiny model) at small scale,
with the fake engine: the engine is not the point of any of them. The cases that need the server's own
process (a file-descriptor limit) run tests/fake_engine.py as a script.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from fake_engine import assert_error, live, make_settings

from app.logs import JsonFormatter, TextFormatter

KEY = "k-connections"


def test_a_trailing_slash_is_not_redirected_to_the_clients_host() -> None:
    """Starlette answered `/v1/models/` with a 307 whose Location was built from the Host header the
    client sent: a link to any host, from this server. Now a 404 with the error body, and no Location."""
    with live() as s, httpx.Client(base_url=s.url) as c:
        for method, path in (("GET", "/v1/models/"), ("POST", "/v1/embeddings/"), ("GET", "/health/")):
            r = c.request(method, path, headers={"host": "evil.example"}, json={"input": "x"})
            assert "location" not in r.headers, (path, r.status_code, r.headers)
            assert_error(r, 404, "invalid_request_error")
            assert "evil.example" not in r.text


def test_log_lines_are_clipped_whatever_the_client_sent(caplog: pytest.LogCaptureFixture) -> None:
    """An unauthenticated request with a 20,000-character path (under the header limit) was logged
    whole. Every line, in both log formats, now stays under 1,500 characters (a message is clipped at 1,024)."""
    caplog.set_level(logging.DEBUG)
    path = "/v1/" + "p" * 20_000
    with live(make_settings(api_key=KEY)) as s, httpx.Client(base_url=s.url) as c:
        assert_error(c.get(path), 401, "authentication_error")
        assert_error(
            c.post(path, json={"input": "x"}, headers={"x-request-id": "r" * 128}),
            401,
            "authentication_error",
        )
    mine = [r for r in caplog.records if r.name.startswith("eg2")]
    assert any(path[:200] in r.getMessage() for r in mine), "the request was not logged at all"
    for formatter in (JsonFormatter(), TextFormatter()):
        for record in mine:
            line = formatter.format(record)
            assert len(line) < 1_500, f"{type(formatter).__name__}: a {len(line)}-character line"
            assert "p" * 1_100 not in line
    entry = json.loads(JsonFormatter().format(mine[-1]))
    assert "more characters]" in entry["msg"], entry["msg"][-80:]
