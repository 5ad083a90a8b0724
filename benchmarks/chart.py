"""The benchmark's PNG chart: six panels drawn from the results dict alone.

matplotlib's object API with the Agg canvas (no pyplot, no display, no global backend state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import MiB, cells_of, named_ms, ok, packed_vs_bf16, ratio


def chart(results: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(18, 10), layout="constrained")
    axes = fig.subplots(2, 3)
    meta, cfg = results["meta"], results["configs"]
    fig.suptitle(
        f"eg2 bench, {meta['size']} checkpoint, {meta['gpu'] or meta['cpu']}, "
        f"{meta['date'][:10]}, commit {(meta['git'] or 'unknown')[:12]}"
    )
    width = 0.8

    ax = axes[0][0]  # named workloads: times faster than the reference
    named = results["workloads"]["named"]
    others = [k for k, c in cfg.items() if c.get("named") and k != "c"]
    for j, k in enumerate(others):
        speed = []
        for n in named:
            r = ratio(named_ms(results, k, n["key"]), named_ms(results, "c", n["key"]))
            speed.append(1 / r if r else 0.0)
        step = width / max(1, len(others))
        ax.barh(
            [i - width / 2 + (j + 0.5) * step for i in range(len(named))], speed, height=step, label=f"({k})"
        )
    ax.axvline(1.0, color="black", lw=0.8)
    ax.axvline(3.0, color="red", lw=1, ls="--", label="3x (issue #12, media over HTTP)")
    ax.set_yticks(range(len(named)), [n["key"] for n in named])
    _log_scale(ax, "x")
    ax.set_xlabel("times faster than (c), the reference in-process")
    ax.set_title("named workloads")
    ax.legend(fontsize=7)

    ax = axes[0][1]  # matrix throughput at the largest batch
    matrix = results["workloads"]["matrix"]
    biggest = max((w["batch"] for w in matrix), default=1)
    keys = [w["key"] for w in matrix if w["batch"] == biggest]
    for j, k in enumerate("abc"):
        cells = cells_of(results, k, "matrix")
        vals = [cells[key]["call"]["items_per_s"] if ok(cells.get(key)) else 0.0 for key in keys]
        ax.bar([i + (j - 1) * 0.27 for i in range(len(keys))], vals, width=0.27, label=f"({k})")
    ax.set_xticks(range(len(keys)), [key.split("/")[0] for key in keys], rotation=30, fontsize=8)
    _log_scale(ax, "y")
    ax.set_ylabel("items/s")
    ax.set_title(f"in-process throughput at batch {biggest}")
    ax.legend(fontsize=7)

    ax = axes[0][2]  # packed / BF16 per cell
    ratios = packed_vs_bf16(results)
    ax.bar(range(len(ratios)), list(ratios.values()))
    ax.axhline(0.97, color="red", lw=1, ls="--", label="0.97 (issue #12, every cell)")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(ratios)), list(ratios), rotation=90, fontsize=6)
    ax.set_ylabel("packed / BF16 items/s")
    ax.set_title("(a) / (b) per matrix cell")
    ax.legend(fontsize=7)

    ax = axes[1][0]  # process GPU memory
    keys = [k for k, c in cfg.items() if (c.get("memory") or {}).get("peak_bytes") is not None]
    figures = (("after load / at /ready", ("load", "ready")), ("after the named workloads", ("named",)))
    for j, (label, names) in enumerate(figures):
        vals = []
        for k in keys:
            points = cfg[k]["memory"]["points_bytes"]
            vals.append(next((points[n] for n in names if points.get(n) is not None), 0) / MiB)
        ax.bar([i + (j - 1) * 0.27 for i in range(len(keys))], vals, width=0.27, label=label)
    ax.bar(
        [i + 0.27 for i in range(len(keys))],
        [cfg[k]["memory"]["peak_bytes"] / MiB for k in keys],
        width=0.27,
        label="peak",
    )
    ax.set_xticks(range(len(keys)), [f"({k})" for k in keys])
    ax.set_ylabel("MiB (NVML, the process's own)")
    ax.set_title("process GPU memory (none on a CPU)")
    ax.legend(fontsize=7)

    served = [k for k, c in cfg.items() if c.get("sweep")]
    labels = sorted(
        {f"{r['family']} x{r['concurrency']}" for k in served for r in cfg[k]["sweep"]},
        key=lambda s: (s.split()[0], int(s.split("x")[-1])),
    )
    for ax, field, title in (
        (axes[1][1], "items_per_s", "over HTTP: requests/s"),
        (axes[1][2], "p99_ms", "over HTTP: p99 latency, ms"),
    ):
        step = width / max(1, len(served))
        for j, k in enumerate(served):
            rows = {f"{r['family']} x{r['concurrency']}": r for r in cfg[k]["sweep"] if not r["error"]}
            vals = [rows[s][field] if s in rows else 0.0 for s in labels]
            ax.bar(
                [i - width / 2 + (j + 0.5) * step for i in range(len(labels))],
                vals,
                width=step,
                label=f"({k})",
            )
        ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=8)
        _log_scale(ax, "y")
        ax.set_title(title + " (one item per request, C clients)")
        if served:
            ax.legend(fontsize=7)
    fig.savefig(path, dpi=90)


def _log_scale(ax: Any, axis: str) -> None:
    """A log axis where the panel has something positive to draw (a partial run may not)."""
    values = [p.get_width() if axis == "x" else p.get_height() for p in ax.patches]
    if any(v > 0 for v in values):
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
