"""The Docker files, read: the properties the image must keep, checked without a container engine.

`make image-test` builds and runs the image (docker/image_test.py); these tests hold the same
properties on every `make test`, where no engine runs, and run the image's HEALTHCHECK script
against real listeners.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from benchmarks.server_process import free_port

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()
HEALTHCHECK = REPO / "docker" / "healthcheck.py"
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """Stage name -> (what it is FROM, its instructions)."""
    out: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    current = None
    for word, rest in instructions(DOCKERFILE):
        if word == "FROM":
            base, _, name = rest.partition(" AS ")
            current = name.strip()
            out[current] = (base.strip(), [])
        elif current is not None:
            out[current][1].append((word, rest))
    return out


def stage(name: str) -> list[tuple[str, str]]:
    return stages()[name][1]


def global_args() -> dict[str, str]:
    """ARGs before the first FROM: name -> default."""
    out = {}
    for word, rest in instructions(DOCKERFILE):
        if word == "FROM":
            break
        if word == "ARG":
            name, _, default = rest.partition("=")
            out[name] = default
    return out


def runs(name: str) -> list[str]:
    return [rest for word, rest in stage(name) if word == "RUN"]


def test_variants_differ_only_in_base_torch_index_and_compiler() -> None:
    all_stages = stages()
    assert all_stages["base-cpu"] == ("${CPU_BASE}", []) and all_stages["base-cuda"] == ("${CUDA_BASE}", [])
    assert all_stages["system"][0] == "base-${VARIANT}"
    # Everything else is one path for both variants: no other stage is chosen by the variant...
    assert [s for s, (base, _) in all_stages.items() if "VARIANT" in base] == ["system"]
    assert all_stages["build"][0] == "system" and all_stages["runtime"][0] == "system"
    # ...and inside it, the variant picks only Triton's compiler and the torch index.
    uses = [r for s in all_stages for r in runs(s) if "$VARIANT" in r]
    assert len(uses) == 2 and all('case "$VARIANT" in' in r for r in uses), uses
    system, torch = uses
    assert re.search(r'cpu\) triton="" ;;', system) and re.search(
        r'cuda\) triton="gcc libc6-dev python3-dev" ;;', system
    ), "the CUDA image keeps what Triton compiles with; the CPU image has no compiler"
    assert "download.pytorch.org/whl/cpu" in torch and "pypi.org/simple" in torch
    assert global_args()["VARIANT"] == "cuda"
    assert list(all_stages)[-1] == "serve" and all_stages["serve"][0] == "runtime", (
        "the default target must be the image without baked weights"
    )


def test_public_bases_are_pinned_by_digest() -> None:
    args = global_args()
    assert args["CPU_BASE"].startswith("docker.io/library/debian:bookworm-slim@"), args["CPU_BASE"]
    cuda = args["CUDA_BASE"]
    assert cuda.startswith("docker.io/nvidia/cuda:13.0.1-runtime-ubuntu24.04@"), cuda
    for name in ("CPU_BASE", "CUDA_BASE"):
        assert DIGEST.search(args[name]), f"{name} is not pinned by digest: {args[name]}"


def test_build_inputs_for_offline_and_proxied_networks() -> None:
    all_stages = stages()
    # A folder of torch wheels arrives as a build context replacing an empty stage, mounted read-only.
    assert all_stages["torch-wheels"] == ("scratch", [])
    torch = next(r for r in runs("build") if "torch==" in r)
    assert "--mount=type=bind,from=torch-wheels,target=/wheels" in torch and "--find-links /wheels" in torch
    assert '"torch==${TORCH_VERSION}"' in torch and "${TORCH_INDEX:-" in torch
    assert any(w == "ARG" and re.fullmatch(r"TORCH_VERSION=\d+\.\d+\.\d+", r) for w, r in stage("build"))
    # Every download trusts the ca_bundle secret when given; a secret is never written to a layer.
    downloads = [r for s in all_stages for r in runs(s) if re.search(r"pip install|hf download", r)]
    assert len(downloads) >= 4, downloads
    for r in downloads:
        assert "--mount=type=secret,id=ca_bundle" in r, r
        assert all(f"with-ca {tool}" in r for tool in re.findall(r"(\S*pip) install", r)), r
        assert "hf download" not in r or "with-ca /opt/hf/bin/hf download" in r, r
    assert "ca_bundle" not in " ".join(r for w, r in instructions(DOCKERFILE) if w in ("COPY", "ADD", "ENV"))


def test_nothing_of_one_machine_is_hard_coded() -> None:
    """The offline route (a local base, a wheel folder, a CA file) comes in through arguments that
    the podman setup records per host; the files in the repository keep the public defaults."""
    for path in ("docker/Dockerfile", "docker/image.sh", "Makefile", "docker/compose.yaml"):
        text = (REPO / path).read_text()
        for local in ("/opt/wheels", "localhost/debian", "ca-certificates.crt", "/root/", "torch-2.13"):
            assert local not in text, f"{path} names {local}"


def test_runtime_image_has_no_build_tools_and_runs_as_service_user() -> None:
    runtime = stage("runtime")
    words = [w for w, _ in runtime]
    assert ("COPY", "--from=build /opt/venv /opt/venv") in runtime
    assert not any(re.search(r"apt-get install|pip install", r) for r in runs("runtime")), (
        "the runtime stage installs nothing: what it runs comes from `system` and the build stage"
    )
    assert any("pip uninstall -y pip" in r for r in runs("build")), "pip stays out of the runtime venv"
    users = [rest for w, rest in runtime if w == "USER"]
    assert users == ["10001:10001"]
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN"), (
        "no RUN after dropping root"
    )
    assert any("groupadd --gid 10001" in r and "--uid 10001 --gid 10001" in r for r in runs("runtime"))
    env = " ".join(rest for w, rest in runtime if w == "ENV")
    assert "EG2_MODEL=/models" in env and "EG2_HOST=0.0.0.0" in env and "EG2_PORT=8000" in env
    assert ("EXPOSE", "8000") in runtime


def test_init_process_and_healthcheck() -> None:
    runtime = stage("runtime")
    # tini is PID 1: SIGTERM reaches eg2 (which drains), children are reaped, eg2's exit code is kept.
    assert ("ENTRYPOINT", '["tini", "--", "eg2"]') in runtime and ("CMD", '["serve"]') in runtime
    assert re.search(r"apt-get install .*\btini\b", runs("system")[0])
    healthcheck = next(rest for w, rest in runtime if w == "HEALTHCHECK")
    assert "/opt/eg2/healthcheck.py" in healthcheck and "127.0.0.1" not in healthcheck
    assert ("COPY", "docker/healthcheck.py /opt/eg2/healthcheck.py") in runtime
    assert "!docker/healthcheck.py" in (REPO / ".dockerignore").read_text().split()


def test_weights_are_never_writable_by_the_service() -> None:
    assert "chown" not in " ".join(r for _, r in instructions(DOCKERFILE))
    assert not any("--chown" in r for w, r in instructions(DOCKERFILE) if w == "COPY")
    with_weights = stage("with-weights")
    assert with_weights == [("COPY", "--from=weights /models /models")], with_weights
    weights = stage("weights")
    assert ("ARG", "HF_REVISION=") in weights and any("--revision" in r for r in runs("weights"))
    assert stages()["weights"][0] == "build", "the download tool stays out of the image"


def test_compose_reserves_a_gpu_and_publishes_on_loopback() -> None:
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    service = compose["services"]["eg2"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    assert any(v.endswith(":/models:ro") for v in service["volumes"])
    assert all(p.startswith("127.0.0.1:") for p in service["ports"]), service["ports"]
    grace = int(service["stop_grace_period"].rstrip("s"))
    assert grace > int(service["environment"]["EG2_DRAIN_DEADLINE_S"]), "grace must exceed the drain deadline"


def readme_docker_runs() -> list[str]:
    """Every `docker run` command of the README's Docker section, continuation lines joined."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Docker\n", 1)[1].split("\n## ", 1)[0]
    joined = re.sub(r"\\\n\s*", " ", section)
    return [ln.strip() for ln in joined.splitlines() if ln.strip().startswith("docker run")]


