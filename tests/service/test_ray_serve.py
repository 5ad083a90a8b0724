"""Ray Serve replicas (app/ray_serve.py): options, the per-replica wrappers, and a live 2-replica cluster.

The fast tests need no Ray cluster: deployment options are plain dicts, and the replica and proxy
middlewares are ASGI wrappers exercised with the fake engine. The `slow` tests share one local Ray
cluster (2 CPUs, no GPU, HTTP on 127.0.0.1 only) serving the tiny checkpoint as 2 replicas: Ray
takes ~20 s to start and deploy on 2 cores, so the module pays it once.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient

from app.cli import build_parser
from app.ray_serve import (
    REPLICA_HEADER,
    ReplicaLostMiddleware,
    ScaleOptions,
    build_replica_app,
    deployment_options,
    gpus_per_replica,
    replica_settings,
)
from app.settings import Settings
from benchmarks.server_process import free_port
from tests.support.fake_engine import FakeEngine
from tests.support.ray_cluster import kill_one_under_load, replicas_seen, vectors_by_replica

pytestmark = [
    # Ray's own pydantic models (ray.serve schema) use v1-style Field(update_type=...) at import time.
    pytest.mark.filterwarnings(
        "ignore:Using extra keyword arguments on `Field` is deprecated:pydantic.warnings.PydanticDeprecatedSince20"
    ),
]

# --- no cluster -------------------------------------------------------------------------------------


def test_scale_options_refuse_incoherent_counts() -> None:
    ScaleOptions(replicas=2, min_replicas=1, max_replicas=4)
    for bad in (
        {"replicas": 0},
        {"min_replicas": 1},  # max missing
        {"min_replicas": 3, "max_replicas": 2},
        {"min_replicas": 0, "max_replicas": 0},
        {"target_ongoing_requests": 200, "max_ongoing_requests": 100},
    ):
        with pytest.raises(ValueError):
            ScaleOptions(**bad)  # type: ignore[arg-type]


def test_one_gpu_per_replica_on_gpu_clusters_none_on_cpu() -> None:
    auto, cpu, cuda = Settings(), Settings(device="cpu"), Settings(device="cuda:3")
    assert gpus_per_replica(auto, ScaleOptions(), cluster_gpus=8) == 1.0
    assert gpus_per_replica(auto, ScaleOptions(), cluster_gpus=0) == 0.0
    assert gpus_per_replica(cpu, ScaleOptions(), cluster_gpus=8) == 0.0
    assert gpus_per_replica(cuda, ScaleOptions(), cluster_gpus=8) == 1.0
    assert gpus_per_replica(auto, ScaleOptions(num_gpus=0.5), cluster_gpus=8) == 0.5
    # Inside a replica Ray exposes only its GPU, as `cuda`; a CPU replica must not grab one.
    assert replica_settings(cuda, 1.0).device == "cuda"
    assert replica_settings(auto, 0.0).device == "cpu"
    # Media-preparing processes: the cores Ray reserved for the replica, unless the operator chose.
    assert replica_settings(cuda, 1.0, num_cpus=4).preprocess_processes == 4
    assert replica_settings(cuda, 1.0, num_cpus=0.5).preprocess_processes == 1
    assert replica_settings(Settings(device="cuda", preprocess_processes=0), 1.0, 4).preprocess_processes == 0
    assert replica_settings(auto, 0.0, num_cpus=4).preprocess_processes is None


def test_deployment_options_fixed_and_autoscaling() -> None:
    settings = Settings(drain_deadline_s=20)
    fixed = deployment_options(settings, ScaleOptions(replicas=3), num_gpus=1.0)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert fixed["graceful_shutdown_timeout_s"] == settings.drain_deadline_s
    assert fixed["logging_config"]["enable_access_log"] is False  # Ray's per-request lines cost its proxy

    scaled = deployment_options(
        settings, ScaleOptions(replicas=8, min_replicas=1, max_replicas=4, target_ongoing_requests=8), 1.0
    )
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 4,  # --replicas clamped into the range
        "target_ongoing_requests": 8,
    }


def test_cli_serve_ray_takes_scale_flags_and_every_setting() -> None:
    args = build_parser().parse_args(
        ["serve-ray", "--replicas", "2", "--min-replicas", "1", "--max-replicas", "4", "--port", "9000"]
    )
    assert (args.replicas, args.min_replicas, args.max_replicas, args.port) == (2, 1, 4, "9000")
    assert args.run.__name__ == "_serve_ray"
    assert all(hasattr(args, f) for f in Settings.model_fields)
    assert build_parser().parse_args(["serve", "--port", "1"]).run.__name__ == "_serve"  # unchanged


def test_replica_app_waits_for_warmup_and_names_itself() -> None:
    identity = {"id": "r-test", "pid": os.getpid(), "node": "here", "device": "cpu"}
    app = build_replica_app(Settings(log_json=False), identity, engine=FakeEngine(modalities=("text",)))
    with TestClient(app) as client:  # entering runs the lifespan: with the wrapper, warm-up included
        assert client.get("/ready").status_code == 200
        r = client.post("/v1/embeddings", json={"input": ["a", "b"]})
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == "r-test"
        assert client.post("/v1/embeddings", json={"input": []}).headers[REPLICA_HEADER] == "r-test"
        info = client.get("/info")
        assert info.json()["replica"] == identity and info.json()["model"] == "eg2"
        paths = client.get("/openapi.json").json()["paths"]
        assert "/info" in paths  # still documented, once


@dataclass
class _Sent:
    messages: list[dict[str, Any]] = field(default_factory=list)

    async def __call__(self, message: Any) -> None:
        self.messages.append(message)


def _through_proxy_middleware(inner: Any) -> list[dict[str, Any]]:
    sent = _Sent()

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(ReplicaLostMiddleware(inner)({"type": "http", "headers": []}, receive, sent))
    return sent.messages


def test_proxy_turns_a_lost_replica_into_the_apis_503() -> None:
    async def no_response(scope: Any, receive: Any, send: Any) -> None:
        return None  # what Ray's proxy does when the replica's actor died mid-request

    async def bare_500(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b"Internal Server Error"})

    async def replica_500(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 500, "headers": [(b"x-replica-id", b"r")]})
        await send({"type": "http.response.body", "body": b"{}"})

    for inner in (no_response, bare_500):
        start, body = _through_proxy_middleware(inner)
        assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
        assert json.loads(body["body"])["error"]["type"] == "unavailable"
    # A replica's own 500 (a bug, with its API body) passes unchanged.
    assert [m.get("status") for m in _through_proxy_middleware(replica_500)] == [500, None]


# --- a live cluster: 2 replicas of the tiny checkpoint ----------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_bf16: Path) -> Iterator[str]:
    ray = pytest.importorskip("ray")
    from ray import serve

    from app.ray_serve import deploy, init_ray

    port = free_port()
    # 2 CPUs for the whole cluster, half a CPU per replica: both fit on CI's 2 cores; one
    # preprocessing thread each, and a short drain so the teardown does not wait long.
    init_ray(num_cpus=2, num_gpus=0)
    settings = Settings(
        model=tiny_bf16,
        port=port,
        preprocess_workers=1,
        drain_deadline_s=2,
        log_json=False,
        log_level="warning",
    )
    try:
        assert deploy(settings, ScaleOptions(replicas=2, num_cpus=0.5)) == 0.0
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
def test_every_replica_is_warm_when_deploy_returns(cluster: str) -> None:
    with httpx.Client(base_url=cluster, timeout=10) as client:
        for _ in range(20):  # Ray spreads these over both replicas
            r = client.get("/ready")
            assert r.status_code == 200, r.text
        metrics = client.get("/metrics")
        assert metrics.status_code == 200 and "eg2_queue_depth" in metrics.text
        info = client.get("/info")
        assert info.json()["replica"]["id"] == info.headers[REPLICA_HEADER]
    assert len(replicas_seen(cluster, 2)) == 2


@pytest.mark.slow
def test_requests_spread_and_vectors_match_across_replicas(cluster: str) -> None:
    by_replica = vectors_by_replica(cluster)
    assert len(by_replica) == 2, {k: len(v) for k, v in by_replica.items()}
    reference = next(iter(by_replica.values()))[0]
    worst = max(float(np.abs(v - reference).max()) for vs in by_replica.values() for v in vs)
    # FP32 on CPU: the replicas hold the same weights; what differs is batch composition (the same
    # bound as batched vs one-by-one in tests/runtime/test_runtime_parity.py).
    assert worst <= 1e-6, f"max abs diff across replicas {worst:.2e} > 1e-6"


@pytest.mark.slow
def test_killed_replica_costs_only_its_in_flight_requests_and_comes_back(cluster: str) -> None:
    clients = 4
    k = kill_one_under_load(cluster, clients)
    assert k.new_ids, f"no replacement replica answered within 120 s; statuses {k.statuses}"
    # A request in flight on the killed replica is lost: at most one per client, each a 503 in the
    # API's error shape (the proxy middleware), none of them 500, nothing dropped, nothing else failing.
    assert set(k.statuses) <= {200, 503} and not k.dropped, (k.failed, k.dropped)
    assert k.statuses[503] <= clients, k.failed
    for _, _, text in k.failed:
        assert json.loads(text)["error"]["type"] == "unavailable"
    assert k.after[k.survivor] > 0 and sum(k.after[i] for i in k.new_ids) > 0
    print(f"replacement routed after {k.recovered_s:.1f} s; {k.statuses}; after the kill {dict(k.after)}")
