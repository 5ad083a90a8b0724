"""The benchmark's report: figures read from the results, targets judged, markdown tables.

Reads only the results dict (bench.json). Ratios are within one run (same machine, same inputs). The
targets are data (benchmarks/targets.py); here is only how a figure is read and compared. A figure the
run could not produce is "-" and its target "n/a"; nothing here is tuned to a target.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any, TypeGuard

from benchmarks.targets import TARGETS, Target

MiB = 1 << 20


# ------------------------------------------------------------------------------------------ figures


def ok(cell: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """The cell ran: no error, timings present."""
    return cell is not None and not cell.get("error") and "call" in cell


def cells_of(results: dict[str, Any], cfg: str, group: str) -> dict[str, Any]:
    return dict((results["configs"].get(cfg) or {}).get(group) or {})


def named_ms(results: dict[str, Any], cfg: str, key: str) -> float | None:
    """A named workload's figure: the median time of one round (all its calls), in ms."""
    cell = cells_of(results, cfg, "named").get(key)
    return float(cell["call"]["round_p50_ms"]) if ok(cell) else None


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def memory_mib(results: dict[str, Any], cfg: str, point: str) -> float | None:
    """MiB of a configuration's process at `point`, its `peak`, or `named+boot`."""
    memory = (results["configs"].get(cfg) or {}).get("memory") or {}
    points, peaks = memory.get("points_bytes") or {}, memory.get("phase_peaks_bytes") or {}
    if point == "peak":
        value = memory.get("peak_bytes")
    elif point == "named+boot":
        both = [v for v in (points.get("named"), peaks.get("ready")) if v is not None]
        value = max(both) if both else None
    else:
        value = points.get(point)
    return value / MiB if value is not None else None


def sweep_row(results: dict[str, Any], cfg: str, family: str, clients: int) -> dict[str, Any] | None:
    rows = (results["configs"].get(cfg) or {}).get("sweep") or []
    return next(
        (r for r in rows if r["family"] == family and r["concurrency"] == clients and not r["error"]), None
    )


def matrices(results: dict[str, Any], cfg: str) -> list[dict[str, Any]]:
    """Every run's matrix of a configuration: the first, then those of `--pairs`' further runs."""
    first = cells_of(results, cfg, "matrix")
    repeats = (results["configs"].get(cfg) or {}).get("repeats") or []
    return [first, *(dict(r.get("matrix") or {}) for r in repeats)]


def _cell_items_per_s(cell: dict[str, Any] | None, part: str = "call") -> float | None:
    """A matrix cell's items/s (of the whole call, or of `part`), or None where it did not run."""
    value = (cell.get(part) or {}).get("items_per_s") if ok(cell) else None
    return float(value) if value else None


def items_per_s(
    results: dict[str, Any], cfg: str, part: str = "call", runs_of: str | None = None
) -> dict[str, float]:
    """Per matrix cell, the median items/s over the configuration's runs in which the cell ran.
    `runs_of`: only as many runs as that configuration has too (the pairs both sides ran)."""
    taken = matrices(results, cfg)
    if runs_of is not None:
        taken = taken[: len(matrices(results, runs_of))]
    runs: dict[str, list[float]] = {}
    for matrix in taken:
        for key, cell in matrix.items():
            if (value := _cell_items_per_s(cell, part)) is not None:
                runs.setdefault(key, []).append(value)
    return {key: statistics.median(values) for key, values in runs.items()}


def packed_vs_bf16(results: dict[str, Any], part: str = "call") -> dict[str, float]:
    """(a) / (b) items/s per matrix cell: of the whole call (`part` "call"), or of Engine.embed on
    items prepared beforehand ("embed": the part the weights' format can change; a call adds the
    same decoding and preprocessing to both, on the host's CPUs). With `--pairs`, each side's median
    over its runs: one pair of processes moves with the host."""
    a, b = items_per_s(results, "a", part, runs_of="b"), items_per_s(results, "b", part, runs_of="a")
    return {k: a[k] / b[k] for k in a if k in b}


def pair_worst(results: dict[str, Any]) -> list[float | None]:
    """With `--pairs`, each pair's worst packed / BF16 call ratio over the matrix: the i-th run of
    (a) against the i-th of (b); None for a pair with no cell measured by both."""
    worst: list[float | None] = []
    for a, b in zip(matrices(results, "a"), matrices(results, "b"), strict=False):
        ratios = [x / y for k in a if (x := _cell_items_per_s(a[k])) and (y := _cell_items_per_s(b.get(k)))]
        worst.append(min(ratios) if ratios else None)
    return worst


