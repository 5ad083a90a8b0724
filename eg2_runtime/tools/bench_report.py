"""The benchmark's report: targets judged, markdown tables. Reads only the results dict (bench.json).

Ratios are within one run (same machine, same inputs): packed / BF16 for (a) vs (b), ours / reference
for (a) vs (c), the service (d) against both. Each target of issue 6 gets a measured value and met /
not met, and nothing here is tuned to reach them; a figure the run could not produce is "n/a".
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any, TypeGuard

CONFIG_LABELS = {
    "a": "(a) ours, hybrid-w4 packed",
    "b": "(b) ours, BF16",
    "c": "(c) transformers + sentence-transformers, BF16",
    "d": "(d) HTTP service (a) over loopback",
    "e": "(e) ours, hybrid-w4 packed, token table in host memory",
}
SHORT_LABELS = {
    "a": "(a) packed",
    "b": "(b) BF16",
    "c": "(c) reference",
    "d": "(d) service",
    "e": "(e) host table",
}
METRIC_UNITS = {
    "latency_ms": "ms",
    "items_per_s": "items/s",
    "tokens_per_s": "tokens/s",
    "ms_per_item": "ms/item",
}
_METRIC_FIELDS = {
    "latency_ms": "p50_ms",
    "items_per_s": "items_per_s",
    "tokens_per_s": "tokens_per_s",
    "ms_per_item": "ms_per_item",
}
MiB = 1 << 20


def named_value(cell: dict[str, Any] | None, metric: str) -> float | None:
    """A named workload's figure: latencies and per-item times are medians, rates are over the run."""
    if not cell or cell.get("error") or "call" not in cell:
        return None
    value = cell["call"].get(_METRIC_FIELDS[metric])
    return float(value) if value is not None else None


def cells_of(results: dict[str, Any], cfg: str, group: str) -> dict[str, Any]:
    return dict(results["configs"].get(cfg, {}).get(group) or {})


