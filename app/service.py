"""The service's lifecycle: load the engine, warm it up, serve, drain, stop.

    loading ──► ready ──► draining ──► (exit 0)
       └──► failed (exit 1): checkpoint missing or corrupt, warm-up out of memory, demo cache unwritable

On the way to ready, once warm, the startup heap is frozen out of the garbage collector's scans
(freeze_startup_heap); stop() gives it back.

Loading runs in the background once the server listens, so /ready can answer 503 meanwhile. The
server (app/server.py) polls `should_exit` and uses `exit_code`; a signal starts `begin_drain`.
After stop(), `busy_threads` names the worker pools still inside an engine call, which the process
must not finalize under (app/server.py exit_now).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import gc
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from app.batcher import Batcher
from app.cores import usable_cores
from app.errors import ModelNotFound, Unavailable, clip
from app.metrics import Metrics
from app.queues import Embedded
from app.schemas import InputRequest
from app.settings import Settings
from app.threads import JOIN_TIMEOUT_S, Threads
from eg2_runtime.api import EngineAPI, TokenCount
from eg2_runtime.errors import EG2Error
from eg2_runtime.inputs import Item, PrepareOptions, resolve_prompt

log = logging.getLogger("eg2.service")
T = TypeVar("T")

DEMO_BANNER = (
    "NO MODEL CONFIGURED: serving the tiny DEMO checkpoint with RANDOM weights. Its vectors are "
    "meaningless (the API, batching and errors all work). Set EG2_MODEL / --model to a real checkpoint."
)


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class StartupError(Exception):
    """The server cannot start; the message says why and what to change."""


def ensure_demo_model(cache_dir: Path, write: Callable[..., Any] | None = None) -> Path:
    """The cached tiny demo checkpoint, built on first use (atomically: a crash leaves no half model)."""
    target = cache_dir / "demo-tiny"
    if (target / ".complete").exists():
        return target
    tmp: Path | None = None
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        if write is None:
            from eg2_runtime.tools.demo_model import write_demo_model  # pulls in torch

            write = write_demo_model
        tmp = Path(tempfile.mkdtemp(prefix=".demo-tiny-", dir=cache_dir))
        write(tmp, size="tiny", seed=0)
        (tmp / ".complete").touch()
        if (target / ".complete").exists():  # another process finished first: use theirs
            return target
        if target.exists():  # a crashed, incomplete build
            shutil.rmtree(target)
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise StartupError(
            f"cannot build the demo model under {cache_dir}: {reason}. Point EG2_CACHE_DIR (--cache-dir) at a "
            "writable directory with free space, or EG2_MODEL (--model) at a checkpoint."
        ) from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def freeze_startup_heap() -> float:
    """Collect once, then move every object alive now (modules, the model, the tokenizer, the graphs)
    into the GC's permanent generation, as vLLM, SGLang and Ray Serve do after warm-up. Returns the
    seconds it took.

    Why: a full (generation 2) collection walks every tracked object with the GIL held, stalling the
    event loop and the GPU thread: 181-192 ms over ~370k objects, against 0.4 ms frozen (dev machine,
    tiny engine, benchmarks/gc_pauses.py). Single-text load brought one in one of
    five runs of 20,000 requests; 32-text requests brought them often: server CPU per item 51.0 ->
    13.5 us with the freeze (fake engine, benchmarks/server_cpu.py). The trade-off: a reference cycle
    among frozen objects that later becomes garbage is never collected; the startup heap lives as
    long as the process anyway. Service.stop unfreezes (a test process starts many services).
    """
    start = time.monotonic()
    gc.collect()
    gc.freeze()
    return time.monotonic() - start


def load_engine(settings: Settings) -> EngineAPI:
    """Engine.from_dir under the settings (blocking: run it off the event loop)."""
    if settings.model is None:
        log.warning(DEMO_BANNER)
        model_dir = ensure_demo_model(settings.cache_dir)
    else:
        model_dir = settings.model
        if not model_dir.is_dir():
            raise StartupError(f"no checkpoint directory at {model_dir} (EG2_MODEL / --model)")
    from eg2_runtime.engine import Engine, EngineOptions  # pulls in torch: only when really loading

    options = EngineOptions(
        gpu_memory_budget=None if settings.gpu_memory_mib is None else settings.gpu_memory_mib << 20,
        max_forward_tokens=settings.max_batch_tokens,
        graph_max_tokens=settings.cuda_graph_max_tokens,
        packed_text=settings.packed_text,
        cpu_threads=settings.engine_cpu_threads,
        host_token_table=settings.host_token_table,
    )
    engine: EngineAPI = Engine.from_dir(
        model_dir,
        device=settings.device,
        modalities=None if settings.modalities is None else frozenset(settings.modalities),
        limits=settings.media_limits(),
        pack=settings.pack,
        options=options,
    )
    return engine


GPU_BATCH_TOKENS, CPU_BATCH_TOKENS = 16384, 2048
GPU_MEMORY_KINDS = {
    "process": "process_gpu_bytes",
    "budget": "gpu_budget_bytes",
    "allocated": "gpu_allocated_bytes",
    "reserved": "gpu_reserved_bytes",
}


class Service:
    """Owns the engine and the batcher of one app."""

    def __init__(self, settings: Settings, metrics: Metrics, engine: EngineAPI | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.demo = settings.model is None and engine is None
        self.started_at = int(time.time())
        self.state = State.LOADING
        self.failure: str | None = None
        self.should_exit = False  # polled by the server loop
        self.exit_code = 0
        self.active = 0  # embedding requests admitted past the readiness gate, not yet answered
        self.requests_started = 0  # every such request so far, refused by the batcher or not
        self._engine = engine
        self._batcher: Batcher | None = None
        self._loader: Threads | None = None  # the GPU thread, until the Batcher takes it over
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._frozen = False  # this service froze the startup heap (freeze_startup_heap)
        self.busy_threads: list[str] = []  # worker pools still inside an engine call after stop()

    @property
    def engine(self) -> EngineAPI:
        if self._engine is None or self.state is State.LOADING:
            raise Unavailable("the model is loading; retry shortly", headers={"retry-after": "5"})
        return self._engine

    @property
    def batcher(self) -> Batcher | None:
        return self._batcher

    def batch_tokens(self) -> int:
        """The token budget: the setting, else a default for where the engine runs (on a GPU the
        engine's memory plan sets tighter limits per modality, Batcher.warmup)."""
        if self.settings.max_batch_tokens is not None:
            return self.settings.max_batch_tokens
        return GPU_BATCH_TOKENS if self._on_gpu() else CPU_BATCH_TOKENS

    def _on_gpu(self) -> bool:
        """Whether the loaded engine runs on a GPU (its memory report has a budget only there)."""
        return self._engine is not None and "gpu_budget_bytes" in self._engine.memory()

    def prepare_processes(self) -> int:
        """Media-preparing processes: none for a text-only engine (they would never get a job); else
        the setting, else on a GPU one per two of the cores this process may run on (at most 8), and
        none on a CPU (the model's forward wants those cores)."""
        assert self._engine is not None
        if not self._engine.modalities - {"text"}:
            return 0
        if self.settings.preprocess_processes is not None:
            return self.settings.preprocess_processes
        return max(1, min(8, usable_cores() // 2)) if self._on_gpu() else 0

    def prepared_media_tokens(self) -> int:
        """The media budget: the setting, else two batches' worth of tokens."""
        return self.settings.max_prepared_media_tokens or 2 * self.batch_tokens()

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Called by the lifespan once the event loop runs: boots in the background."""
        self._loop = asyncio.get_running_loop()
        self._spawn(self._boot())

    async def _boot(self) -> None:
        try:
            # Loads the engine, then runs its GPU calls; stop() closes it whichever owns it then.
            gpu = self._loader = Threads(1, "eg2-gpu")
            if self._engine is None:
                self._engine = await gpu.submit(load_engine, self.settings)
            s = self.settings
            self._batcher = Batcher(
                self._engine,
                self.metrics,
                max_batch_tokens=self.batch_tokens(),
                max_batch_items=s.max_batch_items,
                max_queue_delay_s=s.max_queue_delay_ms / 1000,
                max_queued_items=s.max_queued_items,
                preprocess_workers=s.preprocess_workers,
                stall_timeout_s=s.stall_timeout_s,
                inline_prepare_chars=s.inline_prepare_chars,
                max_request_tokens=s.max_request_tokens,
                max_prepared_media_tokens=self.prepared_media_tokens(),
                max_request_gather_s=s.max_request_gather_ms / 1000,
                max_request_segments=s.max_request_segments,
                gpu_thread=gpu,
                prepare_processes=self.prepare_processes(),
            )
            self._batcher.start()
            await self._batcher.warmup()
            if s.cuda_graphs_at_start:
                await self._batcher.on_gpu_thread(self._engine.capture_graphs)
            self._publish_memory()
            self.metrics.graphs.source = self._engine.graph_stats  # read at each scrape from here on
            log.info("GPU memory after warm-up", extra={"memory": self._engine.memory()})
        except (StartupError, EG2Error) as exc:
            self._fail(getattr(exc, "message", None) or str(exc))
            return
        except Exception as exc:
            log.exception("startup failed")
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        if self.state is State.LOADING:
            seconds = freeze_startup_heap()
            self._frozen = True
            log.info("startup heap frozen", extra={"seconds": seconds, "objects": gc.get_freeze_count()})
            self.state = State.READY
            self.metrics.ready.set(1)
            log.info("ready", extra={"modalities": sorted(self._engine.modalities), "demo": self.demo})
            if self.demo:
                log.warning(DEMO_BANNER)

    def _fail(self, reason: str) -> None:
        log.error("cannot start: %s", reason)
        self.failure = reason
        self.state = State.FAILED
        self.exit_code = 1
        self.should_exit = True

    def begin_drain(self) -> None:
        """Stop taking work, finish what is in flight (bounded by the drain deadline), then exit."""
        if self.state in (State.DRAINING, State.FAILED):
            return
        self.state = State.DRAINING
        self.metrics.ready.set(0)
        log.info("draining", extra={"in_flight": self.active, "deadline_s": self.settings.drain_deadline_s})
        self._spawn(self._drain())

    def begin_drain_threadsafe(self) -> None:
        """From a signal handler or another thread."""
        if self._loop is not None and not self._loop.is_closed():
            # A fresh context: a signal lands in whatever code runs, perhaps a request's, whose id the
            # drain's log lines must not carry.
            self._loop.call_soon_threadsafe(self.begin_drain, context=contextvars.Context())
        else:
            self.should_exit = True

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.settings.drain_deadline_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.active:
            log.warning("drain deadline passed; failing what is left", extra={"in_flight": self.active})
            if self._batcher is not None:
                self._batcher.abort(Unavailable("the server is shutting down"))
            grace = time.monotonic() + 1.0
            while self.active and time.monotonic() < grace:
                await asyncio.sleep(0.01)
        log.info("drained")
        self.should_exit = True

    async def stop(self) -> None:
        """Called by the lifespan on shutdown."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        try:
            if self._batcher is not None:
                self.busy_threads = await self._batcher.close()
            elif self._loader is not None:  # stopped while loading: the thread may be inside torch
                self._loader.close()
                if not await self._loader.join(JOIN_TIMEOUT_S):
                    self.busy_threads = [self._loader.name]
        finally:
            if self._frozen:  # back into the oldest generation: collectable again
                gc.unfreeze()
                self._frozen = False

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- serving -------------------------------------------------------------------------------

    def check_ready(self) -> None:
        if self.state is State.READY:
            return
        if self.state is State.DRAINING:
            raise Unavailable("the server is shutting down", headers={"connection": "close"})
        if self.state is State.FAILED:
            raise Unavailable("the server failed to start")
        raise Unavailable("the model is loading; retry shortly", headers={"retry-after": "5"})

    def check_model(self, name: str | None) -> None:
        s = self.settings
        if name is not None and name != s.served_name and name not in s.aliases:
            raise ModelNotFound(
                f"the model {clip(name)!r} does not exist; this server serves {s.served_name!r}",
                param="model",
            )

    def prepare_options(self, request: InputRequest) -> PrepareOptions:
        engine = self.engine
        prompt = resolve_prompt(
            engine.prompts, engine.default_prompt_name, request.prompt_name, request.prompt
        )
        return PrepareOptions(prompt=prompt, truncate=request.truncate, image_tokens=request.image_tokens)

    async def embed(self, items: list[Item], options: PrepareOptions) -> Embedded:
        self.check_ready()
        assert self._batcher is not None
        return await self._timed(self._batcher.embed(items, options))

    async def tokenize(self, items: list[Item], options: PrepareOptions) -> list[TokenCount]:
        self.check_ready()
        assert self._batcher is not None
        return await self._timed(self._batcher.tokenize(items, options))

    async def _timed(self, work: Coroutine[Any, Any, T]) -> T:
        """`work` under the request timeout (503 past it), counted as in flight for the drain."""
        self.active += 1
        self.requests_started += 1
        try:
            async with asyncio.timeout(self.settings.request_timeout_s):
                return await work
        except TimeoutError:
            raise Unavailable(f"request timed out after {self.settings.request_timeout_s:g} s") from None
        finally:
            self.active -= 1

    def holds_work(self) -> bool:
        """Whether an embedding or tokenize request is in flight, items wait for the GPU, or a GPU call
        runs (a request that timed out or lost its client may leave its batch running; its decoding
        stops at its cancel flag)."""
        batcher = self._batcher
        return self.active > 0 or (
            batcher is not None and (batcher.queued() > 0 or batcher.stalled_for() > 0)
        )

    def health_problem(self) -> str | None:
        if self.state is State.FAILED:
            # The reason is in the log: it may name server paths, and /health answers without a key.
            return "startup failed; the server log has the reason"
        return self._batcher.problem() if self._batcher is not None else None

    def _publish_memory(self) -> None:
        if self._engine is None:
            return
        memory = self._engine.memory()
        self.metrics.weight_bytes.labels("resident").set(memory.get("weight_bytes_resident", 0))
        self.metrics.weight_bytes.labels("bf16_equivalent").set(memory.get("weight_bytes_bf16_equivalent", 0))
        # The engine's keys (Engine.memory) -> the gauge's kinds.
        for kind, key in GPU_MEMORY_KINDS.items():
            value = memory.get(key)
            if isinstance(value, int):
                self.metrics.gpu_memory_bytes.labels(kind).set(value)

    def refresh_metrics(self) -> None:
        """Gauges read at scrape time."""
        if self.state is not State.LOADING:
            self._publish_memory()
        if self._batcher is not None:
            self.metrics.gpu_busy_seconds.set(self._batcher.stalled_for())
