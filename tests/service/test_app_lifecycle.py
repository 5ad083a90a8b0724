"""Lifecycle: load -> warm up -> ready; SIGTERM -> drain -> exit 0; failures at start exit non-zero with a
clear reason. Signal tests run the server in a subprocess (tests/support/fake_engine.py as a script)."""

from __future__ import annotations

import errno
import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.service import StartupError, State, ensure_demo_model
from app.settings import Settings
from benchmarks.server_process import wait_listening
from tests.support.fake_engine import (
    STALL_HERE,
    FakeEngine,
    LiveServer,
    assert_error,
    live,
    make_settings,
)

REPO = Path(__file__).resolve().parents[2]


# --- start -----------------------------------------------------------------------------------------


def test_ready_is_503_until_warmup_completes() -> None:
    engine = FakeEngine()
    engine.warmup_gate.clear()
    with live(make_settings(), engine, wait_ready=False) as s, httpx.Client(base_url=s.url) as c:
        time.sleep(0.05)
        assert_error(c.get("/ready"), 503, "unavailable")
        assert c.get("/health").status_code == 200  # alive while loading
        r = c.post("/v1/embeddings", json={"input": "too early"})
        assert "loading" in assert_error(r, 503, "unavailable")["message"]
        assert_error(c.get("/info"), 503, "unavailable")
        engine.warmup_gate.set()
        s.wait_state(State.READY)
        assert c.get("/ready").status_code == 200
        assert engine.warmups == 1
        assert c.post("/v1/embeddings", json={"input": "now"}).status_code == 200


def test_the_startup_heap_is_frozen_once_ready_and_thawed_at_stop() -> None:
    """After warm-up everything alive leaves the collector's scans (freeze_startup_heap); a stopped
    service gives it back, so a process that starts many services (this one) still collects them."""
    before = gc.get_freeze_count()  # another service of this process may hold a freeze
    engine = FakeEngine()
    engine.warmup_gate.clear()
    with live(make_settings(), engine, wait_ready=False) as s:
        assert s.service.state is State.LOADING and gc.get_freeze_count() == before
        engine.warmup_gate.set()
        s.wait_state(State.READY)
        assert gc.get_freeze_count() > before + 10_000  # the modules, the app, the engine
    assert gc.get_freeze_count() == 0


def test_warmup_runs_a_full_batch_per_modality() -> None:
    engine = FakeEngine(modalities=["text", "image"])
    with live(make_settings(max_batch_items=16, max_batch_tokens=4096), engine):
        warmup = [b for b in engine.batches if b[0].inputs[1] == "warm-up"]
        assert sorted(b[0].modality for b in warmup) == ["image", "text"]
        assert all(len(b) == 16 and sum(p.cost for p in b) == 4096 for b in warmup)


def test_warmup_out_of_memory_fails_the_boot() -> None:
    engine = FakeEngine(oom_over_items=4)  # a full batch (16) does not fit
    server = LiveServer(make_settings(max_batch_items=16), engine, wait_ready=False)
    with server:
        deadline = time.monotonic() + 10
        while server._thread is not None and server._thread.is_alive():  # the server stops by itself
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert server.service.state is State.FAILED
        assert server.service.exit_code == 1
        assert "max_batch_tokens" in (server.service.failure or "")


def test_missing_checkpoint_fails_clearly(tmp_path: Path) -> None:
    server = LiveServer(make_settings(model=tmp_path / "nowhere"), None, wait_ready=False)
    with server:
        while server.service.state is State.LOADING:
            time.sleep(0.01)
        assert server.service.state is State.FAILED and server.service.exit_code == 1
        assert "no checkpoint directory" in (server.service.failure or "")