def test_readme_docker_run_publishes_on_loopback_unless_a_key_is_set() -> None:
    commands = readme_docker_runs()
    assert len(commands) >= 2, commands
    for command in commands:
        published = re.findall(r"-p (\S+)", command)
        assert published, command
        if "EG2_API_KEY" not in command:
            assert all(p.startswith("127.0.0.1:") for p in published), f"open to every interface: {command}"


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".git", "*.safetensors", "tests", "docs"} <= set(ignored)


# --- the HEALTHCHECK script, against real listeners -------------------------------------------------


class _Ready(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/ready" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


Listener = Callable[..., int]


@pytest.fixture
def listener() -> Iterator[Listener]:
    """start(address, status=200) -> port: an HTTP server answering /ready with that status."""
    servers: list[ThreadingHTTPServer] = []

    def start(address: str, status: int = 200) -> int:
        handler = type("Handler", (_Ready,), {"status": status})
        server = (_V6Server if ":" in address else ThreadingHTTPServer)((address, 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return int(server.server_address[1])

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def healthcheck(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("EG2_")}
    # An HTTP proxy in the environment must not be asked for the service's own address.
    clean |= {"PYTHONPATH": str(REPO), "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK)], env=clean | env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "listen,eg2_host,url_host",
    [
        ("127.0.0.1", "0.0.0.0", "127.0.0.1"),  # the image's default: a wildcard is asked on its loopback
        ("127.0.0.2", "127.0.0.2", "127.0.0.2"),  # a specific address: 127.0.0.1 would find nothing
        ("::1", "::", "[::1]"),  # IPv6 wildcard
        ("::1", "::1", "[::1]"),  # an IPv6 literal, in brackets in the URL
    ],
)
def test_healthcheck_asks_where_eg2_listens(
    listener: Listener, listen: str, eg2_host: str, url_host: str
) -> None:
    if ":" in listen and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    port = listener(listen)
    done = healthcheck(EG2_HOST=eg2_host, EG2_PORT=str(port))
    assert done.returncode == 0, done.stderr
    # Another port on the same host: nothing listens, so unhealthy, and the log names the URL asked.
    free = free_port(listen)
    closed = healthcheck(EG2_HOST=eg2_host, EG2_PORT=str(free))
    assert closed.returncode == 1 and "refused" in closed.stderr.lower(), closed.stderr
    assert closed.stderr.startswith(f"http://{url_host}:{free}/ready: "), closed.stderr


def test_healthcheck_fails_while_not_ready(listener: Listener) -> None:
    port = listener("127.0.0.1", status=503)  # loading, or draining
    done = healthcheck(EG2_HOST="0.0.0.0", EG2_PORT=str(port))
    assert done.returncode == 1 and "503" in done.stderr, done.stderr