def figure(results: dict[str, Any], spec: str) -> float | None:
    """The figure a target's `figure` names (benchmarks/targets.py lists the forms)."""
    kind, *args = spec.split(":")
    if kind == "memory":
        return memory_mib(results, args[0], args[1])
    if kind == "named":
        return named_ms(results, args[0], args[1])
    if kind == "ratio":
        return ratio(named_ms(results, args[0], args[2]), named_ms(results, args[1], args[2]))
    if kind == "sweep":
        row = sweep_row(results, args[0], args[1], int(args[2]))
        return float(row[args[3]]) if row and row.get(args[3]) is not None else None
    if kind == "packed_vs_bf16":
        ratios = packed_vs_bf16(results, *args[1:])
        return (min if args[0] == "worst" else statistics.median)(ratios.values()) if ratios else None
    if kind == "saturation":
        rows = [
            r
            for r in (results["configs"].get(args[0]) or {}).get("sweep") or []
            if r["family"] == "text_short" and not r["error"]
        ]
        served = max((r["items_per_s"] for r in rows), default=None)
        in_process = max(
            (
                c["call"]["items_per_s"]
                for c in cells_of(results, args[1], "matrix").values()
                if c["family"] == "text_short" and ok(c)
            ),
            default=None,
        )
        return ratio(served, in_process)
    if kind == "peak_share":
        best = max(
            (
                c["forward_tflops"]
                for c in cells_of(results, args[0], "matrix").values()
                if c["family"] == args[1] and c.get("forward_tflops")
            ),
            default=None,
        )
        return ratio(best, results["meta"].get("matmul_peak_tflops"))
    raise ValueError(f"unknown figure {spec!r}")


def judged(results: dict[str, Any]) -> bool:
    """Targets are H200 targets for the full-size checkpoint: judged only on such a run."""
    meta = results["meta"]
    return meta["device"] == "cuda" and meta["size"] == "full" and not meta["quick"]


def judge(value: float | None, target: Target) -> bool | None:
    if value is None:
        return None
    return value <= target.goal if target.op == "<=" else value >= target.goal


def targets(results: dict[str, Any], table: Iterable[Target] = TARGETS) -> list[dict[str, Any]]:
    """Every target with this run's value and, on a judged run, met / not met (None: no figure)."""
    out = []
    for t in table:
        value = figure(results, t.figure)
        out.append(
            {
                "issue": t.issue,
                "name": t.name,
                "figure": t.figure,
                "value": value,
                "goal": f"{t.op} {_goal(t)}",
                "unit": t.unit,
                "met": judge(value, t) if judged(results) else None,
                "judged": judged(results),
            }
        )
    return out


def _goal(t: Target) -> str:
    if t.unit == "x" and t.goal < 1 and abs(1 / t.goal - round(1 / t.goal)) < 1e-9:
        return f"1/{round(1 / t.goal)}x"  # "1/3x": three times faster
    return f"{_num(t.goal)} {t.unit}" if t.unit != "x" else f"{t.goal:.3g}x"


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


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / MiB:,.0f}"