def ok(cell: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """The cell ran: no error, timings present."""
    return cell is not None and not cell.get("error") and "call" in cell


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _target(name: str, value: float | None, goal: str, met: bool | None, detail: str = "") -> dict[str, Any]:
    return {"name": name, "value": value, "goal": goal, "met": met, "detail": detail}


def _judge(value: float | None, op: str, bound: float) -> bool | None:
    if value is None:
        return None
    return value <= bound if op == "<=" else value >= bound


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of issue 6 with this run's value."""
    cfg = results["configs"]
    out = []

    a_w, b_w = cfg.get("a", {}).get("weights") or {}, cfg.get("b", {}).get("weights") or {}
    source = (
        "allocated_bytes" if a_w.get("allocated_bytes") and b_w.get("allocated_bytes") else "resident_bytes"
    )
    r = ratio(a_w.get(source), b_w.get(source))
    out.append(
        _target(
            "weights resident: packed / BF16 (same runtime)",
            r,
            "<= 0.56x",
            _judge(r, "<=", 0.56),
            f"{_mib(a_w.get(source))} / {_mib(b_w.get(source))} MiB ({source})",
        )
    )
    e_w = cfg.get("e", {}).get("weights") or {}
    r = ratio(e_w.get(source), b_w.get(source))
    out.append(
        _target(
            "weights resident with the token table in host memory / BF16",
            r,
            "<= 0.40x",
            _judge(r, "<=", 0.40),
            f"{_mib(e_w.get(source))} / {_mib(b_w.get(source))} MiB ({source}); "
            f"{_mib(e_w.get('host_bytes'))} MiB in host memory",
        )
    )
    a_m, c_m = cfg.get("a", {}).get("memory") or {}, cfg.get("c", {}).get("memory") or {}
    r = ratio(a_m.get("reserved_after_bytes"), c_m.get("reserved_after_bytes"))
    out.append(
        _target(
            "GPU memory after the workloads: ours / reference",
            r,
            "<= 0.5x",
            _judge(r, "<=", 0.5),
            f"allocator reserved {_mib(a_m.get('reserved_after_bytes'))} / "
            f"{_mib(c_m.get('reserved_after_bytes'))} MiB",
        )
    )

    ratios = packed_vs_bf16(results)
    worst = min(ratios.values()) if ratios else None
    med = statistics.median(ratios.values()) if ratios else None
    worst_key = min(ratios, key=ratios.__getitem__) if ratios else ""
    out.append(
        _target(
            "packed / BF16 items/s, worst cell",
            worst,
            ">= 0.97x",
            _judge(worst, ">=", 0.97),
            f"{worst_key}, {len(ratios)} cells",
        )
    )
    out.append(_target("packed / BF16 items/s, median cell", med, ">= 1.0x", _judge(med, ">=", 1.0)))

    for n in results["workloads"]["named"]:
        if n["target"] is None:
            continue
        ours = named_value(cells_of(results, "a", "named").get(n["key"]), n["metric"])
        ref = named_value(cells_of(results, "c", "named").get(n["key"]), n["metric"])
        r = ratio(ours, ref)
        op = "<=" if n["better"] == "lower" else ">="
        out.append(
            _target(
                f"{n['label']}: ours / reference",
                r,
                f"{op} {n['target']:.3g}x",
                _judge(r, op, n["target"]),
                f"{_num(ours)} vs {_num(ref)} {METRIC_UNITS[n['metric']]}",
            )
        )

    d_named, c_named = cells_of(results, "d", "named"), cells_of(results, "c", "named")
    service = named_value(d_named.get("short_query"), "latency_ms")
    ref = named_value(c_named.get("short_query"), "latency_ms")
    r = ratio(service, ref)
    out.append(
        _target(
            "service short query latency / reference in-process",
            r,
            "<= 0.167x",
            _judge(r, "<=", 1 / 6),
            f"{_num(service)} vs {_num(ref)} ms",
        )
    )
    sweep = [
        row
        for row in cfg.get("d", {}).get("sweep") or []
        if row["family"] == "text_short" and not row["error"]
    ]
    saturated = max((row["items_per_s"] for row in sweep), default=None)
    in_process = max(
        (
            c["call"]["items_per_s"]
            for c in cells_of(results, "a", "matrix").values()
            if c["family"] == "text_short" and ok(c)
        ),
        default=None,
    )
    r = ratio(saturated, in_process)
    out.append(
        _target(
            "service items/s at saturation / in-process, short text",
            r,
            ">= 0.85x",
            _judge(r, ">=", 0.85),
            f"{_num(saturated)} vs {_num(in_process)} items/s (best batch)",
        )
    )
    row32 = next((row for row in sweep if row["concurrency"] == 32), sweep[-1] if sweep else None)
    out.append(
        _target(
            f"service p99 at concurrency {row32['concurrency'] if row32 else 32}, short text (ms)",
            row32["p99_ms"] if row32 else None,
            "reported",
            None,
            _tail(row32) if row32 else "",
        )
    )

    peak = results["meta"].get("matmul_peak_tflops")
    for family, label in (("text_long", "long text"), ("image", "images")):
        best = max(
            (
                c["forward_tflops"]
                for c in cells_of(results, "a", "matrix").values()
                if c["family"] == family and c.get("forward_tflops")
            ),
            default=None,
        )
        r = ratio(best, peak)
        out.append(
            _target(
                f"{label}: forward TFLOP/s / measured matmul peak",
                r,
                ">= 0.35x",
                _judge(r, ">=", 0.35),
                f"{_num(best)} of {_num(peak)} TFLOP/s (best batch, (a))",
            )
        )
    return out


def packed_vs_bf16(results: dict[str, Any]) -> dict[str, float]:
    a, b = cells_of(results, "a", "matrix"), cells_of(results, "b", "matrix")
    return {
        k: a[k]["call"]["items_per_s"] / b[k]["call"]["items_per_s"] for k in a if ok(a[k]) and ok(b.get(k))
    }


def _tail(row: dict[str, Any]) -> str:
    return (
        f"client p50 {_num(row['p50_ms'])} ms; server queue p50/p99 {_num(row.get('server_queue_p50_ms'))}/"
        f"{_num(row.get('server_queue_p99_ms'))} ms, inference p50/p99 {_num(row.get('server_inference_p50_ms'))}/"
        f"{_num(row.get('server_inference_p99_ms'))} ms"
    )


# -------------------------------------------------------------------------------------------- markdown


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}x"


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MiB:,.1f}"


