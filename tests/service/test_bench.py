"""`eg2 bench`: the harness, not the speed. Quick mode on the CPU runs every default configuration, each
in a process of its own, one of them a real `eg2 serve` called over HTTP by client processes, and
writes a well-formed bench.json, bench.md and bench.png; a run stopped midway keeps what it measured.
The pieces (inputs cut to a token count, OpenAI request bodies, timing rounds, figures and targets,
the memory sampler's phases) are checked on their own. Nothing here depends on a speed or a GPU."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from app.schemas import parse_request
from benchmarks import report, server_process
from benchmarks.http_load import client_processes, request, sweep
from benchmarks.process_memory import PeakSampler
from benchmarks.targets import TARGETS, Target
from benchmarks.timing import Budget, time_rounds
from benchmarks.workloads import FAMILIES, QUICK, TEXT_NAMED, Factory, Input, Workload, build, checkpoints
from eg2_runtime.errors import CheckpointError
from eg2_runtime.gpu_memory import Reading
from eg2_runtime.preprocess import Preprocessor

REPO = Path(__file__).resolve().parents[2]
NAMED = (
    "short_query",
    "docs_one_call",
    "long_doc",
    "docs_many_calls",
    "image_one",
    "images_one_call",
    "audio_one",
    "audio_one_call",
    "video_one",
)
MATRIX = {f"{family}/b{b}" for family in FAMILIES for b in (1, 8)}
SWEEP = {("text_short", 1), ("text_short", 4), ("image", 2), ("audio_short", 2)}


def _strict(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} in bench.json")

    return json.loads(text, parse_constant=refuse)


def _positive_call(call: dict[str, Any], where: str) -> None:
    assert call["calls"] >= 1, where
    for key in ("p50_ms", "p99_ms", "items_per_s", "round_p50_ms"):
        assert isinstance(call[key], float) and math.isfinite(call[key]) and call[key] > 0, (where, key, call)
    assert call["p99_ms"] >= call["p50_ms"], (where, call)


def _bench(out: Path, cache: Path, *args: str) -> subprocess.Popen[str]:
    """`eg2 bench --quick` as a user runs it: through the CLI, in a process of its own."""
    cmd = [sys.executable, "-m", "app.cli", "bench", "--quick", "--device", "cpu", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EG2_")}
    return subprocess.Popen(
        [*cmd, "--cache-dir", str(cache), *args], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
    )


# ------------------------------------------------------------------------------------ quick mode


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, str]:
    out = tmp_path_factory.mktemp("bench")
    proc = _bench(out / "result", out / "cache")
    _, stderr = proc.communicate(timeout=900)
    return proc.returncode, out / "result", stderr


@pytest.mark.slow
def test_quick_mode_runs_every_configuration(quick: tuple[int, Path, str]) -> None:
    code, out, stderr = quick
    results = _strict((out / "bench.json").read_text())
    assert results["errors"] == [], results["errors"]
    assert code == 0, stderr[-3000:]
    meta = results["meta"]
    assert meta["device"] == "cpu" and meta["quick"] and meta["size"] == "tiny" and meta["complete"] is True
    assert meta["torch"] and meta["date"] and meta["command"].startswith("eg2 bench --quick") and meta["git"]
    assert meta["cpu"] and meta["cpu_count"] >= 1 and meta["matmul_peak_tflops"] > 0
    assert list(results["configs"]) == ["a", "b", "c", "d"]


@pytest.mark.slow
def test_each_configuration_ran_in_its_own_process(quick: tuple[int, Path, str]) -> None:
    _, out, _ = quick
    configs = _strict((out / "bench.json").read_text())["configs"]
    pids = {key: c["pid"] for key, c in configs.items()}
    assert len(set(pids.values())) == len(pids) and all(isinstance(p, int) for p in pids.values()), pids
    for key in ("a", "b", "c"):  # children of the orchestrator, each started for its configuration
        c = configs[key]
        assert c["exit_code"] == 0 and c["complete"] is True, (key, c.get("error"))
        assert c["argv"][0].endswith(str(Path("benchmarks", "inprocess.py"))) and c["argv"][1] == key, c[
            "argv"
        ]
    d = configs["d"]
    # The user's command, a real server process: `python -m app.cli serve` (what `eg2 serve` runs),
    # stopped with SIGTERM after the workloads, so it drained and exited 0.
    assert d["command"][1:4] == ["-m", "app.cli", "serve"] and "--model" in d["command"], d["command"]
    assert d["exit_code"] == 0 and d["ready_s"] > 0, d
    assert "ERROR" not in Path(d["log"]).read_text()
    # Its engine's report came through /info (the runtime's memory plan: None on a CPU).
    assert d["info"]["engine"]["modalities"] == ["audio", "image", "text", "video"]
    assert "memory_plan" in d["info"]["engine"]


@pytest.mark.slow
def test_memory_figures_are_null_on_a_cpu(quick: tuple[int, Path, str]) -> None:
    """No NVML on a CPU: every memory figure is None, none is made up."""
    _, out, _ = quick
    configs = _strict((out / "bench.json").read_text())["configs"]
    for key, c in configs.items():
        m = c["memory"]
        assert m["source"] is None and m["peak_bytes"] is None and m["samples"] == 0, (key, m)
        assert set(m["points_bytes"].values()) == {None}, (key, m)
        assert set(m["phase_peaks_bytes"].values()) == {None}, (key, m)
    points = {key: set(c["memory"]["points_bytes"]) for key, c in configs.items()}
    assert points == {
        "a": {"load", "warmup", "named", "matrix"},
        "b": {"load", "warmup", "named", "matrix"},
        "c": {"load", "warmup", "named", "matrix"},
        "d": {"ready", "named", "sweep"},
    }, points


@pytest.mark.slow
def test_json_has_every_workload(quick: tuple[int, Path, str]) -> None:
    _, out, _ = quick
    results = _strict((out / "bench.json").read_text())
    assert {w["key"] for w in results["workloads"]["matrix"]} == MATRIX
    assert [n["key"] for n in results["workloads"]["named"]] == list(NAMED)
    for key in ("a", "b", "c"):
        cfg = results["configs"][key]
        assert cfg["weights"]["resident_bytes"] > 0 and cfg["load_s"] > 0, key
        assert set(cfg["matrix"]) == MATRIX and set(cfg["named"]) == set(NAMED), key
        for name, cell in (cfg["matrix"] | cfg["named"]).items():
            _positive_call(cell["call"], f"({key}) {name}")
            assert cell["call"]["tokens_per_s"] > 0, (key, name)
    for key in ("a", "b"):  # the embed and forward alone, where quick mode times them (batch 1)
        for family in FAMILIES:
            cell = results["configs"][key]["matrix"][f"{family}/b1"]
            assert cell["embed"]["p50_ms"] > 0 and cell["forward"]["p50_ms"] > 0, (key, family)
        for family in ("text_long", "image"):
            assert results["configs"][key]["matrix"][f"{family}/b1"]["forward_tflops"] > 0, (key, family)
        for name, cell in results["configs"][key]["matrix"].items():  # no graphs on a CPU
            assert cell["graphs"] == {"captured": [], "refused": [], "pool_mib": None}, (key, name)

    d = results["configs"]["d"]
    assert set(d["named"]) == set(NAMED)
    for name, cell in d["named"].items():
        _positive_call(cell["call"], f"(d) {name}")
        # Where the server spent the cell's calls, from /metrics: every item the calls sent ran on the
        # GPU, each modality's stages timed.
        call = cell["call"]
        items = sum(row["items"] for row in cell["server"].values())
        assert items == (call["warmup_rounds"] + call["rounds"]) * cell["items_per_round"], (name, cell)
        for row in cell["server"].values():
            assert row["batches"] >= 1 and row["inference_ms"] > 0 and row["preprocess_ms"] >= 0, (name, row)
    assert {(r["family"], r["concurrency"]) for r in d["sweep"]} == SWEEP
    for row in d["sweep"]:
        assert not row["error"] and not row["failures"], row
        assert row["requests"] >= row["concurrency"] and row["p99_ms"] >= row["p50_ms"] > 0, row
        assert row["items_per_s"] > 0 and row["server_inference_p50_ms"] > 0, row
        # Several client processes whenever there are several clients: the client is not the limit.
        assert (
            row["client_processes"]
            == min(client_processes(), row["concurrency"])
            >= min(2, row["concurrency"])
        )

    assert [t["name"] for t in results["targets"]] == [t.name for t in TARGETS]
    for t in results["targets"]:
        assert t["judged"] is False and t["met"] is None, t  # a CPU run judges nothing


@pytest.mark.slow
def test_markdown_has_every_table(quick: tuple[int, Path, str]) -> None:
    _, out, _ = quick
    md = (out / "bench.md").read_text()
    results = _strict((out / "bench.json").read_text())
    meta = results["meta"]
    assert meta["date"] in md and meta["git"] in md and meta["command"] in md  # every figure's provenance
    for heading in (
        "## Targets",
        "## Process GPU memory",
        "## Named workloads",
        "## Modality x batch: throughput",
        "## Modality x batch: latency",
        "## Over HTTP",
    ):
        assert heading in md, heading
    for n in results["workloads"]["named"]:
        assert n["label"] in md, n["label"]
    for family in FAMILIES:
        assert f"| {family} | 1 |" in md and f"| {family} | 8 |" in md, family
    # Every table row has as many cells as its header.
    for block in md.split("\n\n"):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        if rows:
            assert len({row.count(" | ") for row in rows if not row.startswith("|---")}) == 1, block


@pytest.mark.slow
def test_png_is_a_chart(quick: tuple[int, Path, str]) -> None:
    _, out, _ = quick
    with Image.open(out / "bench.png") as png:
        assert png.format == "PNG" and png.width > 800 and png.height > 400


@pytest.mark.slow
def test_a_stopped_run_keeps_what_it_measured(tmp_path: Path) -> None:
    """SIGTERM to `eg2 bench` while (a) runs: the child is stopped, the cells it had measured are in
    bench.json (its JSON is rewritten after every cell), and the outputs say the run stopped."""
    out = tmp_path / "result"
    proc = _bench(out, tmp_path / "cache", "--configs", "a,b")
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # the progress lines: wait for (a)'s second cell
        lines.append(line)
        if line.split("] ", 1)[-1].startswith("a docs_one_call:"):
            proc.send_signal(signal.SIGTERM)
            break
    else:
        pytest.fail("".join(lines[-30:]))
    proc.communicate(timeout=120)
    assert proc.returncode == 1  # the stop is reported as an error
    results = _strict((out / "bench.json").read_text())
    assert results["meta"]["stopped"] is True and results["meta"]["complete"] is False
    a = results["configs"]["a"]
    assert "stopped by a signal" in a["error"] and a["complete"] is False, a.get("error")
    assert {"short_query", "docs_one_call"} <= set(a["named"]), a["named"]
    _positive_call(a["named"]["short_query"]["call"], "(a) short_query")
    assert "b" not in results["configs"]
    assert "PARTIAL" in (out / "bench.md").read_text()


# ------------------------------------------------------------------------------------------ pieces


def test_texts_are_cut_to_the_token_count(tiny_bf16: Path) -> None:
    factory = Factory(Preprocessor.from_dir(tiny_bf16))
    for tokens in (17, 20, 40, 500):
        text = factory.text(tokens, seed=tokens)
        assert text.tokens == tokens, (tokens, text)  # the demo tokenizer: one token per character
    assert factory.text(40, seed=1).text != factory.text(40, seed=2).text


def test_request_bodies_are_valid_openai_requests(tiny_bf16: Path) -> None:
    factory = Factory(Preprocessor.from_dir(tiny_bf16))
    inputs = [factory.text(20, 0), factory.image(64, 48), factory.audio(0.5), factory.video(2)]
    req = request(inputs)
    body = parse_request(req.body, max_items=16)
    assert len(body.input) == 4 and body.encoding_format == "base64"
    assert req.items == 4 and req.tokens == sum(x.tokens for x in inputs)


def test_workloads_are_the_issues_named_workloads(tiny_bf16: Path) -> None:
    workloads = build(Preprocessor.from_dir(tiny_bf16), QUICK, (1, 8))
    assert [w.key for w in workloads.named] == list(NAMED)
    assert set(TEXT_NAMED) == {w.key for w in workloads.named if w.modality == "text"}
    many = next(w for w in workloads.named if w.key == "docs_many_calls")
    assert many.items == QUICK.docs_total and many.batch == QUICK.per_call
    assert set(workloads.sweep) == {"text_short", "image", "audio_short"}
    assert all(len(c) == 1 for w in workloads.matrix if w.batch == 1 for c in w.calls)


def test_time_rounds_stops_slow_calls_after_one_round() -> None:
    calls: list[int] = []

    def slow_call(i: int) -> None:
        calls.append(i)
        time.sleep(0.05)

    work = Workload("x/b1", "x", "text", "x", ((Input("text", "x", tokens=3),),))
    out = time_rounds(
        slow_call, work, Budget(seconds=0.01, warmup=1, min_rounds=3, max_rounds=100, cap_s=0.02)
    )
    assert out["warmup_rounds"] == 1 and out["rounds"] == 1 and len(calls) == 2
    assert out["tokens_per_s"] == pytest.approx(3 / (out["mean_ms"] / 1000), rel=0.3)


def test_a_rounds_time_is_all_its_calls() -> None:
    """A named workload of several calls ("256 docs in 4 calls") is timed as the whole round."""
    work = Workload("w", "w", "text", "w", tuple((Input("text", "x", tokens=1),) for _ in range(4)))
    out = time_rounds(lambda i: time.sleep(0.01), work, Budget(0.001, 0, 2, 2, 10.0))
    assert out["rounds"] == 2 and out["calls"] == 8
    assert out["round_p50_ms"] >= 4 * 10 and out["round_p50_ms"] >= 3.5 * out["p50_ms"], out


def test_a_failing_cell_is_recorded_and_the_others_run() -> None:
    from benchmarks.inprocess import measure

    class Flaky:
        def call(self, inputs: Any) -> None:
            if inputs[0].text == "bad":
                raise RuntimeError("boom")

    bad, good = (Workload(f"{t}/b1", t, "text", t, ((Input("text", t, tokens=1),),)) for t in ("bad", "good"))
    saved: list[set[str]] = []
    cells = measure(
        Flaky(),  # type: ignore[arg-type]
        [bad, good],
        Budget(0.001, 0, 1, 1, 0.001),
        lambda line: None,
        lambda cells: saved.append(set(cells)),
    )
    assert cells["bad/b1"]["error"] == "RuntimeError: boom" and "boom" in cells["bad/b1"]["traceback"]
    assert cells["good/b1"]["error"] is None and cells["good/b1"]["call"]["calls"] == 1
    assert saved == [{"bad/b1"}, {"bad/b1", "good/b1"}]  # written after every cell


def test_the_sampler_takes_each_phases_peak() -> None:
    class Reader:  # NVML's answers for one process, in order
        available = True

        def __init__(self) -> None:
            self.values = iter([100, 300, 200, 900, 400])

        def read(self, pid: int | None = None) -> Reading:
            return Reading(next(self.values), "nvml-process")

    sampler = PeakSampler(Reader())  # type: ignore[arg-type]
    sampler._pid = 1  # read() only, no polling thread: each sample's time set below
    for _ in range(5):
        sampler.read()
    sampler.samples = [(float(t), b) for t, (_, b) in enumerate(sampler.samples)]
    assert sampler.phase_peaks({"load": (0, 2), "named": (2, 4)}) == {"load": 300, "named": 900}
    assert sampler.peak() == 900 and sampler.source == "nvml-process"
    assert PeakSampler(Reader()).peak() is None  # type: ignore[arg-type]  # nothing sampled: no figure


def _results(**configs: Any) -> dict[str, Any]:
    meta = {"device": "cuda", "size": "full", "quick": False, "matmul_peak_tflops": 100.0}
    return {"meta": meta, "configs": configs, "workloads": {"named": [], "matrix": []}}


def _named(**ms: float) -> dict[str, Any]:
    return {k: {"error": None, "call": {"round_p50_ms": v}} for k, v in ms.items()}


def test_figures_read_what_their_targets_name() -> None:
    mib = 1 << 20
    results = _results(
        a={
            "matrix": {
                "t/b1": {"family": "text_short", "error": None, "call": {"items_per_s": 1000.0}},
                "l/b8": {"family": "text_long", "error": None, "call": {"items_per_s": 99.0}, "embed": {"items_per_s": 50.0}, "forward_tflops": 40.0},
            }
        },
        b={"matrix": {"l/b8": {"error": None, "call": {"items_per_s": 100.0}, "embed": {"items_per_s": 40.0}}}},
        c={"named": _named(image_one=90.0)},
        d={
            "named": _named(image_one=20.0),
            "memory": {"points_bytes": {"ready": 1500 * mib, "named": 1700 * mib}, "phase_peaks_bytes": {"ready": 2100 * mib}, "peak_bytes": 2100 * mib},
            "sweep": [{"family": "text_short", "concurrency": 128, "error": None, "items_per_s": 900.0, "p99_ms": 9.0}],
        },
    )  # fmt: skip
    f = lambda spec: report.figure(results, spec)  # noqa: E731
    assert f("memory:d:ready") == 1500 and f("memory:d:named+boot") == 2100 and f("memory:d:peak") == 2100
    assert f("memory:c:ready") is None  # nothing measured: no figure
    assert f("named:d:image_one") == 20.0 and f("ratio:d:c:image_one") == pytest.approx(20 / 90)
    assert f("sweep:d:text_short:128:items_per_s") == 900.0 and f("sweep:d:text_short:32:p99_ms") is None
    assert f("packed_vs_bf16:worst") == pytest.approx(0.99)
    assert f("packed_vs_bf16:worst:embed") == pytest.approx(1.25)  # t/b1 has no embed figure: left out
    assert f("saturation:d:a") == pytest.approx(0.9)
    assert f("peak_share:a:text_long") == pytest.approx(0.4)
    with pytest.raises(ValueError, match="unknown figure"):
        f("speed:d")


def test_targets_are_judged_only_on_a_full_gpu_run() -> None:
    table = (
        Target(12, "image", "named:d:image_one", "<=", 25, "ms"),
        Target(12, "ratio", "ratio:d:c:image_one", "<=", 1 / 3, "x"),
        Target(15, "missing", "named:d:long_doc", "<=", 10, "ms"),
    )
    results = _results(c={"named": _named(image_one=90.0)}, d={"named": _named(image_one=31.0)})
    by_name = {t["name"]: t for t in report.targets(results, table)}
    assert by_name["image"]["met"] is False and by_name["image"]["value"] == 31.0
    assert by_name["ratio"]["met"] is False and by_name["ratio"]["goal"] == "<= 1/3x"  # 0.344 > 1/3
    assert by_name["missing"]["met"] is None  # not measured: n/a, never "met"
    results["meta"]["quick"] = True
    assert {t["met"] for t in report.targets(results, table)} == {None}
    assert all(t["judged"] is False for t in report.targets(results, table))


def test_the_report_names_the_buckets_the_pool_refused() -> None:
    """The matrix section lists each configuration's refused graph buckets, as the last cell that
    recorded them has them, and says nothing where none was refused."""
    workload = {"key": "audio_short/b8", "family": "audio_short", "batch": 8, "tokens": 1896, "items": 8}
    cells = {
        "image/b1": {"graphs": {"captured": ["('image', 1, 256)"], "refused": []}},
        "audio_short/b8": {"graphs": {"captured": [], "refused": ["('audio', 8, 1024)"]}},
        "video/b1": {"error": "out of memory"},
    }
    results: dict[str, Any] = {
        "meta": {"matmul_peak_tflops": None},
        "workloads": {"matrix": [workload]},
        "configs": {"a": {"matrix": cells}, "b": {"matrix": {"image/b1": cells["image/b1"]}}, "c": {}},
    }
    text = "\n".join(report._matrix(results))
    assert "Graph buckets the pool refused" in text and "(a) ('audio', 8, 1024); (b) none" in text
    results["configs"]["a"]["matrix"] = {"image/b1": cells["image/b1"]}
    assert "Graph buckets the pool refused" not in "\n".join(report._matrix(results))


def test_the_report_names_each_first_use_capture_with_the_pools_fill() -> None:
    """Which cell's capture took the pool's room: each cell that captured buckets, with the fill the
    pool counted after it; nothing where no cell captured."""
    workload = {"key": "image/b8", "family": "image", "batch": 8, "tokens": 2160, "items": 8}
    pool = {"used": 442.0, "budget": 474.0}
    cells = {
        "image/b1": {"graphs": {"captured": [], "refused": [], "pool_mib": pool}},
        "image/b8": {"graphs": {"captured": ["('image', 4, 2520)"], "refused": [], "pool_mib": pool}},
        "video/b1": {"graphs": {"captured": ["('image', 8, 630)"], "refused": [], "pool_mib": None}},
    }
    results: dict[str, Any] = {
        "meta": {"matmul_peak_tflops": None},
        "workloads": {"matrix": [workload]},
        "configs": {
            "a": {"named": {"images_one_call": cells["image/b8"]}, "matrix": cells},
            "b": {"matrix": {"image/b1": cells["image/b1"]}},
            "c": {},
        },
    }
    text = "\n".join(report._matrix(results))
    assert (
        "(a) images_one_call: ('image', 4, 2520) (pool 442 / 474 MiB), image/b8: ('image', 4, 2520) "
        "(pool 442 / 474 MiB), video/b1: ('image', 8, 630); (b) none"
    ) in text, text
    results["configs"]["a"]["named"] = {}
    results["configs"]["a"]["matrix"] = {"image/b1": cells["image/b1"]}
    assert "captured on first use" not in "\n".join(report._matrix(results))


def test_pairs_alternate_a_and_b_right_after_their_first_runs() -> None:
    """`--pairs N`: every configuration once in its order, with (b), (a), then (a), (b), and so on
    right after (b)'s first run, N runs of each of the pair; past 1 it needs both in --configs, and 0
    is no count."""
    from benchmarks import bench

    configs = tuple(c for c in bench.CONFIGS if c.key in ("a", "b", "c", "d"))
    runs = [(c.key, n) for c, n in bench.schedule(configs, 3)]
    assert runs == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("c", 0), ("d", 0)]
    assert [(c.key, n) for c, n in bench.schedule(configs, 1)] == [(c.key, 0) for c in configs]
    for argv in (["--pairs", "2", "--configs", "a,c"], ["--pairs", "0"]):
        with pytest.raises(SystemExit):
            bench.parse(["--quick", "--device", "cpu", *argv])


def test_a_run_with_pairs_records_each_further_run_of_a_and_b(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`bench.run` with `--pairs 3`, the processes stood in for: the further runs of (a) and (b) come
    straight after (b)'s first, alternating, each with files of its own; their matrices land in
    `repeats`, a run the time limit leaves no room for is recorded as skipped, and packed / BF16
    comes from the medians."""
    import contextlib as ctx
    import dataclasses

    from benchmarks import bench

    clock = [0.0]
    order: list[str] = []
    rates = iter([80.0, 100.0, 98.0, 100.0, 104.0])  # a0, b0, b1, a1, a2

    def inprocess(
        cfg: Any, model_dir: Path, opts: Any, tmp: Path, limit: float, *rest: Any
    ) -> dict[str, Any]:
        order.append(f"{cfg.key}{rest[-1]}")
        clock[0] += 100.0  # each process 100 s: no room left for (b)'s third run
        cell = {"family": "text_short", "error": None, "call": {"items_per_s": next(rates)}}
        return {"matrix": {"t/b1": cell}, "named": {}}

    workloads = type(
        "W", (), {"matrix": [], "named": [], "describe": lambda self: {"named": [], "matrix": []}}
    )()
    monkeypatch.setattr(bench, "_inprocess", inprocess)
    monkeypatch.setattr(bench, "_start", lambda cmd: None)
    monkeypatch.setattr(bench, "_peak", lambda proc, path: {})
    monkeypatch.setattr(bench, "settle_device", lambda nvml: None)
    monkeypatch.setattr(bench, "matched_budget", lambda bf16, w4: 1 << 30)
    monkeypatch.setattr(bench, "checkpoints", lambda *a: ctx.nullcontext((tmp_path, tmp_path)))
    monkeypatch.setattr(bench, "_workloads", lambda *a: workloads)
    monkeypatch.setattr(bench, "write", lambda *a, **k: [])
    monkeypatch.setattr(bench.time, "time", lambda: clock[0])
    opts = bench.parse(
        ["--quick", "--device", "cpu", "--configs", "a,b", "--pairs", "3", "--out", str(tmp_path)]
    )
    results = bench.run(dataclasses.replace(opts, time_limit_s=510.0))
    assert order == ["a0", "b0", "b1", "a1", "a2"], order
    repeats = {k: results["configs"][k]["repeats"] for k in "ab"}
    assert [r["run"] for r in repeats["a"]] == [1, 2] and [r["run"] for r in repeats["b"]] == [1, 2]
    assert repeats["b"][1]["error"] == "skipped: --time-limit reached"
    assert report.items_per_s(results, "a") == {"t/b1": 100.0}
    assert report.figure(results, "packed_vs_bf16:worst") == pytest.approx(100 / 99)
    assert "(b) run 3: skipped: --time-limit reached" in results["errors"]


