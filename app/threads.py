"""Worker threads whose results land in asyncio futures: the batcher's preparing threads and its one
GPU thread, and the service's loader before the batcher takes that thread over.

    Threads.submit(fn, *args) -> an asyncio future, settled on the event loop's thread
    run_here(fn, *args)       -> the same, run now on the event loop's thread (no hop)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("eg2.threads")
T = TypeVar("T")
JOIN_TIMEOUT_S = 1.0  # how long close() waits for worker threads to finish their current job


class Threads:
    """N daemon threads draining one job queue; each result lands in an asyncio future.

    Not concurrent.futures: its workers are joined at interpreter exit, so one wedged engine call
    would keep the process alive past its drain deadline. A job whose future was cancelled before a
    thread picked it up is skipped. Stop them with close() then `await join(timeout)`: a daemon thread
    still dropping tensors when the interpreter finalizes is killed inside a C++ destructor, and the
    whole process aborts (SIGABRT) instead of exiting 0.
    """

    def __init__(self, n: int, name: str, init: Callable[[], None] | None = None) -> None:
        """`init`: run first on each thread (the engine's set-up of a preparing thread)."""
        self.name = name
        self._init = init
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def idents(self) -> set[int | None]:
        return {t.ident for t in self._threads}

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)

    async def join(self, timeout_s: float) -> bool:
        """Wait for the threads to leave after close(); False if one is still busy at the deadline."""
        deadline = time.monotonic() + timeout_s
        while any(t.is_alive() for t in self._threads):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def _work(self) -> None:
        if self._init is not None:
            try:
                self._init()
            except Exception:  # a set-up that fails must not leave the queue without this worker
                log.exception("setting up the %s thread failed", self.name)
        while (job := self._jobs.get()) is not None:
            run_job(*job)
            del job  # drop this job's tensors now, not when the next job comes (which may be at exit)


def run_job(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], fn: Any, args: Any) -> None:
    if future.cancelled():  # read across threads: at worst the work is done for nothing
        return
    try:
        result, error = fn(*args), None
    except BaseException as exc:
        result, error = None, exc
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting
        loop.call_soon_threadsafe(settle, future, result, error)


def settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def run_here(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """fn(*args) now, on the event loop's thread, its result or error settled into a future (what a
    Threads job gives, with no thread and no queue: nothing can cancel it before it runs)."""
    future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    try:
        result, error = fn(*args), None
    except Exception as exc:
        result, error = None, exc
    settle(future, result, error)
    return future
