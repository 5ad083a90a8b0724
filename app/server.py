"""Running the app under uvicorn, with a graceful drain on SIGTERM / SIGINT.

uvicorn alone stops listening at the first signal and waits for connections, so /ready never
reports the drain and new requests are refused at TCP level. Here the first signal only starts the
service's drain (/ready 503, new requests 503, in-flight ones finish within the drain deadline); the
server stops when the service says so. A second signal stops at once.
"""

from __future__ import annotations

import ctypes
import logging
import os
from types import FrameType

import uvicorn

from app.main import create_app
from app.service import Service
from app.settings import Settings
from eg2_runtime.api import EngineAPI

log = logging.getLogger("eg2.server")


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service
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
        return await super().on_tick(counter) or self.service.should_exit

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return int(self.servers[0].sockets[0].getsockname()[1])


def build_server(settings: Settings, engine: EngineAPI | None = None) -> Server:
    app = create_app(settings, engine)
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
        # at 32: 0.61-0.62 -> 0.44-0.53 ms (docs/results/2026-11-30-cpu/server_cpu_per_request.txt).
        loop="uvloop",
        http="httptools",
        # After the drain only idle keep-alive connections remain; do not wait on stragglers.
        timeout_graceful_shutdown=2,
        timeout_keep_alive=5,
    )
    return Server(config, app.state.service)


M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 16 << 20
# glibc malloc arenas. By default a thread that finds the arenas busy gets a new one (up to 8 per
# core), and each keeps its freed memory: the service's threads (event loop, preprocessing, GPU,
# torch's) made the RSS jump by 60-100 MB at random points of tests/test_reliability_load.py's
# measured phase (+4.5% to +8.7% in a fresh venv; within +-0.4% in 5 runs with 2 arenas). The
# cost is threads sharing 2 arenas' locks, in a process whose heavy work holds the GIL or runs in
# torch's own allocator. MALLOC_ARENA_MAX in the environment still wins.
MALLOC_ARENAS = 2


def tune_malloc(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Keep glibc from raising its mmap threshold as large tensors are freed, and bound its arenas
    (MALLOC_ARENAS); False where not glibc.

    glibc starts at 128 KiB and, each time an mmapped block is freed, raises the threshold to that
    block's size (up to 32 MiB). After warm-up's full batches, activations of every later size come
    from the heap, whose freed space fragments and is rarely returned: under varied batch shapes the
    RSS crept up 4-15% over a few thousand requests (tests/test_reliability_load.py). Fixed at 16 MiB,
    big blocks keep their own mappings and go back to the OS when freed; small ones stay on the heap.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        if "MALLOC_ARENA_MAX" not in os.environ:
            libc.mallopt(M_ARENA_MAX, MALLOC_ARENAS)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):
        return False


def serve(settings: Settings, engine: EngineAPI | None = None) -> int:
    """Run until drained or failed; the process exit code."""
    tune_malloc()
    server = build_server(settings, engine)
    server.run()
    if not server.started:
        return server.service.exit_code or 1
    return server.service.exit_code
