"""The Kubernetes manifests under docker/k8s/: schema-valid, and consistent with the app's settings.

Validation is offline: kubernetes-validate ships the OpenAPI schemas (strict: unknown fields are
errors). The consistency checks read Settings defaults from app/settings.py, so changing a default
(the drain deadline, the port) without the manifests fails here, not in a cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from app.settings import Settings

K8S = Path(__file__).resolve().parents[2] / "docker" / "k8s"
KUBERNETES_VERSION = "1.33.0"  # native preStop `sleep` needs >= 1.30; a current, widely run release
PRESTOP_TO_EXIT_MARGIN_S = 3  # the process exits ~1 s after the drain (server.py); leave slack


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def _one(kind: str) -> dict[str, Any]:
    found = [doc for _, doc in _documents() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "eg2"]
    return container


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


@pytest.mark.parametrize("name,doc", _documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_manifest_matches_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_every_kind_is_there() -> None:
    kinds = {doc["kind"] for _, doc in _documents()}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= kinds


def test_probes_and_ports_follow_the_app() -> None:
    deployment, service = _one("Deployment"), _one("Service")
    container = _container(deployment)
    env = _env(container)
    (port,) = container["ports"]
    # The port the app listens on is the one the probes, the Service and Prometheus use.
    app_port = int(env.get("EG2_PORT", Settings().port))
    assert port["containerPort"] == app_port
    assert env["EG2_HOST"] == "0.0.0.0"  # the default 127.0.0.1 is unreachable from the kubelet
    for probe, path in (
        ("readinessProbe", "/ready"),
        ("livenessProbe", "/health"),
        ("startupProbe", "/health"),
    ):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert get["port"] in (port["name"], app_port), probe
    assert service["spec"]["ports"][0]["targetPort"] in (port["name"], app_port)
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert (
        annotations["prometheus.io/port"] == str(app_port) and annotations["prometheus.io/path"] == "/metrics"
    )


def test_grace_period_covers_prestop_plus_drain() -> None:
    deployment = _one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    drain_s = float(_env(container).get("EG2_DRAIN_DEADLINE_S", Settings().drain_deadline_s))
    assert drain_s == Settings().drain_deadline_s, "the manifest's drain deadline drifted from the default"
    prestop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace_s = pod["terminationGracePeriodSeconds"]
    # SIGKILL comes grace_s after the preStop hook starts; SIGTERM (the drain) only after it ends.
    assert grace_s >= prestop_s + drain_s + PRESTOP_TO_EXIT_MARGIN_S, (grace_s, prestop_s, drain_s)
    # ...but not so long that a wedged pod lingers: at most a few seconds beyond.
    assert grace_s <= prestop_s + drain_s + 15, (grace_s, prestop_s, drain_s)


def test_container_keeps_the_images_init() -> None:
    # `command` would replace the image's ENTRYPOINT (tini -- eg2): eg2 would be PID 1, with no one
    # reaping its children and the kernel's PID-1 signal rules applying to it.
    container = _container(_one("Deployment"))
    assert "command" not in container, container.get("command")
    assert container["args"] == ["serve"]


def test_one_gpu_non_root_and_readiness_gated_rollout() -> None:
    deployment = _one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the uid docker/Dockerfile creates
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert _env(container)["EG2_MODEL"].startswith("/models") and "/models" in mounts
    assert mounts["/models"].get("readOnly") is True, "the service reads weights, never writes them"


def test_hpa_scales_on_queue_depth_with_cpu_fallback() -> None:
    from app.metrics import Metrics

    hpa = _one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == _one("Deployment")["metadata"]["name"]
    kinds = [m["type"] for m in hpa["spec"]["metrics"]]
    assert kinds == ["Pods", "Resource"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    # The metric must exist in what /metrics serves, and the adapter rule must expose it.
    assert metric in Metrics().render().decode()
    adapter = yaml.safe_load(_one("ConfigMap")["data"]["config.yaml"])
    assert any(rule["name"]["as"] == metric for rule in adapter["rules"])
    assert hpa["spec"]["metrics"][1]["resource"]["name"] == "cpu"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_disruption_budget_keeps_pods_serving() -> None:
    pdb = _one("PodDisruptionBudget")
    assert pdb["spec"]["selector"] == _one("Deployment")["spec"]["selector"]
    assert pdb["spec"]["maxUnavailable"] == 1