def test_demo_cache_unwritable_fails_clearly(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    server = LiveServer(make_settings(cache_dir=not_a_dir / "cache"), None, wait_ready=False)
    with server:
        while server.service.state is State.LOADING:
            time.sleep(0.01)
        failure = server.service.failure or ""
        assert server.service.state is State.FAILED and "cannot build the demo model" in failure
        assert "EG2_CACHE_DIR" in failure


# --- the demo checkpoint cache ---------------------------------------------------------------------


def test_demo_model_is_built_once(tmp_path: Path) -> None:
    calls: list[Path] = []

    def write(dst: Path, **kw: Any) -> Path:
        calls.append(dst)
        (dst / "config.json").write_text("{}")
        return dst

    first = ensure_demo_model(tmp_path / "cache", write)
    second = ensure_demo_model(tmp_path / "cache", write)
    assert first == second == tmp_path / "cache" / "demo-tiny"
    assert len(calls) == 1 and (first / "config.json").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["demo-tiny"]  # no temp dirs left


def test_demo_model_disk_full(tmp_path: Path) -> None:
    def write(dst: Path, **kw: Any) -> Path:
        (dst / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(StartupError, match="No space left on device") as info:
        ensure_demo_model(tmp_path, write)
    assert "EG2_MODEL" in str(info.value)
    assert list(tmp_path.iterdir()) == [], "a failed build must leave nothing behind"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_demo_model_read_only_cache(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(StartupError, match="Permission denied"):
            ensure_demo_model(tmp_path / "cache", lambda dst, **kw: dst)
    finally:
        tmp_path.chmod(0o700)


# --- drain -----------------------------------------------------------------------------------------


def test_drain_in_process_refuses_new_work_then_stops() -> None:
    engine = FakeEngine(embed_delay_s=0.3)
    with live(make_settings(drain_deadline_s=5), engine) as s, httpx.Client(base_url=s.url) as c:
        results: list[httpx.Response] = []
        inflight = threading.Thread(
            target=lambda: results.append(c.post("/v1/embeddings", json={"input": "in flight"}))
        )
        inflight.start()
        while s.service.active == 0:
            time.sleep(0.005)
        s.service.begin_drain_threadsafe()
        while s.service.state is not State.DRAINING:
            time.sleep(0.005)
        assert_error(httpx.get(s.url + "/ready"), 503, "unavailable")
        late = httpx.post(s.url + "/v1/embeddings", json={"input": "late"})
        assert "shutting down" in assert_error(late, 503, "unavailable")["message"]
        inflight.join(timeout=10)
        assert results[0].status_code == 200
        deadline = time.monotonic() + 5
        while s._thread is not None and s._thread.is_alive():
            assert time.monotonic() < deadline, "server did not stop after draining"
            time.sleep(0.01)
        assert s.service.exit_code == 0


class Proc:
    """The fake-engine server in a subprocess; stderr (JSON logs) collected by a thread."""

    def __init__(self, env: dict[str, str], *args: str, ready: bool = True) -> None:
        """Started, listening, and (`ready`) answering /ready 200."""
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("EG2_")}
        full_env.update({"EG2_HOST": "127.0.0.1", "EG2_PORT": "0", "PYTHONPATH": str(REPO), **env})
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "support" / "fake_engine.py"), *args],
            cwd=REPO,
            env=full_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 30
        alive = lambda: self.proc.poll() is None  # noqa: E731
        self.port = wait_listening(self.proc.pid, alive, lambda: "".join(self.lines), 30)
        self.url = f"http://127.0.0.1:{self.port}"
        while ready and httpx.get(self.url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "server not ready"
            time.sleep(0.02)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        assert self.proc.stderr is not None
        self.proc.stderr.close()


@pytest.fixture
def spawn() -> Iterator[Any]:
    procs: list[Proc] = []

    def start(env: dict[str, str], *args: str, ready: bool = True) -> Proc:
        procs.append(Proc(env, *args, ready=ready))
        return procs[-1]

    yield start
    for p in procs:
        p.close()


def _post_all(url: str, texts: list[str]) -> tuple[list[threading.Thread], list[httpx.Response | None]]:
    results: list[httpx.Response | None] = [None] * len(texts)

    def send(i: int) -> None:
        results[i] = httpx.post(url + "/v1/embeddings", json={"input": texts[i]}, timeout=30)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    return threads, results


def _wait_admitted(url: str, results: list[httpx.Response | None], timeout_s: float = 30) -> None:
    """Until every request is admitted or answered. The answered are counted first: one finishing
    between the two reads is then missed by both (the loop goes on), never counted twice."""
    deadline = time.monotonic() + timeout_s
    while True:
        answered = sum(r is not None for r in results)
        found = re.search(r"^eg2_admitted_items (\S+)$", httpx.get(url + "/metrics").text, re.M)
        admitted = int(float(found.group(1))) if found else 0
        if answered + admitted >= len(results):
            return
        assert time.monotonic() < deadline, f"{answered} answered + {admitted} admitted of {len(results)}"
        time.sleep(0.02)


def test_sigterm_under_load_completes_in_flight_and_exits_0(spawn: Any) -> None:
    deadline_s = 10.0
    env = {"EG2_DRAIN_DEADLINE_S": str(deadline_s), "EG2_MAX_BATCH_ITEMS": "2", "EG2_MAX_QUEUE_DELAY_MS": "1"}
    p = spawn(env, "--embed-delay", "0.4")
    texts = [f"load {i}" for i in range(8)]  # 4 batches of 2, 0.4 s each: ~1.6 s of work
    threads, results = _post_all(p.url, texts)
    _wait_admitted(p.url, results)  # every request in flight before the signal, however slow the machine
    p.proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    while True:  # /ready turns 503 at once
        ready = httpx.get(p.url + "/ready")
        if ready.status_code == 503:
            break
        assert time.monotonic() - start < 1, "ready still 200 after SIGTERM"
    assert_error(ready, 503, "unavailable")
    late = httpx.post(p.url + "/v1/embeddings", json={"input": "late"})
    assert_error(late, 503, "unavailable")
    assert late.headers.get("connection") == "close"
    for t in threads:
        t.join(timeout=20)
    for text, r in zip(texts, results, strict=True):
        assert r is not None and r.status_code == 200, r
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], FakeEngine.expected(text), atol=1e-7)
    assert p.proc.wait(timeout=deadline_s + 5) == 0
    assert time.monotonic() - start < deadline_s
    assert any('"drained"' in line for line in p.lines)