def test_with_pairs_packed_vs_bf16_takes_each_sides_median() -> None:
    """Three runs of (a) and (b): each cell's items/s is the median of its runs that measured it, the
    ratio is of those medians, the report says so with each pair's worst cell, and a further run's
    failed cell is an error of the run."""
    from benchmarks.bench import _errors

    def runs(*values: float | None) -> list[dict[str, Any]]:
        return [
            {
                "t/b1": {
                    "family": "text_short",
                    "error": None,
                    "call": {"items_per_s": v, "tokens_per_s": 20 * v, "p50_ms": 1e3 / v, "p99_ms": 1e3 / v},
                }
            }
            if v is not None
            else {"t/b1": {"family": "text_short", "error": "out of memory"}}
            for v in values
        ]

    a, b = runs(80.0, 100.0, 104.0), runs(100.0, 98.0, None)
    results = _results(
        a={"matrix": a[0], "repeats": [{"run": 1, "matrix": a[1]}, {"run": 2, "matrix": a[2]}]},
        b={"matrix": b[0], "repeats": [{"run": 1, "matrix": b[1]}, {"run": 2, "matrix": b[2]}]},
        c={},
    )
    results["workloads"]["matrix"] = [
        {"key": "t/b1", "family": "text_short", "batch": 1, "tokens": 20, "items": 1}
    ]
    assert report.items_per_s(results, "a") == {"t/b1": 100.0}
    assert report.items_per_s(results, "b") == {"t/b1": 99.0}, "the failed run left out"
    assert report.figure(results, "packed_vs_bf16:worst") == pytest.approx(100 / 99)
    assert report.pair_worst(results) == [pytest.approx(0.8), pytest.approx(100 / 98), None]
    text = "\n".join(report._matrix(results))
    assert "ran as 3 pairs" in text and "0.800x, 1.020x, -." in text, text
    assert "| text_short | 1 | 20 | 100 | 99.0 | - | 1.010x |" in text, text
    assert _errors(results["configs"]) == ["(b) run 3 t/b1: out of memory"]
    results["configs"]["b"]["repeats"].pop()  # (b)'s third run never ran: (a)'s is left out too
    assert report.items_per_s(results, "a", runs_of="b") == {"t/b1": 90.0}
    assert report.figure(results, "packed_vs_bf16:worst") == pytest.approx(90 / 99)
    del results["configs"]["a"]["repeats"], results["configs"]["b"]["repeats"]
    assert report.figure(results, "packed_vs_bf16:worst") == pytest.approx(0.8), "one run: as before"
    assert "times each" not in "\n".join(report._matrix(results))


