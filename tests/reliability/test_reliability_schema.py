"""schemathesis against the app's own OpenAPI schema: the real engine on the tiny checkpoint, a real
uvicorn on loopback, an API key set as in production.

Every operation of the published schema gets schema-driven cases, valid and invalid (schemathesis's
examples, coverage and fuzzing phases), bounded by max_examples and derandomized. Each answer must: not
be a 5xx; have a status the schema documents; match the documented response schema, content type and
headers; reject schema-invalid data with a 4xx; and leak nothing (no traceback, no server path) while
carrying a request id.

One default check is off: `positive_data_acceptance`. Whether a schema-valid request is accepted
depends on things no JSON Schema can say (whether a data: URI decodes as an image, which prompt names
the loaded model has), so schema-valid requests are rightly refused with 400.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from app.main import create_app
from eg2_runtime.engine import Engine
from tests.support.fake_engine import LiveServer, live, make_settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

KEY = "sk-schemathesis-7c1e"
APP = create_app(make_settings())
SCHEMA = schemathesis.openapi.from_dict(APP.openapi())
LEAKS = ("Traceback", 'File "', "/work/", "site-packages", ".py", "/tmp/")


@pytest.fixture(scope="module")
def server(tiny_bf16: Path) -> Iterator[LiveServer]:
    settings_ = make_settings(
        api_key=KEY, max_request_bytes=1 << 20, max_request_items=64, max_batch_tokens=2048
    )
    engine = Engine.from_dir(tiny_bf16, device="cpu", limits=settings_.media_limits())
    with live(settings_, engine, ready_timeout=120) as s:
        yield s


def leaks_nothing(ctx: Any, response: Any, case: Any) -> None:
    text = response.text or ""
    for needle in LEAKS:
        assert needle not in text, f"the answer contains {needle!r}: {text[:300]}"
    assert response.headers.get("x-request-id"), "no x-request-id"


def test_the_schema_covers_every_route() -> None:
    """So the fuzz below reaches every route the app serves (aliases and the schema itself aside)."""
    served = {getattr(r, "path", None) for r in APP.routes} - {"/embeddings", "/openapi.json", None}
    assert served <= set(SCHEMA.raw_schema["paths"]), served - set(SCHEMA.raw_schema["paths"])


@pytest.mark.slow
@SCHEMA.parametrize()
@settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
def test_api_conforms_to_its_schema(case: Any, server: LiveServer) -> None:
    case.call_and_validate(
        base_url=server.url,
        headers={"authorization": f"Bearer {KEY}"},
        excluded_checks=[positive_data_acceptance],
        additional_checks=[leaks_nothing],
        timeout=60,
    )
