"""`make image-test`: run the built image as an operator would, and check it from outside.

1. The image writes a tiny demo checkpoint and sample media (its own `eg2 demo-model` and samples).
2. It starts with that checkpoint mounted read-only at /models, an API key, and its port published
   on 127.0.0.1; the test waits for the image's HEALTHCHECK (/ready, asked inside the container).
3. curl sends text, an image, audio and a video through the published port; /metrics is read.
4. Inside the running container: every process runs as uid 10001 (PID 1 is tini) and /models
   cannot be written; in the image, /models belongs to root, and the CPU variant has no compiler.
5. `stop` (SIGTERM) with a large request in flight: that request is answered, the log says
   draining then drained, and the container exits 0.

Standard library, curl and the engine's CLI only: it runs with the host's python3, nothing installed.

    python3 docker/image_test.py --engine podman --image eg2-serve:cpu --variant cpu
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SERVICE_UID = 10001
READY_TIMEOUT_S = 300.0  # the HEALTHCHECK's start period is 180 s; a tiny checkpoint needs ~15 s
STOP_TIMEOUT_S = 30  # beyond the 20 s drain deadline, as compose's stop_grace_period
DRAIN_ITEMS = 256  # texts in the request in flight at the stop: a few seconds of work on a CPU

# Runs inside the image (as the host's uid, so the host can delete what it writes): the demo
# checkpoint, the media, and facts about the image that need no running server.
HELPER = """
import importlib.util, json, os, shutil, stat
from pathlib import Path
import torch
from eg2_runtime import samples
from eg2_runtime.tools.demo_model import write_demo_model

write_demo_model(Path("/work/model"), size="tiny")
media = Path("/work/media")
media.mkdir()
(media / "image.png").write_bytes(samples.png(320, 240))
(media / "audio.wav").write_bytes(samples.wav(2.0))
(media / "video.mp4").write_bytes(samples.mp4(seconds=4))
models = os.stat("/models")
print(json.dumps({
    "models_owner": [models.st_uid, models.st_gid],
    "models_mode": oct(stat.S_IMODE(models.st_mode)),
    "compilers": [c for c in ("gcc", "cc", "c++", "clang") if shutil.which(c)],
    "pip": importlib.util.find_spec("pip") is not None,
    "torch": torch.__version__,
    "torch_cuda": torch.version.cuda,
}))
"""

# Runs inside the running container: every process's uids and command line.
PROCESSES = """
import json, os
me = os.getpid()
out = []
for pid in sorted((int(p) for p in os.listdir("/proc") if p.isdigit())):
    if pid == me:
        continue
    try:
        status = open(f"/proc/{pid}/status").read().splitlines()
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
    except OSError:
        continue
    uids = next(line.split()[1:] for line in status if line.startswith("Uid:"))
    out.append({"pid": pid, "uids": [int(u) for u in uids], "argv": [a.decode() for a in argv if a]})