def test_graph_buckets_reads_every_graph_set_of_the_engine() -> None:
    """Captured (a graph made), refused (by the pool) and deferred buckets, from the text graphs and
    the towers alike; an engine part that is None (no graphs on a CPU) adds nothing."""
    from types import SimpleNamespace

    from benchmarks.inprocess import graph_buckets

    towers = SimpleNamespace(
        graphs={
            ("audio", 8, 1024): SimpleNamespace(graph=object()),
            ("audio", 16, 1024): SimpleNamespace(graph=None),
        },
        refused={("audio", 16, 1024)},
        deferred={("image", 1, 2520)},
    )
    packed = SimpleNamespace(graphs={2304: SimpleNamespace(graph=object())}, refused={8192}, deferred=set())
    engine = SimpleNamespace(graphs=None, packed=packed, towers=towers)
    captured, refused, deferred = graph_buckets(engine)  # type: ignore[arg-type]
    assert captured == {"('audio', 8, 1024)", "2304"}
    assert refused == {"('audio', 16, 1024)", "8192"}
    assert deferred == {"('image', 1, 2520)"}


def test_graph_pool_mib_reads_the_shared_pool_or_none() -> None:
    """The pool the text and tower graphs share, in MiB as it counts them; None without graphs."""
    from types import SimpleNamespace

    from benchmarks.inprocess import graph_pool_mib

    pool = SimpleNamespace(used=442 * 2**20, budget=474 * 2**20)
    engine = SimpleNamespace(graphs=None, packed=SimpleNamespace(pool=pool), towers=None)
    assert graph_pool_mib(engine) == {"used": 442.0, "budget": 474.0}  # type: ignore[arg-type]
    engine.packed.pool = SimpleNamespace(used=0, budget=None)
    assert graph_pool_mib(engine) == {"used": 0.0, "budget": None}  # type: ignore[arg-type]
    assert graph_pool_mib(SimpleNamespace(graphs=None, packed=None, towers=None)) is None  # type: ignore[arg-type]


