"""/metrics: parses with prometheus_client's own parser, has every documented family (the process's own
included), moves with traffic, and labels every answered request with its route."""

from __future__ import annotations

import os
import resource
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from eg2_runtime.api import EngineGraphs, EngineMemory
from tests.support.fake_engine import FakeEngine, image_part, live, make_settings

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
    "eg2_malloc_trim_seconds": "histogram",
    "eg2_weight_bytes": "gauge",
    "eg2_gpu_memory_bytes": "gauge",
    "eg2_cuda_graph_buckets": "gauge",
    "eg2_cuda_graph_capture_seconds": "counter",
    "eg2_cuda_graph_pool_bytes": "gauge",
    "eg2_ready": "gauge",
    "process_resident_memory_bytes": "gauge",
    "process_open_fds": "gauge",
    "process_cpu_seconds": "counter",
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


def test_requests_refused_before_routing_count_under_their_route() -> None:
    """401 (no key), 413 (body over the limit) and 408 (body too slow) are answered by middleware in
    front of the router; they are counted under the route they were for, as a 400 from the route
    itself is. `unmatched` is kept for paths no route serves."""
    settings = make_settings(api_key="k", max_request_bytes=1024, body_read_timeout_s=0.3)
    key = {"authorization": "Bearer k"}
    with live(settings) as s, httpx.Client(base_url=s.url) as c:
        assert c.post("/v1/embeddings", json={"input": "x"}).status_code == 401
        assert c.get("/v1/models").status_code == 401
        assert c.post("/embeddings", content=b"x" * 2048, headers=key).status_code == 413
        assert c.get("/nowhere", headers=key).status_code == 404
        assert c.get("/nowhere").status_code == 401
        with socket.create_connection(("127.0.0.1", int(s.url.rsplit(":", 1)[1])), timeout=5) as sock:
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: t\r\nauthorization: Bearer k\r\n")
            sock.sendall(b"content-length: 100\r\n\r\n{")  # and never the rest
            assert sock.recv(4096).startswith(b"HTTP/1.1 408")
        samples = {
            (n, ls): v for (n, ls), v in scrape_with(c, key).items() if n == "eg2_requests_total" and v
        }
    counted = {(dict(ls)["route"], dict(ls)["status"]): v for (_, ls), v in samples.items()}
    assert counted == {
        ("/v1/embeddings", "401"): 1,
        ("/v1/models", "401"): 1,
        ("/embeddings", "413"): 1,
        ("/v1/embeddings", "408"): 1,
        ("unmatched", "404"): 1,
        ("unmatched", "401"): 1,
    }, counted


def scrape_with(
    c: httpx.Client, headers: dict[str, str]
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = c.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(r.text)
        for s in f.samples
    }


def _proc_status_kb(field: str) -> int:
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(field + ":"))
    return int(line.split()[1])


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="the process collector reads /proc")
def test_process_memory_descriptors_and_cpu_are_exported() -> None:
    """prometheus_client's process collector on the app's own registry. The server here runs in this
    test's process, so its figures are this process's: compared with /proc/self, and the descriptor
    gauge must rise with 40 more connections (80 descriptors here: both ends live in this process)."""
    with live() as s:
        before = scrape(s.url)
        fds_now = len(os.listdir("/proc/self/fd"))
        assert abs(value(before, "process_open_fds") - fds_now) <= 8, (
            value(before, "process_open_fds"),
            fds_now,
        )
        rss = value(before, "process_resident_memory_bytes")
        assert 0.8 < rss / (_proc_status_kb("VmRSS") * 1024) < 1.25, rss
        cpu = value(before, "process_cpu_seconds_total")
        times = os.times()
        assert 0 < cpu <= times.user + times.system + 0.5, (cpu, times)
        assert value(before, "process_max_fds") == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        port = int(s.url.rsplit(":", 1)[1])
        socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(40)]
        try:
            time.sleep(0.2)  # the server accepts them
            after = scrape(s.url)
        finally:
            for sock in socks:
                sock.close()
        grew = value(after, "process_open_fds") - value(before, "process_open_fds")
        assert 70 <= grew <= 90, f"40 connections moved process_open_fds by {grew:g} (expected ~80)"


