"""The benchmark's PNG chart, for the README: six panels drawn from the results dict alone.

matplotlib's object API with the Agg canvas (no pyplot, no display, no global backend state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eg2_runtime.tools.bench_report import SHORT_LABELS, MiB, cells_of, named_value, ok, packed_vs_bf16, ratio


def chart(results: dict[str, Any], path: Path) -> None:
    """A 2 x 3 panel PNG for the README (matplotlib, no display needed)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(18, 10), layout="constrained")
    axes = fig.subplots(2, 3)
    meta = results["meta"]
    fig.suptitle(f"eg2 bench, {meta['size']} checkpoint, {meta['gpu'] or meta['cpu']} ({meta['date'][:10]})")
    colors = {"a": "tab:blue", "b": "tab:orange", "c": "tab:gray", "d": "tab:green"}

    ax = axes[0][0]  # named workloads: times faster than the reference
    named = results["workloads"]["named"]
    for j, k in enumerate("abd"):
        speed = []
        for n in named:
            ours = named_value(cells_of(results, k, "named").get(n["key"]), n["metric"])
            ref = named_value(cells_of(results, "c", "named").get(n["key"]), n["metric"])
            r = ratio(ours, ref)
            speed.append(0.0 if r is None else (1 / r if n["better"] == "lower" else r))
        ax.barh(
            [i + (j - 1) * 0.27 for i in range(len(named))],
            speed,
            height=0.27,
            color=colors[k],
            label=SHORT_LABELS[k],
        )
    for i, n in enumerate(named):
        if n["target"] is not None:
            goal = 1 / n["target"] if n["better"] == "lower" else n["target"]
            ax.plot([goal, goal], [i - 0.45, i + 0.45], color="red", lw=2)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(range(len(named)), [n["key"] for n in named])
    ax.set_xscale("log")
    ax.set_xlabel("times faster than (c) (red: target)")
    ax.set_title("named workloads vs the reference")
    ax.legend(fontsize=7)

    ax = axes[0][1]  # matrix throughput at the largest batch
    matrix = results["workloads"]["matrix"]
    biggest = max((w["batch"] for w in matrix), default=1)
    keys = [w["key"] for w in matrix if w["batch"] == biggest]
    for j, k in enumerate("abc"):
        cells = cells_of(results, k, "matrix")
        vals = [cells[key]["call"]["items_per_s"] if ok(cells.get(key)) else 0.0 for key in keys]
        ax.bar(
            [i + (j - 1) * 0.27 for i in range(len(keys))],
            vals,
            width=0.27,
            color=colors[k],
            label=SHORT_LABELS[k],
        )
    ax.set_xticks(range(len(keys)), [key.split("/")[0] for key in keys], rotation=30, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("items/s")
    ax.set_title(f"throughput at batch {biggest}, whole call")
    ax.legend(fontsize=7)

    ax = axes[0][2]  # packed / BF16 per cell
    ratios = packed_vs_bf16(results)
    ax.bar(range(len(ratios)), list(ratios.values()), color=colors["a"])
    ax.axhline(0.97, color="red", lw=1, ls="--", label="0.97 (every cell)")
    ax.axhline(1.0, color="black", lw=0.8, label="1.0 (median)")
    ax.set_xticks(range(len(ratios)), list(ratios), rotation=90, fontsize=6)
    ax.set_ylabel("packed / BF16 items/s")
    ax.set_title("(a) / (b) per cell")
    ax.legend(fontsize=7)

    ax = axes[1][0]  # memory
    cfgs = [k for k in "abc" if k in results["configs"]]
    figures = (
        (
            "weights",
            lambda c: (
                (c.get("weights") or {}).get("allocated_bytes")
                or (c.get("weights") or {}).get("resident_bytes")
            ),
        ),
        ("peak allocated", lambda c: (c.get("memory") or {}).get("peak_allocated_bytes")),
        ("reserved after", lambda c: (c.get("memory") or {}).get("reserved_after_bytes")),
    )
    for j, (label, get) in enumerate(figures):
        vals = [(get(results["configs"][k]) or 0) / MiB for k in cfgs]
        ax.bar([i + (j - 1) * 0.27 for i in range(len(cfgs))], vals, width=0.27, label=label)
    ax.set_xticks(range(len(cfgs)), [SHORT_LABELS[k] for k in cfgs])
    ax.set_ylabel("MiB")
    ax.set_title("memory (CUDA only; CPU: weights by tensor sizes)")
    ax.legend(fontsize=7)

    sweep = [row for row in (results["configs"].get("d") or {}).get("sweep") or [] if not row["error"]]
    families = list(dict.fromkeys(row["family"] for row in sweep))
    concurrencies = sorted({row["concurrency"] for row in sweep})
    for ax, field, label in (
        (axes[1][1], "p99_ms", "p99 latency, ms (dashed: p50)"),
        (axes[1][2], "items_per_s", "items/s"),
    ):
        for family in families:
            rows = [row for row in sweep if row["family"] == family]
            line = ax.plot(
                [row["concurrency"] for row in rows], [row[field] for row in rows], marker="o", label=family
            )
            if field == "p99_ms":
                ax.plot(
                    [row["concurrency"] for row in rows],
                    [row["p50_ms"] for row in rows],
                    ls="--",
                    color=line[0].get_color(),
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.minorticks_off()
        ax.set_xlabel("concurrent clients, one item per request")
        ax.set_ylabel(label)
        ax.set_title("(d) service: " + ("latency" if field == "p99_ms" else "throughput"))
        if families:
            ax.legend(fontsize=7)
    fig.savefig(path, dpi=90)