def test_sigterm_with_a_wedged_engine_exits_within_the_deadline(spawn: Any) -> None:
    p = spawn({"EG2_DRAIN_DEADLINE_S": "1"})
    threads, results = _post_all(p.url, [f"{STALL_HERE} forever"])
    time.sleep(0.2)
    p.proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    assert p.proc.wait(timeout=10) == 0
    assert time.monotonic() - start < 1 + 4  # deadline, the 1 s grace, uvicorn's close
    threads[0].join(timeout=5)
    r = results[0]
    assert r is not None
    assert "shutting down" in assert_error(r, 503, "unavailable")["message"]


def test_sigterm_while_the_engine_loads_exits_0(spawn: Any) -> None:
    """SIGTERM while the engine still loads on its GPU thread (native torch code): the service names
    the busy thread and the process leaves with 0, not the -6 of an interpreter finalizing under it."""
    p = spawn({}, "--load-torch-busy", "20", ready=False)  # listening: the boot (the load) is under way
    time.sleep(1.0)
    p.proc.send_signal(signal.SIGTERM)
    assert p.proc.wait(timeout=30) == 0


@pytest.mark.parametrize(
    ("setting", "expected"), [(None, Settings.model_fields["gil_switch_interval_ms"].default), ("2", 2.0)]
)
def test_the_served_process_hands_the_gil_over_at_its_setting(
    spawn: Any, setting: str | None, expected: float
) -> None:
    """`eg2 serve` sets the interpreter's GIL switch interval (gil_switch_interval_ms; Python's own
    default is 5 ms), as /info reports it from the running process."""
    env = {} if setting is None else {"EG2_GIL_SWITCH_INTERVAL_MS": setting}
    p = spawn(env)
    assert httpx.get(p.url + "/info").json()["process"] == {"gil_switch_interval_ms": expected}
