"""Prometheus instruments of one app, in a registry of its own (so several apps can live in one process).

Names follow Prometheus conventions: `_total` counters, `_seconds` and `_bytes` units. Labels stay
low-cardinality: route templates, status codes, modalities, reasons. The process itself (resident
memory, open file descriptors and their limit, CPU seconds) comes from prometheus_client's process
collector, read from /proc at scrape time (Linux; elsewhere those families are absent).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from eg2_runtime.api import EngineGraphs

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, _open_fds, _cpu_seconds_total
        self.requests = Counter(
            "eg2_requests",
            "HTTP requests answered, by route template (`unmatched`: no route serves the path) and status",
            ["route", "status"],
            registry=r,
        )
        self.open_connections = Gauge(
            "eg2_open_connections", "Client connections open now (what max_connections counts)", registry=r
        )
        self.connections_closed = Counter(
            "eg2_connections_closed",
            "Connections the server closed before a request reached the app, by reason: header_timeout "
            "(408, or nothing sent), header_too_large (431), evicted (waiting for a request when a new "
            "connection needed its place), over_limit (503 at once: max_connections open, none waiting)",
            ["reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "eg2_queue_depth", "Prepared items waiting for the GPU, by modality", ["modality"], registry=r
        )
        self.admitted_items = Gauge(
            "eg2_admitted_items",
            "Items admitted and not yet answered (what the admission limit counts)",
            registry=r,
        )
        self.batch_size = Histogram(
            "eg2_batch_size", "Items per GPU batch", ["modality"], buckets=_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "eg2_batch_tokens", "Token cost per GPU batch", ["modality"], buckets=_TOKEN_BUCKETS, registry=r
        )
        self.queue_seconds = Histogram(
            "eg2_queue_seconds",
            "Time an item waits between preprocessing and the start of its GPU batch",
            ["modality"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.preprocess_seconds = Histogram(
            "eg2_preprocess_seconds",
            "Time to prepare one item (decode, tokenize) on the worker pool",
            ["modality"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inference_seconds = Histogram(
            "eg2_inference_seconds",
            "Time of one GPU batch",
            ["modality"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "eg2_tokens",
            "Tokens embedded (soft tokens and markers included), by modality",
            ["modality"],
            registry=r,
        )
        self.dropped_items = Counter(
            "eg2_dropped_items",
            "Items dropped before the GPU because their request had ended (client gone, timeout, another "
            "item failed), by where they were: preprocessing (queued for a thread or being decoded, which "
            "stops) or gpu_queue (prepared, waiting for a batch)",
            ["stage"],
            registry=r,
        )
        self.batch_splits = Counter(
            "eg2_batch_splits",
            "GPU batches split in halves after a failure, by reason",
            ["reason"],
            registry=r,
        )
        self.weight_bytes = Gauge(
            "eg2_weight_bytes",
            "Model weight bytes: resident (packed) and their BF16-equivalent size",
            ["kind"],
            registry=r,
        )
        self.gpu_memory_bytes = Gauge(
            "eg2_gpu_memory_bytes",
            "GPU memory (absent on CPU): process = this process's own, as nvidia-smi shows it (context, "
            "libraries, weights, graphs, activations: what a co-located model cannot use); budget = the "
            "most the engine plans for; allocated / reserved = torch's allocator counters",
            ["kind"],
            registry=r,
        )
        # The engine's CUDA graph buckets, one snapshot a scrape (GraphCollector); none while loading.
        self.graphs = GraphCollector()
        r.register(self.graphs)
        self.malloc_trim_seconds = Histogram(
            "eg2_malloc_trim_seconds",
            "Time of each trim that gave the idle server's free heap back to the OS (malloc_trim_idle_s)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=r,
        )
        self.ready = Gauge("eg2_ready", "1 once weights are loaded and warm-up ran, 0 otherwise", registry=r)
        self.gpu_busy_seconds = Gauge(
            "eg2_gpu_busy_seconds", "How long the current GPU call has been running (0 when idle)", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class GraphCollector(Collector):
    """The engine's CUDA graph buckets (EngineAPI.graph_stats), read once per scrape so that the
    families agree with each other. `source` is set once an engine is loaded; until then, and on an
    engine with no graphs, the families have no samples but the zero counts."""

    def __init__(self) -> None:
        self.source: Callable[[], EngineGraphs] | None = None

    def describe(self) -> Iterator[Metric]:
        # None: the families appear once an engine is loaded, so registering checks no names here.
        return iter(())

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        g = self.source()
        buckets = GaugeMetricFamily(
            "eg2_cuda_graph_buckets",
            "CUDA graph buckets, text and towers (zero on CPU): captured = held in the graph pool, each "
            "captured at start-up or on its first use; refused = the GPU memory budget did not hold it, "
            "so its batches take smaller buckets or run eagerly; deferred = left to its first use",
            labels=["state"],
        )
        for state in ("captured", "refused", "deferred"):
            buckets.add_metric([state], g[state])
        yield buckets
        yield CounterMetricFamily(
            "eg2_cuda_graph_capture_seconds",
            "Seconds spent capturing CUDA graphs (refused trials included) since start; a rise while "
            "serving is a batch that waited for a bucket's first capture",
            value=g["capture_seconds"],
        )
        pool = GaugeMetricFamily(
            "eg2_cuda_graph_pool_bytes",
            "The CUDA graph pool: used = what its captures hold; budget = its share of gpu_memory_mib "
            "(absent where unbounded)",
            labels=["kind"],
        )
        pool.add_metric(["used"], g["pool_used_bytes"])
        if g["pool_budget_bytes"]:
            pool.add_metric(["budget"], g["pool_budget_bytes"])
        yield pool
