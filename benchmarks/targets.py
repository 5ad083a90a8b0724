"""The targets `eg2 bench` judges, as data: each with the issue it comes from. Change them here only.

A target reads one figure of the results (benchmarks/report.py `figure` says what each form means):
    memory:CONFIG:POINT            MiB of the configuration's process: at a point (load, warmup, ready,
                                   named, matrix, sweep), `peak`, or `named+boot` (the larger of the
                                   reading after the named workloads and the boot peak)
    named:CONFIG:WORKLOAD          ms of one round of a named workload (median)
    ratio:CONFIG:BASE:WORKLOAD     that time in CONFIG / in BASE
    sweep:CONFIG:FAMILY:CLIENTS:FIELD   a sweep row's figure (items_per_s = requests/s, p99_ms, ...)
    packed_vs_bf16:worst[:PART]    the least (a) / (b) items/s over the matrix cells, of the whole
                                   call or (PART "embed") of Engine.embed on prepared items; with
                                   `--pairs`, of each side's median over its runs
    saturation:CONFIG:INPROCESS    the sweep's best single-short-text requests/s in CONFIG over the
                                   best text_short items/s of INPROCESS's matrix
    peak_share:CONFIG:FAMILY       the best forward TFLOP/s of the family's matrix cells over the
                                   measured BF16 matmul peak
Targets are judged only on a full-size GPU run (on anything else their status is "not judged").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Target:
    issue: int
    name: str
    figure: str
    op: Literal["<=", ">="]
    goal: float
    unit: str  # "MiB", "ms", "x", "req/s", "share"


TARGETS: tuple[Target, ...] = (
    # Issue #12: memory as users see it, packed at BF16 speed, media 3x faster over HTTP.
    Target(12, "(d) process GPU memory after load (at /ready)", "memory:d:ready", "<=", 1600, "MiB"),
    Target(12, "(d) after the named workloads, boot peak included", "memory:d:named+boot", "<=", 2000, "MiB"),
    Target(
        12, "(d-text) --modalities text, boot peak included", "memory:d-text:named+boot", "<=", 1000, "MiB"
    ),
    Target(12, "packed / BF16 items/s, every matrix cell", "packed_vs_bf16:worst", ">=", 0.97, "x"),
    Target(12, "the same, Engine.embed on prepared items", "packed_vs_bf16:worst:embed", ">=", 0.97, "x"),
    Target(12, "1 image over HTTP / reference in-process", "ratio:d:c:image_one", "<=", 1 / 3, "x"),
    Target(12, "1 image over HTTP", "named:d:image_one", "<=", 25, "ms"),
    Target(12, "1 clip over HTTP / reference in-process", "ratio:d:c:audio_one", "<=", 1 / 3, "x"),
    Target(12, "1 clip over HTTP", "named:d:audio_one", "<=", 30, "ms"),
    Target(12, "8-frame video over HTTP / reference in-process", "ratio:d:c:video_one", "<=", 1 / 3, "x"),
    Target(12, "16 images, one call, over HTTP / reference", "ratio:d:c:images_one_call", "<=", 1 / 3, "x"),
    Target(12, "16 clips, one call, over HTTP / reference", "ratio:d:c:audio_one_call", "<=", 1 / 3, "x"),
    Target(12, "16 clients, single images", "sweep:d:image:16:items_per_s", ">=", 150, "req/s"),
    Target(12, "16 clients, single clips", "sweep:d:audio_short:16:items_per_s", ">=", 250, "req/s"),
    # Issue #15: text at line rate (over HTTP unless said).
    Target(15, "64 docs, one call", "named:d:docs_one_call", "<=", 6, "ms"),
    Target(15, "64 docs, one call, over HTTP / reference", "ratio:d:c:docs_one_call", "<=", 1 / 8, "x"),
    Target(15, "256 docs in 4 calls", "named:d:docs_many_calls", "<=", 25, "ms"),
    Target(15, "1 doc of 2,200 tokens", "named:d:long_doc", "<=", 10, "ms"),
    Target(15, "1 short query", "named:d:short_query", "<=", 3, "ms"),
    Target(15, "128 clients, single texts", "sweep:d:text_short:128:items_per_s", ">=", 4000, "req/s"),
    Target(15, "32 clients, single texts, p99", "sweep:d:text_short:32:p99_ms", "<=", 15, "ms"),
    Target(15, "service at saturation / in-process, short text", "saturation:d:a", ">=", 0.85, "x"),
    Target(15, "long-text forward / measured matmul peak", "peak_share:a:text_long", ">=", 0.35, "share"),
)
