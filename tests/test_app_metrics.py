"""/metrics: parses with prometheus_client's own parser, has every documented family, and moves with traffic."""

from __future__ import annotations

import httpx
from fake_engine import FakeEngine, image_part, live, make_settings
from prometheus_client.parser import text_string_to_metric_families

FAMILIES = {
    "eg2_requests": "counter",
    "eg2_queue_depth": "gauge",
    "eg2_admitted_items": "gauge",
    "eg2_batch_size": "histogram",
    "eg2_batch_tokens": "histogram",
    "eg2_queue_seconds": "histogram",
    "eg2_preprocess_seconds": "histogram",
    "eg2_inference_seconds": "histogram",
    "eg2_tokens": "counter",
    "eg2_dropped_items": "counter",
    "eg2_batch_splits": "counter",
    "eg2_weight_bytes": "gauge",
    "eg2_gpu_memory_bytes": "gauge",
    "eg2_ready": "gauge",
}


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(r.text))
    types = {f.name: f.type for f in families}
    for name, kind in FAMILIES.items():
        assert types.get(name) == kind, (name, types.get(name))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(
        v for (n, ls), v in samples.items() if n == name and all((k, w) in ls for k, w in labels.items())
    )


def test_metrics_parse_and_move_with_traffic() -> None:
    engine = FakeEngine()
    with live(make_settings(), engine) as s, httpx.Client(base_url=s.url) as c:
        before = scrape(s.url)
        assert value(before, "eg2_ready") == 1
        assert value(before, "eg2_weight_bytes", kind="resident") == 1000
        assert value(before, "eg2_weight_bytes", kind="bf16_equivalent") == 4000
        assert value(before, "eg2_batch_size_count") == 0  # warm-up is not traffic

        texts = [c.post("/v1/embeddings", json={"input": ["one two", "three"]}) for _ in range(3)]
        image = c.post("/v1/embeddings", json={"input": [image_part()], "image_tokens": 70})
        c.post("/v1/embeddings", json={"input": "x", "dimensions": 7})
        c.get("/no-such-route")
        after = scrape(s.url)

        ok = value(after, "eg2_requests_total", route="/v1/embeddings", status="200")
        assert ok - value(before, "eg2_requests_total", route="/v1/embeddings", status="200") == 4
        assert value(after, "eg2_requests_total", route="/v1/embeddings", status="400") == 1
        assert value(after, "eg2_requests_total", route="unmatched", status="404") == 1
        text_tokens = sum(r.json()["usage"]["prompt_tokens"] for r in texts)
        assert value(after, "eg2_tokens_total", modality="text") == text_tokens
        assert value(after, "eg2_tokens_total", modality="image") == image.json()["usage"]["prompt_tokens"]
        assert value(after, "eg2_batch_size_sum", modality="text") == 6
        assert value(after, "eg2_preprocess_seconds_count", modality="text") == 6
        assert value(after, "eg2_queue_seconds_count", modality="image") == 1
        assert value(after, "eg2_inference_seconds_count") >= 2
        assert value(after, "eg2_batch_tokens_sum", modality="text") == text_tokens
        assert value(after, "eg2_admitted_items") == 0 and value(after, "eg2_queue_depth") == 0
