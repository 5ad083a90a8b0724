"""Preparing items in worker processes: decoding and preprocessing outside the serving process's GIL.

Why: the service prepares media on threads of the process that also runs the event loop and the GPU
thread. Decoders and torch's CPU ops release the GIL, but every hand-back waits for it: on the H200
host one 641x479 PNG took 7.7 ms to prepare alone in a process and 12.5-17.5 ms inside the serving
process (docs/PERF.md). A worker process prepares it with a GIL of its own.

    submit(items, options) ──► a job: one ProcessPoolExecutor task on a spawned worker
        worker: Preprocessor.prepare_batch(items) -> PreparedItems, pickled once: the tensors'
                bytes out of band into one file in /dev/shm, the rest through the pool's pipe
        └─► the pool's result thread reads and unpickles them into the job's future (off the event loop)

Each worker builds its own Preprocessor from the model directory (tokenizer, processor config),
imports torch but never touches the GPU, and runs torch and BLAS on one thread: the workers already
use the cores in parallel.

Cancelling: a job has a slot in a shared array of flags; `PrepareJob.cancel()` sets it and the
worker's decoders stop within a frame or an audio block, as a thread's cancel flag stops them. A job
not yet started is dropped.

A worker that dies (a decoder crash, the kernel's OOM killer) breaks the pool: its other workers are
killed, the pool is started again, and every job that was in it runs again on the new one. Only a
job that was running when a worker died counts the death: one running at both of two deaths fails
alone, as undecodable media (MediaDecodeError), and jobs that were only queued are not lost with it.
A worker whose server died exits within a second.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from eg2_runtime.api import PreparedItem
from eg2_runtime.config import ModelConfig
from eg2_runtime.errors import EG2Error, EngineError, MediaDecodeError
from eg2_runtime.inputs import Item, MediaKind, MediaLimits, PrepareOptions

log = logging.getLogger(__name__)

SLOTS = 4096  # cancel flags: jobs in flight past this many run without one (admission bounds them far lower)
RUNS = 2  # a job fails once workers died this many times while it ran


class PrepareJob:
    """One submitted job: `future` gives its PreparedItems (or errors, each in its item's slot), and
    `seconds` how long the worker took. `slot`: its cancel and started flags, held until its worker is
    done with them (`released`)."""

    def __init__(
        self, owner: PrepareProcesses, items: Sequence[Item], options: PrepareOptions, slot: int | None
    ):
        self.future: Future[list[PreparedItem | EG2Error]] = Future()
        self.seconds = 0.0
        self.runs = 0  # worker deaths while it ran (a run that only queued does not count)
        self.released = False
        self._task: Future[Any] | None = None  # the pool's task of its current run
        self._owner, self._items, self._options, self.slot = owner, list(items), options, slot

    def cancel(self) -> None:
        """Stop the work: dropped if not started, stopped within a frame or block if running."""
        self._owner._cancel(self)


class PrepareProcesses:
    """N spawned worker processes running `Preprocessor.prepare_batch` for the items they are given."""

    def __init__(
        self,
        n: int,
        model_dir: Path,
        config: ModelConfig,
        limits: MediaLimits | None,
        modalities: Sequence[MediaKind],
    ) -> None:
        if n < 1:
            raise ValueError("PrepareProcesses needs at least one process")
        self.n = n
        # spawn, not fork: the serving process has a CUDA context and threads, which a fork would copy.
        self._ctx = multiprocessing.get_context("spawn")
        self._flags = self._ctx.RawArray(ctypes.c_bool, SLOTS)  # set: stop that job
        self._started = self._ctx.RawArray(ctypes.c_bool, SLOTS)  # set by the worker that runs it
        self._free = list(range(SLOTS))
        self._lock = threading.Lock()
        # Names this server's files in /dev/shm: a process id alone may repeat across containers
        # that share it.
        self.token = os.urandom(6).hex()
        self._initargs = (model_dir, config, limits, list(modalities), self._flags, self._started, self.token)
        self._pool = self._new_pool()
        self._closed = False
        self.restarts = 0
        self.in_flight = 0  # jobs submitted and not yet done

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.n, mp_context=self._ctx, initializer=_init, initargs=self._initargs)

    def start(self, timeout_s: float = 120.0) -> None:
        """Start every worker now and wait until each has built its preprocessor (the boot calls this
        before the server turns ready: a worker imports torch, seconds)."""
        deadline, seen = time.monotonic() + timeout_s, set[int]()
        try:
            while len(seen) < self.n:  # a fast worker may take two of a round's tasks: go again
                tasks = [self._pool.submit(_ready, 0.05) for _ in range(self.n)]
                seen |= {t.result(timeout=max(0.0, deadline - time.monotonic())) for t in tasks}
        except BrokenProcessPool as e:
            raise EngineError(
                "the media-preparing processes failed to start (their error is in the log above); "
                "set preprocess_processes=0 to prepare media on threads instead"
            ) from e

    def pids(self) -> list[int]:
        """The live workers' process ids (tests, and what an operator sees in ps)."""
        processes = getattr(self._pool, "_processes", None) or {}  # None once the pool is shut down
        return [p.pid for p in list(processes.values()) if p.pid is not None]

    def submit(self, items: Sequence[Item], options: PrepareOptions) -> PrepareJob:
        with self._lock:
            slot = self._free.pop() if self._free else None
            self.in_flight += 1
        if slot is not None:
            self._flags[slot] = self._started[slot] = False
        job = PrepareJob(self, items, options, slot)
        job.future.add_done_callback(lambda _: self._release(job))
        self._run(job)
        return job

    def close(self) -> None:
        """Stop the workers: queued jobs are cancelled, running ones are killed. Idempotent."""
        with self._lock:
            self._closed = True
            pool = self._pool
        _stop(pool)
        _sweep(self.token)  # what a killed worker was writing

    # ---- the job's runs ---------------------------------------------------------------------------

    def _run(self, job: PrepareJob) -> None:
        if job.future.done():  # cancelled meanwhile
            return
        if job.slot is not None:
            self._started[job.slot] = False
        pool = self._pool
        try:
            task = pool.submit(_prepare, job._items, job._options, job.slot)
        except BrokenProcessPool:
            self._broken(pool, job)
            return
        except Exception as e:  # shut down, or a worker that could not be spawned: fail, never hang
            _settle(job.future, None, EngineError(f"the preparing processes cannot take work ({e})"))
            return
        job._task = task
        task.add_done_callback(lambda t: self._done(pool, job, t))

    def _done(self, pool: ProcessPoolExecutor, job: PrepareJob, task: Future[Any]) -> None:
        """On the pool's result thread: unpickle the items here, not on the caller's event loop. A job
        cancelled while its worker ran still has its file in /dev/shm: removed unread."""
        if job.future.done():
            if not task.cancelled() and task.exception() is None:
                _discard(task.result()[1])
            return
        if task.cancelled():
            job.future.cancel()
            return
        error = task.exception()
        if isinstance(error, BrokenProcessPool):
            self._broken(pool, job)
            return
        if error is not None:
            _settle(job.future, None, error)
            return
        try:
            seconds, payload = task.result()
            job.seconds = seconds
            _settle(job.future, _receive(*payload), None)
        except Exception as e:  # an unpicklable result is a bug: the request gets a 500, not a hang
            _settle(job.future, None, EngineError(f"a preparing process returned an unreadable result ({e})"))

    def _broken(self, pool: ProcessPoolExecutor, job: PrepareJob) -> None:
        """A worker of `pool` died: stop its other workers and start a new pool (once per broken pool),
        then run the job again there, unless it was running at this death and the one before."""
        with self._lock:
            restart = self._pool is pool and not self._closed
            if restart:
                log.error("a preparing process died; starting the pool again")
                self._pool = self._new_pool()
                self.restarts += 1
        if restart:
            _stop(pool)  # its survivors would finish jobs that run again on the new pool
            _sweep(self.token, dead_only=True)
        if job.slot is None or self._started[job.slot]:
            job.runs += 1  # it was running (or there is no telling): this death counts against it
        if self._closed:
            _settle(job.future, None, EngineError("the preparing processes are stopped"))
            return
        if job.runs >= RUNS:
            _settle(
                job.future,
                None,
                MediaDecodeError(
                    "could not prepare this media: a preparing process died on it twice", param="input"
                ),
            )
            return
        self._run(job)

    def _cancel(self, job: PrepareJob) -> None:
        with self._lock:  # the flag only while the slot is still this job's
            if job.slot is not None and not job.released:
                self._flags[job.slot] = True
        task = job._task
        if task is not None:
            task.cancel()  # only a task not yet handed to a worker
        job.future.cancel()

    def _release(self, job: PrepareJob) -> None:
        """The job's slot is free again once its future is done and its worker has left it: a running
        task that was cancelled may still read its flag, so the slot waits for the task."""
        with self._lock:
            self.in_flight -= 1
        if job.slot is None:
            return
        task = job._task

        def free(_: object = None) -> None:
            with self._lock:
                job.released = True
                self._free.append(job.slot)  # type: ignore[arg-type]

        if task is None or task.done():
            free()
        else:
            task.add_done_callback(free)


def _settle(future: Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


# ---- in the worker process ------------------------------------------------------------------------

_STATE: dict[str, Any] = {}


class _SharedFlag(threading.Event):
    """A job's cancel flag as the decoders read it (`is_set`): one byte the serving process sets."""

    def __init__(self, flags: Any, slot: int) -> None:
        super().__init__()
        self._flags, self._slot = flags, slot

    def is_set(self) -> bool:
        return bool(self._flags[self._slot])


def _init(
    model_dir: Path,
    config: ModelConfig,
    limits: MediaLimits | None,
    modalities: list[MediaKind],
    flags: Any,
    started: Any,
    token: str,
) -> None:
    # Ctrl-C reaches the whole process group: the server's to act on (it drains, then stops these
    # workers). SIGTERM is not ignored: the pool stops a broken pool's survivors with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(os.getppid())
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a worker holds no GPU memory, whatever it imports
    import torch

    from eg2_runtime.engine import single_threaded_numpy_blas
    from eg2_runtime.preprocess.preprocessor import Preprocessor

    torch.set_num_threads(1)
    single_threaded_numpy_blas()
    pre = Preprocessor.from_dir(model_dir, config, limits=limits, modalities=modalities)
    _STATE.update(pre=pre, flags=flags, started=started, token=token)
    _warm(pre, modalities)


def _watch_parent(parent: int) -> None:
    """Exit once the serving process is gone (killed: no close() ran), checked every second from a
    daemon thread; a worker is not left running on its own."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="eg2-parent-watch", daemon=True).start()


def _warm(pre: Any, modalities: list[MediaKind]) -> None:
    """Prepare one small item of each loaded modality, so a worker's first request does not pay for
    the decoders' imports and first calls (H200, 2026-12-02: an 8-frame video took 90 ms to prepare
    on cold workers against 33 ms on the serving process's warm threads)."""
    from eg2_runtime import samples
    from eg2_runtime.inputs import MediaPart

    media = {
        "image": lambda: samples.png(96, 64),
        "audio": lambda: samples.wav(1.0),
        "video": lambda: samples.mp4(2),
    }
    items = [Item((MediaPart(kind, make()),)) for kind, make in media.items() if kind in modalities]
    done = pre.prepare_batch(items, PrepareOptions(), executor=None)
    _STATE["warmed"] = sorted(p.modality for p in done if not isinstance(p, EG2Error))


def _warmed() -> list[str]:
    """The modalities this worker prepared at start (tests ask a worker through the pool)."""
    return list(_STATE.get("warmed", []))


def _ready(seconds: float) -> int:
    time.sleep(seconds)  # hold this worker so the next start-up task goes to another one
    return os.getpid()


def _prepare(items: list[Item], options: PrepareOptions, slot: int | None) -> tuple[float, Shipped]:
    from eg2_runtime.engine import wrap_prepared

    start = time.monotonic()
    cancel = None
    if slot is not None:
        _STATE["started"][slot] = True  # a worker dying from here on counts against this job
        cancel = _SharedFlag(_STATE["flags"], slot)
    out = _STATE["pre"].prepare_batch(items, options, executor=None, cancel=cancel)
    prepared = [p if isinstance(p, EG2Error) else wrap_prepared(p) for p in out]
    return time.monotonic() - start, _ship(prepared)


# ---- the way back: tensors through a file in shared memory, the rest pickled -----------------------
#
# Through the pool's pipe, one prepared 641x479 image (1.9 MB) took 4.4 ms to arrive and 3 ms to pickle
# and unpickle as torch tensors (dev machine). Instead the worker pickles the tensors' bytes out of band
# (as numpy buffers, protocol 5) into one file under /dev/shm, and sends only the small pickle and the
# file's name: one copy in, one copy out. Where /dev/shm is missing or full (a container's default is
# 64 MiB), the whole pickle goes through the pipe instead.

SHM_DIR = Path("/dev/shm")
Shipped = tuple[bytes, str | None, list[int]]  # (pickle, file holding its buffers or None, their sizes)
_SEQ = iter(range(1 << 62))


def _from_numpy(array: Any) -> Any:
    import torch

    return torch.from_numpy(array)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        import torch

        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.dtype not in _NO_NUMPY:
            return _from_numpy, (obj.detach().contiguous().numpy(),)
        return NotImplemented


_NO_NUMPY: set[Any] = set()  # dtypes numpy has no type for: filled on first use (bfloat16)


def _ship(obj: Any) -> Shipped:
    import io

    import torch

    _NO_NUMPY.add(torch.bfloat16)
    buffers: list[pickle.PickleBuffer] = []
    head = io.BytesIO()
    _Pickler(head, protocol=5, buffer_callback=buffers.append).dump(obj)
    if not buffers:
        return head.getvalue(), None, []
    views = [b.raw() for b in buffers]
    path = SHM_DIR / f"eg2-prep-{_STATE.get('token', 'x')}-{os.getpid()}-{next(_SEQ)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for view in views:
                while view:
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    except OSError:  # no /dev/shm, or full: everything through the pipe
        path.unlink(missing_ok=True)
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None, []
    return head.getvalue(), str(path), [v.nbytes for v in views]


def _discard(shipped: Shipped) -> None:
    if shipped[1] is not None:
        Path(shipped[1]).unlink(missing_ok=True)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Shut `pool` down and kill its workers, running or not (a survivor of a broken pool may be
    blocked writing a result nobody reads)."""
    processes = list(
        (getattr(pool, "_processes", None) or {}).values()
    )  # private, until 3.14's terminate_workers
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(timeout=5)


def _sweep(token: str, dead_only: bool = False) -> None:
    """Remove this server's workers' files from /dev/shm: all of them, or those of workers no longer
    alive (a worker killed while writing leaves its file behind). Best effort."""
    for path in SHM_DIR.glob(f"eg2-prep-{token}-*"):
        try:
            worker = int(path.name.split("-")[3])
            if dead_only and Path(f"/proc/{worker}").exists():
                continue
            path.unlink(missing_ok=True)
        except (OSError, ValueError):
            continue


def _receive(head: bytes, path: str | None, sizes: list[int]) -> Any:
    if path is None:
        return pickle.loads(head)
    data = bytearray(sum(sizes))
    try:
        with open(path, "rb", buffering=0) as f:
            view, got = memoryview(data), 0
            while got < len(data):
                n = f.readinto(view[got:])
                if not n:
                    raise EOFError(f"{path}: {got} of {len(data)} bytes")
                got += n
    finally:
        os.unlink(path)
    views, at = [], 0
    for size in sizes:
        views.append(memoryview(data)[at : at + size])
        at += size
    return pickle.loads(head, buffers=views)  # numpy arrays over `data`, tensors over those: no copy