def _table(head: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _requests(row: dict[str, Any]) -> str:
    failed = sum(row["failures"].values())
    return f"{row['requests']} ({failed} failed: {row['failures']})" if failed else str(row["requests"])


def _met(m: bool | None) -> str:
    return {True: "met", False: "**not met**", None: "n/a"}[m]


def markdown(results: dict[str, Any]) -> str:
    meta, cfg = results["meta"], results["configs"]
    parts = [
        f"# eg2 bench: {meta['size']} checkpoint on {meta['gpu'] or meta['cpu']}\n",
        f"{meta['date']} · torch {meta['torch']} · {meta['device']} · {'quick mode' if meta['quick'] else 'full mode'}"
        f" · {meta['wall_s']:.0f} s · `{meta['command']}`\n",
        "Configurations: " + "; ".join(f"{CONFIG_LABELS[k]}" for k in meta["configs"]) + ". "
        "Every call is timed from the client's bytes and strings to vectors in host memory. See docs/BENCH.md.\n",
    ]
    if not meta.get("complete", True):
        parts.append("> PARTIAL: saved after a configuration; the run had not finished.\n")
    if meta["device"] == "cpu":
        parts.append(
            "> CPU run: no GPU memory figures; the timings check the harness, not the runtime's speed.\n"
        )

    parts.append("## Targets (issue 6)\n")
    parts.append(
        _table(
            ["target", "measured", "goal", "status", "detail"],
            [
                [
                    t["name"],
                    _x(t["value"]) if "x" in t["goal"] else _num(t["value"]),
                    t["goal"],
                    _met(t["met"]),
                    t["detail"],
                ]
                for t in results["targets"]
            ],
        )
    )

    parts.append("## Named workloads\n")
    # The figures are for the full-size workloads: beside smaller quick-mode ones they mislead.
    same_workloads = meta["size"] == "full" and not meta["quick"]
    rows = []
    for n in results["workloads"]["named"]:
        vals = {k: named_value(cells_of(results, k, "named").get(n["key"]), n["metric"]) for k in "abcde"}
        r = ratio(vals["a"], vals["c"])
        goal = (
            "-" if n["target"] is None else f"{'<=' if n['better'] == 'lower' else '>='} {n['target']:.3g}x"
        )
        met = (
            None if n["target"] is None else _judge(r, "<=" if n["better"] == "lower" else ">=", n["target"])
        )
        rows.append(
            [
                n["label"],
                METRIC_UNITS[n["metric"]],
                *(_num(vals[k]) for k in "abcde"),
                _x(r),
                goal,
                _met(met),
                _num(n["issue_reference"]) if same_workloads else "-",
            ]
        )
    parts.append(
        _table(
            [
                "workload",
                "unit",
                "(a) packed",
                "(b) BF16",
                "(c) reference",
                "(d) service",
                "(e) host table",
                "a / c",
                "target",
                "status",
                "reference, issue 6 (H200)",
            ],
            rows,
        )
    )

    parts.append("## Memory\n")
    rows = []
    for k in ("a", "e", "b", "c"):
        c = cfg.get(k)
        if not c:
            continue
        w, m = c.get("weights") or {}, c.get("memory") or {}
        rows.append(
            [
                CONFIG_LABELS[k],
                str(w.get("dtype", "-")),
                _num(c.get("load_s")),
                _mib(w.get("allocated_bytes")),
                _mib(w.get("resident_bytes")),
                _mib(m.get("peak_allocated_bytes")),
                _mib(m.get("reserved_after_bytes")),
                _mib(m.get("device_used_after_bytes")),
            ]
        )
    parts.append(
        _table(
            [
                "configuration",
                "dtype",
                "load s",
                "weights allocated MiB",
                "weights by tensor sizes MiB",
                "peak allocated MiB",
                "reserved after MiB",
                "device used after MiB",
            ],
            rows,
        )
    )
    parts.append(
        "Weights allocated: memory_allocated after load minus before. Peak: max_memory_allocated over "
        "load and workloads. Reserved: the caching allocator after the workloads. Device used: "
        "mem_get_info after the workloads, CUDA context included (shared by every configuration of "
        "the run, so it grows with what the allocator keeps, not with the configuration alone).\n"
    )

    parts.append("## Modality x batch: throughput\n")
    a, b, c = (cells_of(results, k, "matrix") for k in "abc")
    keys = [w["key"] for w in results["workloads"]["matrix"]]
    ratios = packed_vs_bf16(results)
    rows = []
    for key in keys:
        w = next(x for x in results["workloads"]["matrix"] if x["key"] == key)
        ips = {
            k: (cells[key]["call"]["items_per_s"] if ok(cells.get(key)) else None)
            for k, cells in zip("abc", (a, b, c), strict=True)
        }
        tps = a[key]["call"]["tokens_per_s"] if ok(a.get(key)) else None
        rows.append(
            [
                w["family"],
                str(w["batch"]),
                str(w["tokens"] // w["items"]),
                *(_num(ips[k]) for k in "abc"),
                _x(ratios.get(key)),
                _x(ratio(ips["a"], ips["c"])),
                _num(tps),
            ]
        )
    parts.append(
        _table(
            [
                "workload",
                "batch",
                "tokens/item",
                "items/s (a)",
                "items/s (b)",
                "items/s (c)",
                "packed / BF16",
                "ours / ref",
                "tokens/s (a)",
            ],
            rows,
        )
    )

    parts.append("## Modality x batch: latency, forward alone, peak memory\n")
    rows = []
    for key in keys:
        w = next(x for x in results["workloads"]["matrix"] if x["key"] == key)
        lat = []
        for cells in (a, b, c):
            cell = cells.get(key)
            lat += [_num(cell["call"]["p50_ms"]), _num(cell["call"]["p99_ms"])] if ok(cell) else ["-", "-"]
        fwd = [_num((cells.get(key) or {}).get("forward", {}).get("p50_ms")) for cells in (a, b)]
        tf = [_num((cells.get(key) or {}).get("forward_tflops")) for cells in (a, b)]
        peak = [_mib((cells.get(key) or {}).get("peak_allocated_bytes")) for cells in (a, b, c)]
        rows.append(
            [
                w["family"],
                str(w["batch"]),
                *lat,
                _num((a.get(key) or {}).get("embed", {}).get("p50_ms")),
                *fwd,
                *tf,
                *peak,
            ]
        )
    parts.append(
        _table(
            [
                "workload",
                "batch",
                "p50 (a)",
                "p99 (a)",
                "p50 (b)",
                "p99 (b)",
                "p50 (c)",
                "p99 (c)",
                "embed (a)",
                "forward (a)",
                "forward (b)",
                "TFLOP/s (a)",
                "TFLOP/s (b)",
                "peak MiB (a)",
                "peak MiB (b)",
                "peak MiB (c)",
            ],
            rows,
        )
    )
    parts.append(
        "Latencies in ms per call. `embed`: Engine.embed on items prepared beforehand; `forward`: the "
        f"model alone on device-resident inputs (CUDA events). Matmul peak measured: "
        f"{_num(meta.get('matmul_peak_tflops'))} TFLOP/s.\n"
    )

    d = cfg.get("d") or {}
    if d.get("sweep"):
        parts.append("## Service (d): one item per request, C concurrent clients\n")
        parts.append(
            _table(
                [
                    "workload",
                    "C",
                    "requests",
                    "p50 ms",
                    "p99 ms",
                    "items/s",
                    "server queue p50/p99 ms",
                    "server inference p50/p99 ms",
                    "client CPU share",
                ],
                [
                    [
                        row["family"],
                        str(row["concurrency"]),
                        _requests(row),
                        *(
                            (
                                _num(row["p50_ms"]),
                                _num(row["p99_ms"]),
                                _num(row["items_per_s"]),
                                f"{_num(row['server_queue_p50_ms'])} / {_num(row['server_queue_p99_ms'])}",
                                f"{_num(row['server_inference_p50_ms'])} / {_num(row['server_inference_p99_ms'])}",
                                f"{row['client_cpu_s'] / row['wall_s']:.0%}",
                            )
                            if not row["error"]
                            else ("failed",) + ("-",) * 5
                        ),
                    ]
                    for row in d["sweep"]
                ],
            )
        )
        parts.append(
            "Server queue (x-queue-time-ms): the longest wait of the request's items between preprocessed "
            "and on the GPU. Server inference (x-inference-time-ms): the summed time of the GPU batches "
            "that carried them. The rest of a client latency is HTTP, JSON, base64, admission and "
            "preprocessing. The load generator runs in client processes of its own; its CPU share is the "
            "busiest client process's CPU time over the wall time: near 100%, the client is the limit.\n"
        )

    if results["errors"]:
        parts.append("## Errors\n")
        parts.append("".join(f"- {e}\n" for e in results["errors"]))
    return "\n".join(parts)