class GpuReportingEngine(FakeEngine):
    """The fake engine, reporting memory as Engine.memory() does on a GPU."""

    def memory(self) -> EngineMemory:  # type: ignore[override]
        mib = 1 << 20
        return {
            "weight_bytes_resident": 1000,
            "weight_bytes_bf16_equivalent": 4000,
            "process_gpu_bytes": 1500 * mib,
            "gpu_budget_bytes": 2000 * mib,
            "gpu_allocated_bytes": 900 * mib,
            "gpu_reserved_bytes": 1100 * mib,
        }


def test_gpu_memory_gauges_carry_the_engines_report() -> None:
    """eg2_gpu_memory_bytes{kind}: the process's own GPU memory beside the budget and the allocator's
    counters, each read from the engine's report under its own key."""
    with live(make_settings(), GpuReportingEngine()) as s:
        samples = scrape(s.url)
    for kind, mib in (("process", 1500), ("budget", 2000), ("allocated", 900), ("reserved", 1100)):
        assert value(samples, "eg2_gpu_memory_bytes", kind=kind) == mib << 20, (kind, samples)


class GraphReportingEngine(FakeEngine):
    """The fake engine, reporting graph buckets as Engine.graph_stats() does on a GPU; each call
    (a scrape) one more first-use capture."""

    def __init__(self) -> None:
        super().__init__()
        self.captures = 18
        self.budget = 474 << 20

    def graph_stats(self) -> EngineGraphs:  # type: ignore[override]
        self.captures += 1
        return {
            "captured": self.captures,
            "refused": 2,
            "deferred": 1,
            "capture_seconds": 0.25 * self.captures,
            "pool_used_bytes": 300 << 20,
            "pool_budget_bytes": self.budget,
        }


def test_graph_families_carry_the_engines_report_at_each_scrape() -> None:
    """eg2_cuda_graph_buckets{state}, eg2_cuda_graph_capture_seconds_total and
    eg2_cuda_graph_pool_bytes{kind}: one report of the engine's read at each scrape (a capture between
    two scrapes shows), the pool's budget left out where it has none."""
    engine = GraphReportingEngine()
    with live(make_settings(), engine) as s:
        first = scrape(s.url)
        second = scrape(s.url)
        engine.budget = 0
        unbounded = scrape(s.url)
    captured = value(second, "eg2_cuda_graph_buckets", state="captured")
    assert captured == value(first, "eg2_cuda_graph_buckets", state="captured") + 1
    assert value(second, "eg2_cuda_graph_buckets", state="refused") == 2
    assert value(second, "eg2_cuda_graph_buckets", state="deferred") == 1
    assert value(second, "eg2_cuda_graph_capture_seconds_total") == 0.25 * captured  # the same report's
    assert value(second, "eg2_cuda_graph_pool_bytes", kind="used") == 300 << 20
    assert value(second, "eg2_cuda_graph_pool_bytes", kind="budget") == 474 << 20
    assert ("eg2_cuda_graph_pool_bytes", (("kind", "budget"),)) not in unbounded
    assert value(unbounded, "eg2_cuda_graph_pool_bytes", kind="used") == 300 << 20


def test_media_preparing_processes_where_there_are_media_to_prepare() -> None:
    """Service.prepare_processes: none for a text-only engine, whatever the setting; the setting
    otherwise; unset, one per two usable cores (at most 8) on a GPU and none on a CPU."""
    from app.metrics import Metrics
    from app.service import Service

    def count(engine: FakeEngine, **settings: Any) -> int:
        service = Service(make_settings(**settings), Metrics(), engine=engine)
        service._engine = engine
        return service.prepare_processes()

    from app.cores import usable_cores

    cores = usable_cores()
    assert count(GpuReportingEngine(modalities=("text",)), preprocess_processes=4) == 0
    assert count(GpuReportingEngine(), preprocess_processes=3) == 3
    assert count(GpuReportingEngine(), preprocess_processes=None) == max(1, min(8, cores // 2))
    assert count(FakeEngine(), preprocess_processes=None) == 0


def test_usable_cores_read_the_cgroup_quota(tmp_path: Path) -> None:
    """A container's CPU quota caps the cores the default process count is sized from."""
    from app.cores import usable_cores

    affinity = len(os.sched_getaffinity(0))
    quota = tmp_path / "cpu.max"
    for text, want in (("max 100000", affinity), ("150000 100000", min(affinity, 1)), ("", affinity)):
        quota.write_text(text)
        assert usable_cores(quota) == want, text
    quota.write_text("400000 100000")
    assert usable_cores(quota) == min(affinity, 4)
    assert usable_cores(tmp_path / "missing") == affinity