def test_every_target_names_a_figure_and_an_issue() -> None:
    for t in TARGETS:
        assert t.issue in (12, 15) and t.op in ("<=", ">=") and t.goal > 0, t
        assert report.figure(_results(), t.figure) is None, t  # parses; nothing measured, no figure


def test_model_dir_must_be_the_bf16_source(tiny_w4: Path) -> None:
    with pytest.raises(CheckpointError, match="BF16"), checkpoints(tiny_w4, tiny_w4, "tiny", print):
        pass


def test_bench_help_answers() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "bench", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "--quick" in done.stdout and "--budgets" in done.stdout, done.stderr


@pytest.mark.slow
def test_scale_measures_a_real_server(tiny_bf16: Path, tmp_path: Path) -> None:
    """benchmarks/scale.py end to end against `eg2 serve` on the CPU: both loads answered, nothing
    failed, figures written (the Ray phases need GPUs to mean anything; CI covers Ray elsewhere)."""
    out = tmp_path / "scale"
    cmd = [sys.executable, "-m", "benchmarks.scale", "--model", str(tiny_bf16), "--phases", "serve",
           "--seconds", "0.5", "--out", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("EG2_")} | {"EG2_DEVICE": "cpu"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    serve = json.loads((out / "scale.json").read_text())["phases"]["serve"]
    for load, items in (("single", 1), ("batch32", 32)):
        row = serve[load]
        assert row["items_per_request"] == items and not row["failures"] and row["requests"] > 0, row
        assert row["items_per_s"] > 0 and row["p99_ms"] >= row["p50_ms"] > 0, row


def test_free_port_is_drawn_outside_the_ephemeral_range_and_rays() -> None:
    """Outgoing connections and port-0 binds take their ports from the ephemeral range, and Ray binds
    its workers' (10002-19999) and HAProxy-mode replicas' (30000-31000): a port told to a server in
    advance is drawn where none of them can take it before the server binds."""
    low, high = server_process._ephemeral_range()
    ports = {server_process.free_port() for _ in range(20)}
    assert all(not low <= port <= high and not 10_002 <= port < 20_000 for port in ports), sorted(ports)
    assert all(not 30_000 <= port <= 31_000 for port in ports), sorted(ports)
    assert len(ports) > 1  # drawn, not one fixed port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # and free


LISTENER = """
import socket, sys, time
held = [socket.create_connection(("127.0.0.1", int(sys.argv[2])))]  # connected to the test's listener
for family, host in [(socket.AF_INET6, "::1"), (socket.AF_INET, "127.0.0.1")][: int(sys.argv[1])]:
    server = socket.socket(family)
    server.bind((host, 0))
    server.listen()
    held += [server, socket.create_connection((host, server.getsockname()[1]))]  # a connection too
print(*(s.getsockname()[1] for s in held[1::2]), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("families", [0, 1, 2], ids=["connected-only", "ipv6-only", "ipv6-and-ipv4"])
def test_listening_port_reads_a_process_listening_socket(families: int) -> None:
    """What `Serve` reads back after starting a server on port 0: the port of the process's listening
    socket (IPv4 first, else IPv6), never a connected socket's; None while it listens on nothing."""
    with socket.create_server(("127.0.0.1", 0)) as outside:
        command = [sys.executable, "-c", LISTENER, str(families), str(outside.getsockname()[1])]
        with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as proc:
            try:
                assert proc.stdout is not None
                ports = [int(p) for p in proc.stdout.readline().split()]
                assert server_process.listening_port(proc.pid) == (ports[-1] if ports else None), ports
            finally:
                proc.kill()


def _embeddings_answered(url: str) -> float:
    """/metrics' count of 200 answers on the embeddings route."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "eg2_requests"
        for s in family.samples
        if s.name.endswith("_total")
        and s.labels.get("route") == "/v1/embeddings"
        and s.labels.get("status") == "200"
    )


def test_a_sweep_row_drives_its_load_untimed_first() -> None:
    """With warm-up on, a sweep row runs the same load untimed before the timed window and keeps that
    window's figures as `cold`: the server answered both windows' requests, only the timed ones make
    the row, and the graph captures each window saw are read around it (a fake engine that reports
    a capture per batch size first seen: one client's batches of 1 capture once, in the untimed one)."""
    port = server_process.free_port()
    cmd, env = server_process.fake_engine_server(port)
    url = f"http://127.0.0.1:{port}"
    budget = Budget(seconds=0.05, warmup=1, min_rounds=2, max_rounds=10, cap_s=1.0)
    query = Input("text", text="what is the capital of france", tokens=8)
    spawn = multiprocessing.get_context("spawn")
    with (
        server_process.running([*cmd, "--capture-new-sizes"], env, url),
        ProcessPoolExecutor(2, mp_context=spawn) as pool,
    ):
        before = _embeddings_answered(url)
        (row,) = sweep(pool, 2, url, [("text_short", query, 1)], budget, print)
        answered = _embeddings_answered(url) - before
    assert not row["error"] and not row["cold"]["error"] and row["cold"]["failures"] == {}, row
    assert row["cold"]["requests"] >= 2 and row["requests"] >= 2, row  # 2 requests a client at least
    assert answered == row["cold"]["requests"] + row["requests"], (answered, row)
    assert row["cold"]["items_per_s"] > 0 and row["cold"]["p99_ms"] >= row["cold"]["p50_ms"] > 0, row
    assert (row["cold"]["captures"], row["cold"]["capture_s"]) == (1, 0.1), row
    assert (row["captures"], row["capture_s"]) == (0, 0.0), row
