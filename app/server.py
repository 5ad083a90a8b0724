"""Running the app under uvicorn, with a graceful drain on SIGTERM / SIGINT.

uvicorn alone stops listening at the first signal and waits for connections, so /ready never
reports the drain and new requests are refused at TCP level. Here the first signal only starts the
service's drain (/ready 503, new requests 503, in-flight ones finish within the drain deadline); the
server stops when the service says so. A second signal stops at once. A call into the engine that
outlives the drain (the batcher waits 1 s for it) ends with the process: see exit_now.

Connections are served by app/connections.py's protocol (header timeout and size, the connection
cap); `serve` also fits the process's file-descriptor limit to that cap.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import sys
import time
from types import FrameType
from typing import NoReturn

import uvicorn

from app import malloc
from app.connections import ConnectionLimits, Connections, protocol_class
from app.main import create_app
from app.malloc import IdleTrim, tune_malloc
from app.service import Service, State
from app.settings import Settings
from eg2_runtime.api import EngineAPI

log = logging.getLogger("eg2.server")


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service, connections: Connections) -> None:
        super().__init__(config)
        self.service = service
        self.connections = connections
        idle_s = service.settings.malloc_trim_idle_s
        self.idle_trim = IdleTrim(idle_s, time.monotonic()) if idle_s > 0 and malloc.available() else None
        self._trimming = False
        self._signalled = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled:
            log.warning("second signal: stopping now")
            super().handle_exit(sig, frame)
            return
        self._signalled = True  # not recorded by uvicorn, so it is not re-raised: a drained exit is exit 0
        log.info("signal %d: draining", sig)
        self.service.begin_drain_threadsafe()

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's loop calls this every 0.1 s: also starts the idle server's trim (app/malloc.py)."""
        service = self.service
        if (
            self.idle_trim is not None
            and not self._trimming
            and service.state is State.READY
            and self.idle_trim.due(time.monotonic(), service.requests_started, service.holds_work())
        ):
            self._start_trim()
        return await super().on_tick(counter) or service.should_exit

    def _start_trim(self) -> None:
        """The trim on the loop's executor: it takes longer the more heap is free, and a request may
        come meanwhile. One at a time; a trim that cannot start or fails is logged, never raised into
        uvicorn's loop."""
        try:
            future = asyncio.get_running_loop().run_in_executor(None, malloc.trim)
        except RuntimeError as exc:  # no thread could start, or the executor is shutting down
            log.warning("malloc trim not started: %s", exc)
            return
        self._trimming = True
        future.add_done_callback(self._trimmed)

    def _trimmed(self, future: asyncio.Future[float]) -> None:
        self._trimming = False
        if future.cancelled():
            return
        if (error := future.exception()) is not None:
            log.warning("malloc trim failed: %r", error)
            return
        self.service.metrics.malloc_trim_seconds.observe(future.result())

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return int(self.servers[0].sockets[0].getsockname()[1])


def build_server(
    settings: Settings, engine: EngineAPI | None = None, *, max_connections: int | None = None
) -> Server:
    """The server for `settings`; `max_connections` overrides the setting (serve() fits it to the
    descriptor limit)."""
    app = create_app(settings, engine)
    limits = ConnectionLimits(
        max_connections=max_connections or settings.max_connections,
        header_timeout_s=settings.header_read_timeout_s,
        max_header_bytes=settings.max_header_bytes,
    )
    connections = Connections(limits, app.state.service.metrics)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # app/logs.py configured logging
        access_log=False,  # the request middleware logs each request with its id
        server_header=False,
        # Pinned, not auto-detected, so every install runs what the tests ran: libuv's event loop and
        # the llhttp parser in C instead of asyncio's loop and h11 in Python. Server CPU per short
        # request, fake engine, dev machine: 0.60-0.62 -> 0.52-0.53 ms at 1 client, and
        # at 32: 0.61-0.62 -> 0.44-0.53 ms (benchmarks/server_cpu.py).
        loop="uvloop",
        http=protocol_class(connections),  # uvicorn's httptools protocol, with the connection limits
        ws="none",
        # After the drain only idle keep-alive connections remain; do not wait on stragglers.
        timeout_graceful_shutdown=2,
        timeout_keep_alive=5,
    )
    return Server(config, app.state.service, connections)


# Descriptors the server needs besides its client connections: 14 with the tiny model on CPU (the
# event loop, its pipes, stdio, the listening socket); CUDA adds its device files, and remote media
# fetches (allow_remote_urls) their sockets.
FD_RESERVE = 64


def fit_descriptor_limit(max_connections: int) -> int:
    """The connection cap the file-descriptor limit allows: raises the soft RLIMIT_NOFILE toward the
    hard one when max_connections + FD_RESERVE needs it, and lowers the cap (with a warning) when even
    that is too small. Past the descriptor limit accept() fails and libuv drops every new connection
    (/health's too), so the cap must be reached first. The event loop is epoll, so a high limit costs
    nothing (select() would break past 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections
    fitted = max(1, soft - FD_RESERVE)
    log.warning(
        "max_connections lowered to fit the file-descriptor limit",
        extra={"max_connections": max_connections, "fitted": fitted, "nofile": soft},
    )
    return fitted


def serve(settings: Settings, engine: EngineAPI | None = None) -> int:
    """Run until drained or failed; the process exit code. With a worker thread still inside the
    engine after the drain, ends the process here (exit_now) instead of returning."""
    tune_malloc()
    sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)
    server = build_server(settings, engine, max_connections=fit_descriptor_limit(settings.max_connections))
    server.run()
    service = server.service
    code = service.exit_code if server.started else service.exit_code or 1
    if service.busy_threads:
        log.warning(
            "exiting without finalizing: a worker thread is still inside the engine",
            extra={"threads": service.busy_threads, "exit_code": code},
        )
        exit_now(code)
    return code


def exit_now(code: int) -> NoReturn:
    """End the process without finalizing the interpreter: for when a worker thread is still in
    native code (a forward running at the drain deadline, a long decode, a wedged device call).

    Finalizing under such a thread aborts the process. CPython ends a daemon thread that takes the
    GIL once finalization has begun with pthread_exit; its forced unwind runs through torch's C++
    frames, and crossing a noexcept one (the destructor of pybind11's GIL-release guard, run when a
    torch op returns) calls std::terminate: `terminate called without an active exception`, SIGABRT,
    exit -6 instead of a drained exit 0. Waiting longer cannot fix it (a wedged call never
    returns), and a native call cannot be interrupted. Logs and stdio are flushed first; the abandoned
    call's memory goes back with the process, as after SIGKILL.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