print(json.dumps(out))
"""


class Failed(Exception):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failed(message)


class Run:
    def __init__(self, engine: str, image: str, variant: str) -> None:
        self.engine, self.image, self.variant = engine, image, variant
        self.name = f"eg2-image-test-{os.getpid()}"
        self.key = secrets.token_urlsafe(16)
        self.tmp = Path(tempfile.mkdtemp(prefix="eg2-image-test-"))
        self.start = time.monotonic()
        self.base = ""

    # --- helpers ------------------------------------------------------------------------------
    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f} s] {message}", flush=True)

    def cli(self, *args: str, timeout: float = 120, ok: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([self.engine, *args], capture_output=True, text=True, timeout=timeout)
        if ok and done.returncode != 0:
            raise Failed(f"{self.engine} {args[0]} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        return done

    def curl(
        self, path: str, body: Path | None = None, key: bool = True, timeout: float = 120
    ) -> tuple[int, bytes]:
        out = self.tmp / "response"
        cmd = ["curl", "-sS", "--max-time", str(timeout), "-o", str(out), "-w", "%{http_code}"]
        if key:
            cmd += ["-H", f"authorization: Bearer {self.key}"]
        if body is not None:
            cmd += ["-H", "content-type: application/json", "--data-binary", f"@{body}"]
        done = subprocess.run([*cmd, self.base + path], capture_output=True, text=True, timeout=timeout + 10)
        check(done.returncode == 0, f"curl {path}: {done.stderr.strip()}")
        return int(done.stdout), out.read_bytes() if out.exists() else b""

    def body(self, name: str, request: dict[str, Any]) -> Path:
        path = self.tmp / f"{name}.json"
        path.write_text(json.dumps(request))
        return path

    def data_uri(self, name: str, mime: str) -> str:
        return f"data:{mime};base64," + base64.b64encode((self.tmp / "media" / name).read_bytes()).decode()

    def as_host_user(self) -> list[str]:
        args = ["--user", f"{os.getuid()}:{os.getgid()}"]
        if (
            self.engine == "podman"
            and self.cli("info", "-f", "{{.Host.Security.Rootless}}").stdout.strip() == "true"
        ):
            args.append("--userns=keep-id")
        return args

    # --- the steps ----------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        size = int(self.cli("image", "inspect", "-f", "{{.Size}}", self.image).stdout)
        self.say(f"{self.image} with {self.engine}: {size / 1e6:.0f} MB uncompressed")
        done = self.cli(
            "run", "--rm", "--no-healthcheck", *self.as_host_user(), "-v", f"{self.tmp}:/work",
            "--entrypoint", "python3", self.image, "-c", HELPER, timeout=300,
        )  # fmt: skip
        facts: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        model_mb = sum(f.stat().st_size for f in (self.tmp / "model").rglob("*") if f.is_file()) / 1e6
        self.say(f"demo checkpoint written by the image (eg2 demo-model, tiny): {model_mb:.0f} MB; torch "
                 f"{facts['torch']} (CUDA {facts['torch_cuda']})")  # fmt: skip
        return facts

    def start_server(self) -> None:
        self.cli(
            "run", "-d", "--name", self.name, "-p", "127.0.0.1::8000",
            "-v", f"{self.tmp / 'model'}:/models:ro", "-e", f"EG2_API_KEY={self.key}", self.image,
        )  # fmt: skip
        port = self.cli("port", self.name, "8000/tcp").stdout.split()[0].rsplit(":", 1)[1]
        self.base = f"http://127.0.0.1:{port}"
        self.say(f"started {self.name}: /models read-only, an API key, 8000 published on 127.0.0.1:{port}")

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        started = time.monotonic()
        while True:
            if self.engine == "podman":
                # podman schedules health checks through systemd timers; where there is no systemd,
                # run the image's check ourselves (it updates the same health status).
                self.cli("healthcheck", "run", self.name, ok=False)
            state = json.loads(self.cli("inspect", "-f", "{{json .State}}", self.name).stdout)
            health = (state.get("Health") or state.get("Healthcheck") or {}).get("Status", "")
            if health == "healthy":
                break
            check(state.get("Running", False), f"the container stopped while starting: {state.get('Status')}")
            check(time.monotonic() < deadline, f"not healthy after {READY_TIMEOUT_S:.0f} s: {health!r}")
            time.sleep(1)
        self.say(f"HEALTHCHECK: healthy {time.monotonic() - started:.1f} s after the start")
        status, text = self.curl("/ready", key=False)
        check(status == 200, f"/ready from outside: {status} {text!r}")
        self.say(f"GET /ready through the published port: {status} {text.decode()}")

    def embeddings(self) -> None:
        status, _ = self.curl("/v1/embeddings", self.body("nokey", {"input": "x"}), key=False)
        check(status == 401, f"a request without the key got {status}, not 401")
        self.say("POST /v1/embeddings without the key: 401")
        requests: dict[str, dict[str, Any]] = {
            "text": {"input": ["a photo of a cat", "a dog barking"], "dimensions": 256},
            "image": {"input": [{"type": "image_url", "image_url": {"url": self.data_uri("image.png", "image/png")}}]},
            "audio": {"input": [{"type": "input_audio", "input_audio": {
                "data": base64.b64encode((self.tmp / "media" / "audio.wav").read_bytes()).decode(), "format": "wav"}}]},
            "video": {"input": [{"type": "video_url", "video_url": {"url": self.data_uri("video.mp4", "video/mp4")}}]},
        }  # fmt: skip
        for modality, request in requests.items():
            status, text = self.curl("/v1/embeddings", self.body(modality, {"model": "eg2", **request}))
            check(status == 200, f"{modality}: {status} {text[:500]!r}")
            answer = json.loads(text)
            vectors = [row["embedding"] for row in answer["data"]]
            dims = {len(v) for v in vectors}
            norms = [math.sqrt(sum(x * x for x in v)) for v in vectors]
            check(len(vectors) == len(request["input"]), f"{modality}: {len(vectors)} vectors")
            check(dims == {request.get("dimensions", 768)}, f"{modality}: dimensions {dims}")
            check(all(abs(n - 1) < 1e-3 for n in norms), f"{modality}: norms {norms}")
            self.say(
                f"POST /v1/embeddings {modality:5}: {status}, {len(vectors)} x {dims.pop()} floats, "
                f"|v| = {min(norms):.4f}, {answer['usage']['prompt_tokens']} tokens"
            )

    def metrics(self) -> None:
        status, _ = self.curl("/metrics", key=False)
        check(status == 401, f"/metrics without the key: {status}, not 401")
        status, text = self.curl("/metrics")
        check(status == 200, f"/metrics: {status}")
        lines = text.decode().splitlines()
        answered = [
            ln for ln in lines if ln.startswith('eg2_requests_total{route="/v1/embeddings",status="200"}')
        ]
        check(bool(answered) and float(answered[0].split()[-1]) >= 4, f"/metrics: {answered}")
        batches = {
            ln.split('"')[1]: int(float(ln.split()[-1]))
            for ln in lines
            if ln.startswith("eg2_batch_size_count{")
        }
        self.say(f"GET /metrics: 401 without the key, 200 with it; {answered[0]}; batches by "
                 f"modality: {batches}")  # fmt: skip

    def identity(self, facts: dict[str, Any]) -> None:
        processes = json.loads(self.cli("exec", self.name, "python3", "-c", PROCESSES).stdout)
        for p in processes:
            check(set(p["uids"]) == {SERVICE_UID}, f"process {p['argv']} runs as uids {p['uids']}")
        first = next(p for p in processes if p["pid"] == 1)
        check(first["argv"][0].endswith("tini"), f"PID 1 is {first['argv']}")
        server = [p for p in processes if any(a.endswith("/eg2") for a in p["argv"]) and "serve" in p["argv"]]
        check(len(server) == 1 and server[0]["pid"] != 1, f"eg2 serve processes: {processes}")
        self.say(
            f"processes: PID 1 {' '.join(first['argv'])}; PID {server[0]['pid']} "
            f"{' '.join(server[0]['argv'])}; all {len(processes)} as uid {SERVICE_UID}"
        )
        touch = self.cli("exec", self.name, "touch", "/models/probe", ok=False)
        check(touch.returncode != 0, "the service user could write /models")
        self.say(f"/models in the running container: not writable ({touch.stderr.strip()})")
        check(
            facts["models_owner"] == [0, 0] and facts["models_mode"] == "0o755", f"image's /models: {facts}"
        )
        self.say(
            f"/models in the image: owned by root, mode {facts['models_mode'][2:]} (uid {SERVICE_UID} reads it)"
        )
        if self.variant == "cpu":
            check(not facts["compilers"], f"compilers in the CPU image: {facts['compilers']}")
            check(facts["torch_cuda"] is None, f"the CPU image has a CUDA build of torch: {facts['torch']}")
        check(not facts["pip"], "pip is in the runtime image")
        self.say(f"image contents: compilers {facts['compilers'] or 'none'}, no pip, torch {facts['torch']}")

    def stop_with_request_in_flight(self) -> None:
        body = self.body("drain", {"input": [f"document {i}: " + "word " * 100 for i in range(DRAIN_ITEMS)]})
        out = self.tmp / "drain-response"
        client = subprocess.Popen(
            ["curl", "-sS", "--max-time", "120", "-o", str(out), "-w", "%{http_code}",
             "-H", f"authorization: Bearer {self.key}", "-H", "content-type: application/json",
             "--data-binary", f"@{body}", self.base + "/v1/embeddings"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:  # until the server has admitted the request's items
            _, text = self.curl("/metrics")
            admitted = [ln for ln in text.decode().splitlines() if ln.startswith("eg2_admitted_items ")]
            if admitted and float(admitted[0].split()[-1]) > 0:
                break
            check(client.poll() is None, "the large request ended before the stop; make it larger")
            check(time.monotonic() < deadline, "the large request was never admitted")
            time.sleep(0.05)
        stopped = time.monotonic()
        self.cli("stop", "-t", str(STOP_TIMEOUT_S), self.name, timeout=STOP_TIMEOUT_S + 30)
        stop_s = time.monotonic() - stopped
        status, err = client.communicate(timeout=120)
        check(status == "200", f"the request in flight at the stop got {status!r} {err.strip()}")
        answered = len(json.loads(out.read_bytes())["data"])
        check(answered == DRAIN_ITEMS, f"the request in flight got {answered} of {DRAIN_ITEMS} vectors")
        done = self.cli("logs", self.name)
        logs = done.stdout + done.stderr
        events = [json.loads(ln) for ln in logs.splitlines() if ln.startswith("{")]
        draining = [e for e in events if e.get("msg") == "draining"]
        drained = [e for e in events if e.get("msg") == "drained"]
        check(bool(draining) and draining[0]["in_flight"] >= 1, f"no drain with work in flight: {draining}")
        check(bool(drained), "the log has no 'drained'")
        state = json.loads(self.cli("inspect", "-f", "{{json .State}}", self.name).stdout)
        self.say(
            f"stop (SIGTERM) with {DRAIN_ITEMS} texts in flight: answered 200 with {answered} vectors; log: "
            f"draining (in_flight {draining[0]['in_flight']}) -> drained; exited {state['ExitCode']} "
            f"after {stop_s:.1f} s"
        )
        check(state["ExitCode"] == 0, f"exit code {state['ExitCode']} after the drain, not 0")

    def cleanup(self, failed: bool) -> None:
        if failed and self.cli("inspect", self.name, ok=False).returncode == 0:
            logs = self.cli("logs", "--tail", "40", self.name, ok=False)
            print(f"--- last log lines of {self.name} ---\n{logs.stdout}{logs.stderr}", file=sys.stderr)
        self.cli("rm", "-f", self.name, ok=False)
        shutil.rmtree(self.tmp, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True, choices=("docker", "podman"))
    parser.add_argument("--image", required=True)
    parser.add_argument("--variant", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    run = Run(args.engine, args.image, args.variant)
    failed = True
    try:
        facts = run.prepare()
        run.start_server()
        run.wait_healthy()
        run.embeddings()
        run.metrics()
        run.identity(facts)
        run.stop_with_request_in_flight()
        failed = False
    except (Failed, subprocess.TimeoutExpired) as exc:
        print(f"image-test: FAILED: {exc}", file=sys.stderr)
    finally:
        run.cleanup(failed)
    if failed:
        return 1
    run.say(f"image-test: passed ({args.image}, {args.engine})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
