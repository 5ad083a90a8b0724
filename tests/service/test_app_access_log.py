"""The access log (settings.access_log): one info line per request when on, none when off, while the
request counters in /metrics count either way."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.support.fake_engine import FakeEngine, live, make_settings


def embedded_200s(url: str) -> float:
    prefix = 'eg2_requests_total{route="/v1/embeddings",status="200"}'
    return sum(
        float(line.split()[-1])
        for line in httpx.get(url + "/metrics").text.splitlines()
        if line.startswith(prefix)
    )


@pytest.mark.parametrize("on", [True, False])
def test_the_access_log_follows_its_setting(caplog: pytest.LogCaptureFixture, on: bool) -> None:
    caplog.set_level(logging.INFO, logger="eg2.access")
    with live(make_settings(access_log=on), FakeEngine(modalities=("text",))) as s:
        caplog.clear()
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "a"}, headers={"x-request-id": "req-7"})
        assert r.status_code == 200
        assert embedded_200s(s.url) == 1
    lines = [
        rec for rec in caplog.records if rec.name == "eg2.access" and rec.getMessage().startswith("POST")
    ]
    if on:
        assert [(rec.getMessage(), getattr(rec, "request_id", None)) for rec in lines] == [
            ("POST /v1/embeddings 200", "req-7")
        ]
    else:
        assert lines == []
