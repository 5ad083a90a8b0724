"""The preparing processes (eg2_runtime/prepare_processes.py) against the same engine's own
`prepare_many` on this thread: the same inputs bit for bit, errors in their slots, cancelling, a
worker that dies, and the way back through /dev/shm or, without it, the pipe. Real spawned processes
on the tiny checkpoint."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from eg2_runtime import prepare_processes, samples
from eg2_runtime.api import PreparedItem
from eg2_runtime.engine import Engine
from eg2_runtime.errors import Cancelled, EngineError, MediaDecodeError
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
from eg2_runtime.prepare_processes import PrepareProcesses

IMAGE = Item((MediaPart("image", samples.png(320, 240)),))
CLIP = Item((MediaPart("audio", samples.wav(2.0)),))
VIDEO = Item((MediaPart("video", samples.mp4(3)),))
MIXED = Item((TextPart("a caption:"), MediaPart("image", samples.png(96, 64))))
LONG_VIDEO = Item((MediaPart("video", samples.mp4(60, width=640, height=480)),))


@pytest.fixture(scope="module")
def engine(tiny_bf16: Path) -> Engine:
    return Engine.from_dir(tiny_bf16, device="cpu")


@pytest.fixture(scope="module")
def long_s(engine: Engine) -> float:
    """How long LONG_VIDEO takes to prepare here: a kill or a cancel lands at a quarter of it."""
    start = time.monotonic()
    engine.prepare_many([LONG_VIDEO], PrepareOptions())
    return time.monotonic() - start


@pytest.fixture(scope="module")
def procs(engine: Engine) -> Iterator[PrepareProcesses]:
    p = engine.prepare_processes(2)
    p.start()
    yield p
    p.close()


def same(a: PreparedItem, b: PreparedItem) -> bool:
    if (a.modality, a.num_tokens, a.cost) != (b.modality, b.num_tokens, b.cost):
        return False
    for f in dataclasses.fields(a.inputs):
        x, y = getattr(a.inputs, f.name), getattr(b.inputs, f.name)
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("item", [IMAGE, CLIP, VIDEO, MIXED], ids=["image", "audio", "video", "text+image"])
def test_a_worker_prepares_what_this_thread_prepares(
    procs: PrepareProcesses, engine: Engine, item: Item
) -> None:
    job = procs.submit([item], PrepareOptions())
    (got,) = job.future.result(timeout=60)
    (want,) = engine.prepare_many([item], PrepareOptions())
    assert isinstance(got, PreparedItem) and isinstance(want, PreparedItem)
    assert same(got, want)
    assert job.seconds > 0


def test_each_worker_has_prepared_every_loaded_modality_before_its_first_job(procs: PrepareProcesses) -> None:
    """A cold worker's first video paid for the decoders' imports (90 ms against 33 on the H200):
    every worker prepares a small item of each modality as it starts."""
    warmed = [procs._pool.submit(prepare_processes._warmed).result(timeout=60) for _ in range(4)]
    assert warmed == [["audio", "image", "video"]] * 4


def test_a_bad_item_gives_its_error_in_its_slot(procs: PrepareProcesses) -> None:
    bad = Item((MediaPart("image", b"not an image at all"),))
    got = procs.submit([IMAGE, bad], PrepareOptions()).future.result(timeout=60)
    assert isinstance(got[0], PreparedItem)
    assert isinstance(got[1], MediaDecodeError) and got[1].param == "input"
    assert "could not decode image" in got[1].message


def test_cancel_stops_a_running_decode(procs: PrepareProcesses, long_s: float) -> None:
    job = procs.submit([LONG_VIDEO], PrepareOptions())
    time.sleep(long_s / 4)
    job.cancel()
    assert job.future.cancelled()
    task = job._task
    assert task is not None
    with pytest.raises(Cancelled):  # the worker stopped on the flag, not at the end of the video
        task.result(timeout=120)
    # and the slot is free again: a job after it runs normally
    assert isinstance(procs.submit([IMAGE], PrepareOptions()).future.result(timeout=60)[0], PreparedItem)


def test_a_worker_that_dies_is_replaced_and_its_job_runs_again(engine: Engine, long_s: float) -> None:
    p = engine.prepare_processes(1)
    try:
        p.start()
        (pid,) = p.pids()
        job = p.submit([LONG_VIDEO], PrepareOptions())
        time.sleep(long_s / 4)
        os.kill(pid, signal.SIGKILL)
        (got,) = job.future.result(timeout=120)
        assert isinstance(got, PreparedItem) and job.runs == 1 and p.restarts == 1
        assert p.pids() and p.pids() != [pid]
        assert isinstance(p.submit([IMAGE], PrepareOptions()).future.result(timeout=60)[0], PreparedItem)
    finally:
        p.close()


def test_a_job_running_at_two_deaths_fails_alone_as_bad_media(engine: Engine, long_s: float) -> None:
    """The job a worker died on twice fails with a 400-class error; a job queued behind it on the same
    worker through both deaths was never started, and still gets its items."""
    p = engine.prepare_processes(1)
    try:
        p.start()
        bad = p.submit([LONG_VIDEO], PrepareOptions())
        queued = p.submit([IMAGE], PrepareOptions())
        assert bad.slot is not None
        for death in range(2):
            deadline = time.monotonic() + 60
            while not (p._started[bad.slot] and p.pids()):  # running on a worker of the current pool
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(long_s / 4)
            os.kill(p.pids()[0], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while bad.runs == death and not bad.future.done():
                assert time.monotonic() < deadline
                time.sleep(0.01)
        with pytest.raises(MediaDecodeError, match="died on it twice"):
            bad.future.result(timeout=60)
        assert isinstance(queued.future.result(timeout=60)[0], PreparedItem)
        assert p.restarts == 2
    finally:
        p.close()


def test_a_late_cancel_does_not_reach_the_next_job_on_its_slot(procs: PrepareProcesses) -> None:
    done = procs.submit([IMAGE], PrepareOptions())
    done.future.result(timeout=60)
    deadline = time.monotonic() + 10
    while not done.released:  # its slot goes back once its worker has left it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    after = procs.submit([LONG_VIDEO], PrepareOptions())
    assert after.slot == done.slot  # the slot is reused at once
    done.cancel()  # a client that left after its answer was sent
    assert isinstance(after.future.result(timeout=120)[0], PreparedItem)


def test_workers_that_cannot_start_say_so(tmp_path: Path, engine: Engine) -> None:
    pre = engine.preprocessor
    p = PrepareProcesses(1, tmp_path, pre.config, pre.limits, sorted(pre.modalities))  # no tokenizer here
    try:
        with pytest.raises(EngineError, match="failed to start"):
            p.start(timeout_s=120)
    finally:
        p.close()


def test_a_worker_exits_when_its_server_is_killed(tmp_path: Path, tiny_bf16: Path) -> None:
    """SIGKILL of the serving process (no close() runs): its workers leave within seconds."""
    script = tmp_path / "server.py"
    script.write_text(
        "import sys, time\n"
        "from eg2_runtime.engine import Engine\n"
        "if __name__ == '__main__':\n"
        f"    p = Engine.from_dir({str(tiny_bf16)!r}, device='cpu').prepare_processes(1)\n"
        "    p.start()\n"
        "    print(p.pids()[0], flush=True)\n"
        "    time.sleep(600)\n"
    )
    root = Path(__file__).resolve().parents[2]
    server = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    try:
        assert server.stdout is not None
        worker = int(server.stdout.readline())
        server.kill()
        server.wait(timeout=30)
        deadline = time.monotonic() + 15
        while _alive(worker):
            assert time.monotonic() < deadline, "the worker outlived its server"
            time.sleep(0.1)
    finally:
        server.kill()
        server.wait(timeout=30)
        if server.stdout is not None:
            server.stdout.close()


def test_close_stops_the_workers(engine: Engine) -> None:
    p = engine.prepare_processes(2)
    p.start()
    pids = p.pids()
    p.close()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "workers still alive after close()"
        time.sleep(0.05)


def test_without_dev_shm_the_items_come_through_the_pipe(
    monkeypatch: pytest.MonkeyPatch, engine: Engine
) -> None:
    item = engine.prepare_many([IMAGE], PrepareOptions())[0]
    shipped = prepare_processes._ship([item])
    assert shipped[1] is not None and shipped[2]  # the tensors went to a file
    assert same(prepare_processes._receive(*shipped)[0], item)
    assert not Path(shipped[1]).exists()  # read once, then removed
    monkeypatch.setattr(prepare_processes, "SHM_DIR", Path("/nonexistent-eg2-shm"))
    shipped = prepare_processes._ship([item])
    assert shipped[1] is None and shipped[2] == []
    assert same(prepare_processes._receive(*shipped)[0], item)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie until its parent reaps it
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_no_file_is_left_in_dev_shm(engine: Engine) -> None:
    """A job cancelled after its worker wrote its file: the file is removed unread. close() removes
    what a killed worker was writing."""
    from concurrent.futures import Future

    p = engine.prepare_processes(1)
    try:
        item = engine.prepare_many([IMAGE], PrepareOptions())[0]
        shipped = prepare_processes._ship([item])
        assert shipped[1] is not None and Path(shipped[1]).exists()
        job = prepare_processes.PrepareJob(p, [IMAGE], PrepareOptions(), None)
        job.future.cancel()
        task: Future[object] = Future()
        task.set_result((0.01, shipped))
        p._done(p._pool, job, task)
        assert not Path(shipped[1]).exists()
        stray = prepare_processes.SHM_DIR / f"eg2-prep-{p.token}-999999-0"
        stray.write_bytes(b"half written")
    finally:
        p.close()
    assert not stray.exists()
