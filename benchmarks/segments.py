"""A long audio file in segments through `eg2 serve` over HTTP: time to vectors and segments/s.

One run: start `eg2 serve` (a process of its own), warm it with a short clip in segments, then send a
MINUTES-long file in SECONDS-long segments (one request, `segments: {"seconds": S}`) and time it to
its last vector. The baseline, in the same run: the same signal cut by the client into the same spans,
each a 16 kHz WAV of its own, sent as that many items of one request without segments (what a client
had to do before). Writes one JSON file (figures, command, date, commit, machine).

    python -m benchmarks.segments --model DIR --device cuda --out out/segments.json
    python -m benchmarks.segments --device cpu --minutes 1 --out /tmp/segments.json   (tiny demo model)
"""

from __future__ import annotations

import argparse
import base64
import datetime
import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import soundfile as sf
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.server_process import ROOT, free_port, running, serve_command

RATE = 16_000


def signal(minutes: float, rate: int, seed: int = 0) -> np.ndarray:
    """(n,) float32: a tone that glides plus noise, so decoding and features have real work."""
    n = round(minutes * 60 * rate)
    t = np.arange(n, dtype=np.float64) / rate
    tone = 0.3 * np.sin(2 * np.pi * (220 + 20 * np.sin(2 * np.pi * t / 7)) * t)
    noise = 0.05 * np.random.default_rng(seed).standard_normal(n)
    return (tone + noise).astype(np.float32)


def encode(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    """wav / flac (soundfile) or mp3 (PyAV, 64 kbit/s) bytes of a mono float32 signal."""
    if fmt in ("wav", "flac"):
        buf = io.BytesIO()
        sf.write(buf, samples, rate, format=fmt.upper(), subtype="PCM_16")
        return buf.getvalue()
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp3") as out:
        stream = out.add_stream("libmp3lame", rate=rate, layout="mono")
        stream.bit_rate = 64_000
        for i in range(0, len(samples), 1152):
            frame = av.AudioFrame.from_ndarray(samples[None, i : i + 1152].copy(), "fltp", "mono")
            frame.sample_rate, frame.pts = rate, i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def part(data: bytes, fmt: str) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def post(client: httpx.Client, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    content = json.dumps(body).encode()
    start = time.perf_counter()
    r = client.post("/v1/embeddings", content=content, headers={"content-type": "application/json"})
    seconds = time.perf_counter() - start
    r.raise_for_status()
    return r.json(), seconds


def audio_metrics(url: str) -> dict[str, float]:
    """Sums and counts of the server's audio histograms (batch size, preprocess and inference time)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("modality") == "audio" and s.name.endswith(("_sum", "_count")):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def batches(d: dict[str, float]) -> dict[str, float]:
    count = d.get("eg2_batch_size_count", 0.0)
    return {
        "gpu_batches": count,
        "mean_batch_items": d.get("eg2_batch_size_sum", 0.0) / count if count else 0.0,
        "inference_s": d.get("eg2_inference_seconds_sum", 0.0),
        "preprocess_s": d.get("eg2_preprocess_seconds_sum", 0.0),
    }


def machine() -> str:
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        gpu = ""
    return gpu.splitlines()[0] if gpu else platform.processor() or platform.machine()


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint directory (default: the demo checkpoint)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=10.0, help="span length")
    parser.add_argument("--format", choices=("mp3", "flac", "wav"), default="mp3")
    parser.add_argument("--rate", type=int, default=44_100, help="the file's sample rate (mp3, flac, wav)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args(argv)

    samples = signal(args.minutes, args.rate)
    data = encode(samples, args.rate, args.format)
    warm = encode(signal(0.5, args.rate, seed=1), args.rate, args.format)
    # The baseline's spans: the same signal at 16 kHz (as the server resamples it), cut by the client.
    import soxr

    at16k = soxr.resample(samples, args.rate, RATE, quality="HQ").astype(np.float32)
    size = round(args.seconds * RATE)
    cuts = [encode(at16k[i : i + size], RATE, "wav") for i in range(0, len(at16k), size)]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--host", "127.0.0.1", "--port", str(port), "--device", args.device, "--log-level", "warning"]
    flags += ["--request-timeout-s", "900", "--max-request-bytes", str(max(64 << 20, 2 * len(data)))]
    flags += ["--max-request-segments", "4096", "--max-queued-items", "8192"]
    if args.model:
        flags += ["--model", args.model]
    command = " ".join(["python -m benchmarks.segments", *(argv if argv is not None else sys.argv[1:])])
    with (
        running(serve_command(*flags), dict(os.environ), url, ready_timeout=900),
        httpx.Client(base_url=url, timeout=1800) as client,
    ):
        post(client, {"input": [part(warm, args.format)], "segments": {"seconds": args.seconds}})
        post(client, {"input": [part(cuts[0], "wav"), part(cuts[1], "wav")]})
        before = audio_metrics(url)
        body = {
            "input": [part(data, args.format)],
            "segments": {"seconds": args.seconds},
            "encoding_format": "base64",
        }
        reply, seg_s = post(client, body)
        mid = audio_metrics(url)
        segments = len(reply["data"][0]["segments"])
        base_reply, base_s = post(
            client, {"input": [part(c, "wav") for c in cuts], "encoding_format": "base64"}
        )
        after = audio_metrics(url)
    result = {
        "benchmark": "segments",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        "command": command,
        "file": {"format": args.format, "rate": args.rate, "minutes": args.minutes, "bytes": len(data)},
        "segments": {
            "span_s": args.seconds,
            "count": segments,
            "seconds_to_vectors": round(seg_s, 3),
            "segments_per_s": round(segments / seg_s, 1),
            "audio_seconds_per_s": round(args.minutes * 60 / seg_s, 1),
            "usage_tokens": reply["usage"]["prompt_tokens"],
            **batches(delta(mid, before)),
        },
        "baseline_client_cut": {
            "items": len(cuts),
            "request_bytes": sum(len(c) for c in cuts) * 4 // 3,
            "seconds_to_vectors": round(base_s, 3),
            "items_per_s": round(len(cuts) / base_s, 1),
            "usage_tokens": base_reply["usage"]["prompt_tokens"],
            **batches(delta(after, mid)),
        },
        "ratio_segments_vs_baseline_time": round(seg_s / base_s, 3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