def _table(head: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _status(t: dict[str, Any]) -> str:
    if not t["judged"]:
        return "not judged"
    return {True: "met", False: "**not met**", None: "n/a"}[t["met"]]


def _value(t: dict[str, Any]) -> str:
    if t["value"] is None:
        return "-"
    if t["unit"] == "x":
        return f"{t['value']:.3f}x"
    if t["unit"] == "share":
        return f"{t['value']:.3f}"
    return f"{_num(t['value'])} {t['unit']}"


def provenance(meta: dict[str, Any]) -> str:
    """The line every figure carries: date, commit, machine, command."""
    machine = meta["gpu"] or meta["cpu"]
    return (
        f"{meta['date']} · commit {meta['git'] or 'unknown'} · {machine} ({meta['cpu_count']} CPU cores) · "
        f"torch {meta['torch']} · `{meta['command']}` · {meta['wall_s']:.0f} s"
    )


def markdown(results: dict[str, Any]) -> str:
    meta, cfg = results["meta"], results["configs"]
    parts = [
        f"# eg2 bench: {meta['size']} checkpoint on {meta['gpu'] or meta['cpu']}\n",
        provenance(meta) + "\n",
        "Configurations, each alone in its own process, one after the other: "
        + "; ".join(f"({k}) {c.get('label', '')}" for k, c in cfg.items())
        + ". Every call is timed from the client's bytes and strings to vectors in host memory. "
        "How it is measured: docs/BENCH.md.\n",
    ]
    if not meta.get("complete", True):
        parts.append("> PARTIAL: saved after a configuration; the run had not finished.\n")
    if meta["device"] == "cpu":
        parts.append("> CPU run: no GPU memory figures; the timings check the harness, not the speed.\n")

    parts.append("## Targets\n")
    parts.append(
        _table(
            ["issue", "target", "measured", "goal", "status"],
            [[f"#{t['issue']}", t["name"], _value(t), t["goal"], _status(t)] for t in results["targets"]],
        )
    )
    if not judged(results):
        parts.append("Targets are judged on a full-size run on a GPU only.\n")

    parts.append("## Process GPU memory (MiB, NVML, per process)\n")
    rows = []
    for key, c in cfg.items():
        m = c.get("memory") or {}
        points, peaks = m.get("points_bytes") or {}, m.get("phase_peaks_bytes") or {}
        first = "ready" if c.get("kind") == "server" else "load"
        rows.append(
            [
                f"({key})",
                _mib(points.get(first)),
                _mib(points.get("warmup")),
                _mib(points.get("named")),
                _mib(points.get("matrix", points.get("sweep"))),
                _mib(peaks.get(first)),
                _mib(m.get("peak_bytes")),
                str(m.get("source") or "-"),
            ]
        )
    parts.append(
        _table(
            [
                "config",
                "after load (server: at /ready)",
                "after warm-up",
                "after the named workloads",
                "after the matrix / sweep",
                "load / boot peak",
                "peak, whole run",
                "source",
            ],
            rows,
        )
    )
    parts.append(
        "A server's load includes its warm-up and graph capture: /ready turns 200 after them. Peaks are "
        "NVML samples every 50 ms of the process, from outside it.\n"
    )
    parts.append(_engine_report(cfg))

    parts.append("## Named workloads (ms, median of one round)\n")
    named = results["workloads"]["named"]
    with_named = [k for k, c in cfg.items() if c.get("named")]
    head = ["workload", *(f"({k})" for k in with_named)]
    ratios = [(k, "c") for k in ("a", "d") if k in with_named and "c" in with_named]
    head += [f"{k} / {base}" for k, base in ratios]
    rows = []
    for n in named:
        vals = {k: named_ms(results, k, n["key"]) for k in with_named}
        rows.append(
            [
                n["label"],
                *(_num(vals[k]) for k in with_named),
                *(_x(ratio(vals[k], vals[base])) for k, base in ratios),
            ]
        )
    parts.append(_table(head, rows))
    parts.append(_server_split(results))
    parts.append(_budgets(results))

    if any(cells_of(results, k, "matrix") for k in "abc"):
        parts += _matrix(results)

    served = [k for k, c in cfg.items() if c.get("sweep")]
    if served:
        parts.append("## Over HTTP: one item per request, C concurrent clients\n")
        rows = [[f"({k})", *_sweep_cells(row)] for k in served for row in cfg[k]["sweep"]]
        parts.append(
            _table(
                [
                    "config",
                    "workload",
                    "clients",
                    "requests",
                    "req/s",
                    "p50 ms",
                    "p99 ms",
                    "server queue p50/p99 ms",
                    "server inference p50/p99 ms",
                    "busiest client process CPU",
                    "untimed window first: req/s, p99 ms",
                    "graph captures: untimed / timed window",
                ],
                rows,
            )
        )
        parts.append(
            "Server queue (x-queue-time-ms): the longest wait of the request's items between preprocessed "
            "and on the GPU. Server inference (x-inference-time-ms): the GPU batches that carried them. "
            "The rest of a client's latency is HTTP, JSON, base64, admission and preprocessing. Near 100% "
            "CPU, the client process, not the server, was the limit.\n"
        )

    if results["errors"]:
        parts.append("## Errors\n")
        parts.append("".join(f"- {e}\n" for e in results["errors"]))
    return "\n".join(parts)


def _server_split(results: dict[str, Any]) -> str:
    """Where (d)'s server spent each named workload's calls (its /metrics, diffed around the cell)."""
    cells = cells_of(results, "d", "named")
    rows = []
    for n in results["workloads"]["named"]:
        cell = cells.get(n["key"])
        if not ok(cell):
            continue
        for modality, split in sorted((cell.get("server") or {}).items()):
            per_call = split.get("items", 0) / max(split.get("batches", 0), 1)
            rows.append(
                [
                    n["label"],
                    modality,
                    _num(per_call),
                    _num(split.get("preprocess_ms")),
                    _num(split.get("queue_ms")),
                    _num(split.get("inference_ms")),
                ]
            )
    if not rows:
        return ""
    head = [
        "workload",
        "modality",
        "items per batch",
        "prepare ms per item",
        "queue ms per item",
        "ms per batch",
    ]
    return (
        "### (d): where the server spent the named calls (its /metrics)\n\n"
        + _table(head, rows)
        + "\nPrepare: one item's decode and preprocessing on the worker pool. Queue: prepared to GPU. "
        "A batch: one engine call, the copy back included. The rest of a call's time is HTTP, JSON, "
        "base64 and the wait for the last item's preparing.\n"
    )


def _engine_report(cfg: dict[str, Any]) -> str:
    """The engine's own figures beside NVML's: its memory() at each point, or a server's /metrics."""
    rows = []
    for key, c in cfg.items():
        reports = c.get("engine_memory") or {}
        for point, r in reports.items():
            if r and "gpu_budget_bytes" in r:
                rows.append(
                    [f"({key})", point]
                    + [_mib(r.get(k)) for k in ("process_gpu_bytes", "gpu_budget_bytes")]
                    + [_mib(r.get(k)) for k in ("gpu_allocated_bytes", "gpu_reserved_bytes")]
                )
        for point, g in (c.get("engine_gpu_gauges") or {}).items():
            if g:
                rows.append(
                    [f"({key})", f"{point} (/metrics)"]
                    + [_mib(g.get(k)) for k in ("process", "budget", "allocated", "reserved")]
                )
    if not rows:
        return ""
    return (
        "The engine's own report (MiB): `Engine.memory()`, or a server's `eg2_gpu_memory_bytes{kind}`.\n\n"
        + _table(["config", "point", "process", "budget", "allocated", "reserved"], rows)
    )


def _budgets(results: dict[str, Any]) -> str:
    """What a bigger GPU memory budget buys: the (d) variants side by side."""
    cfg = results["configs"]
    served = [k for k, c in cfg.items() if c.get("kind") == "server" and c.get("checkpoint") == "w4"]
    served = [k for k in served if k == "d" or k.startswith("d-mib")]
    if len(served) < 2:
        return ""
    rows = []
    for k in served:
        image, clip, text = (
            sweep_row(results, k, f, n) for f, n in (("image", 16), ("audio_short", 16), ("text_short", 128))
        )
        rows.append(
            [
                f"({k})",
                _num(cfg[k].get("gpu_memory_mib")) if cfg[k].get("gpu_memory_mib") else "default",
                _num(memory_mib(results, k, "ready")),
                _num(memory_mib(results, k, "named+boot")),
                *(
                    _num(named_ms(results, k, w))
                    for w in ("image_one", "audio_one", "docs_one_call", "long_doc")
                ),
                *(_num(r["items_per_s"]) if r else "-" for r in (image, clip, text)),
            ]
        )
    return "## What a bigger budget buys (`--gpu-memory-mib`)\n\n" + _table(
        [
            "config",
            "budget MiB",
            "MiB at /ready",
            "MiB after named, boot peak incl.",
            "1 image ms",
            "1 clip ms",
            "64 docs ms",
            "2,200-token doc ms",
            "16 clients images req/s",
            "16 clients clips req/s",
            "128 clients texts req/s",
        ],
        rows,
    )


def _matrix(results: dict[str, Any]) -> list[str]:
    parts = ["## Modality x batch: throughput (in-process)\n"]
    a, b, c = (cells_of(results, k, "matrix") for k in "abc")
    workloads = results["workloads"]["matrix"]
    medians = {k: items_per_s(results, k, runs_of=o) for k, o in ("ab", "ba")}  # one run, unless --pairs
    rows = []
    for w in workloads:
        key = w["key"]
        ips = {k: medians[k].get(key) for k in "ab"}
        ips["c"] = c[key]["call"]["items_per_s"] if ok(c.get(key)) else None
        tps = a[key]["call"]["tokens_per_s"] if ok(a.get(key)) else None
        rows.append(
            [
                w["family"],
                str(w["batch"]),
                str(w["tokens"] // w["items"]),
                *(_num(ips[k]) for k in "abc"),
                _x(ratio(ips["a"], ips["b"])),  # packed / BF16, as packed_vs_bf16 gives it
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
    pairs = pair_worst(results)
    if len(pairs) > 1:
        parts.append(
            f"(a) and (b) ran as {len(pairs)} pairs (`--pairs`), alternating which went first: their "
            "items/s and packed / BF16 above are medians over the runs (tokens/s, ours / ref and the "
            "latencies below are the first run's). Each pair's worst cell: "
            + ", ".join(_x(w) for w in pairs)
            + ".\n"
        )
    parts.append("## Modality x batch: latency, embed and forward alone\n")
    rows = []
    for w in workloads:
        key = w["key"]
        lat = []
        for cells in (a, b, c):
            cell = cells.get(key)
            lat += [_num(cell["call"]["p50_ms"]), _num(cell["call"]["p99_ms"])] if ok(cell) else ["-", "-"]
        embed = [_num((cells.get(key) or {}).get("embed", {}).get("p50_ms")) for cells in (a, b)]
        fwd = [_num((cells.get(key) or {}).get("forward", {}).get("p50_ms")) for cells in (a, b)]
        tf = [_num((cells.get(key) or {}).get("forward_tflops")) for cells in (a, b)]
        rows.append([w["family"], str(w["batch"]), *lat, *embed, *fwd, *tf])
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
                "embed (b)",
                "forward (a)",
                "forward (b)",
                "TFLOP/s (a)",
                "TFLOP/s (b)",
            ],
            rows,
        )
    )
    parts.append(
        "Latencies in ms per call. `embed`: Engine.embed on items prepared beforehand; `forward`: the "
        "engine's forward on inputs already on the device (CUDA events). The gap between a call and its "
        "embed is preprocessing; between embed and forward, collation and copies. Matmul peak measured: "
        f"{_num(results['meta'].get('matmul_peak_tflops'))} TFLOP/s.\n"
    )
    refused = {k: _refused(cells) for k, cells in zip("ab", (a, b), strict=True)}
    parts += _per_config(
        "Graph buckets the pool refused by the end of the matrix (their batches ran in smaller "
        "buckets, or eagerly where none held them): ",
        refused,
    )
    # The named workloads run first and capture too: their cells, then the matrix's, in run order.
    captures = {k: _captures(cells_of(results, k, "named") | cells_of(results, k, "matrix")) for k in "ab"}
    parts += _per_config(
        "Graphs captured on first use, by the named call or matrix cell that first asked for them, "
        "with the pool's fill after it: ",
        captures,
    )
    return parts


def _per_config(lead: str, lists: dict[str, list[str]]) -> list[str]:
    """One sentence naming each configuration's entries ('(a) x, y; (b) none'), or none where no
    configuration has any."""
    if not any(lists.values()):
        return []
    return [lead + "; ".join(f"({k}) {', '.join(v) or 'none'}" for k, v in lists.items()) + ".\n"]


def _captures(cells: dict[str, Any]) -> list[str]:
    """Each cell that captured graph buckets: 'cell: buckets (pool used / budget MiB)'."""
    out = []
    for name, c in cells.items():
        graphs = c.get("graphs") if isinstance(c, dict) else None
        if not graphs or not graphs.get("captured"):
            continue
        pool = graphs.get("pool_mib")
        fill = f" (pool {_num(pool['used'])} / {_num(pool['budget'])} MiB)" if pool else ""
        out.append(f"{name}: {' + '.join(graphs['captured'])}{fill}")
    return out


def _refused(cells: dict[str, Any]) -> list[str]:
    """Every graph bucket refused by the last matrix cell that recorded them."""
    seen = [c["graphs"]["refused"] for c in cells.values() if isinstance(c, dict) and "graphs" in c]
    return seen[-1] if seen else []


def _sweep_cells(row: dict[str, Any]) -> list[str]:
    head = [row["family"], str(row["concurrency"])]
    cold = row.get("cold")  # the untimed window of the same load before the timed one
    first = f"{_num(cold['items_per_s'])}, {_num(cold['p99_ms'])}" if cold and not cold.get("error") else "-"

    def captures(r: dict[str, Any] | None) -> str:
        return "-" if not r or r.get("captures") is None else f"{r['captures']} ({r['capture_s']:.2f} s)"

    seen = f"{captures(cold)} / {captures(row)}"
    if row["error"]:
        return [*head, "failed", *("-",) * 6, first, seen]
    failed = sum(row["failures"].values())
    requests = f"{row['requests']} ({failed} failed: {row['failures']})" if failed else str(row["requests"])
    return [
        *head,
        requests,
        _num(row["items_per_s"]),
        _num(row["p50_ms"]),
        _num(row["p99_ms"]),
        f"{_num(row['server_queue_p50_ms'])} / {_num(row['server_queue_p99_ms'])}",
        f"{_num(row['server_inference_p50_ms'])} / {_num(row['server_inference_p99_ms'])}",
        f"{row['client_cpu_s'] / row['wall_s']:.0%}",
        first,
        seen,
    ]
