"""A request's cost is bounded before expensive work starts, and work stops when nobody waits for it.

The attacker's table of issue 13 (2026-12-01, commit 3bcf7d1, CPU, tiny demo model), replayed against
the real `eg2 serve` in a subprocess, so that its memory (VmHWM, reset before each request through
/proc/PID/clear_refs) and its CPU time (/proc/PID/stat) are the server's alone:

| sent | before | checked here |
|---|---|---|
| one item of 1,000 one-pixel PNGs (~160 kB) | 400 after 4.8 s, RSS +3.4 GB | 413 at once, peak RSS growth <= 300 MB |
| one 30 MB string | 200 after 22 s, RSS +2.6 GB | 200, with the CPU and memory of a full-length text (+3 s, +300 MB at most) |
| an 8 kB prompt with 2,048 one-letter items | 503 after 60 s of CPU | 413 at once, peak RSS growth <= 300 MB |
| 4 requests of a 60 s 4K clip, abandoned after 0.3 s | ~25 s of CPU after the hang-ups; an image behind them 23 s | 413 at once by default; with the clip allowed, <= 2.5 s of CPU after the hang-ups, the image within its idle time + 3 s, 4 items counted dropped |

and the smaller findings: a data: URI in capitals, `"dimensions": "256"`, a 150 s clip (300 s were
allowed), the README's audio promise. The figures are safety bounds around the failure, with the
measured value in each message; the machine is shared, so CPU time is measured, not wall time.
"""

from __future__ import annotations

import base64
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.settings import Settings
from tests.support import media
from tests.support.fake_engine import assert_error, image_part, video_part
from tests.support.load import Serve

START_TIMEOUT_S = 180
SECONDS = 5.0  # the most a refusal may take on a busy 2-core CPU
RSS_GROWTH_MB = 300  # the acceptance bound for any single request within max_request_bytes
REPO = Path(__file__).resolve().parents[2]

PIXEL_PNG = media.encode_image(media.picture(1, 1), "PNG")
SMALL_PNG = media.encode_image(media.picture(48, 64), "PNG")


@pytest.fixture(scope="module")
def clip_4k() -> bytes:
    """60 s of 3840x2160 at 30 fps (1,800 frames, ~4 MB): ~5 s of CPU to decode on the dev machine."""
    return media.repeated_clip(media.moving_texture_clip(30, (2160, 3840)), 60)


@pytest.fixture(scope="module")
def server(tiny_bf16: Path) -> Iterator[Serve]:
    """Default settings (what an operator gets), on the CPU."""
    with Serve(["--model", str(tiny_bf16), "--device", "cpu", "--log-level", "warning"]) as s:
        yield s.wait_ready(START_TIMEOUT_S)


def post(url: str, body: Any, timeout: float = 120) -> tuple[httpx.Response, float]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    start = time.monotonic()
    r = httpx.post(
        url + "/v1/embeddings", content=content, headers={"content-type": "application/json"}, timeout=timeout
    )
    return r, time.monotonic() - start


def _status(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+)", text, re.M).group(1))  # type: ignore[union-attr]


def peak_growth_mb(serve: Serve, send: Callable[[], Any]) -> tuple[Any, float]:
    """send()'s result and the server's peak RSS growth while it ran, in MB (VmHWM after a reset)."""
    Path(f"/proc/{serve.proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status(serve.proc.pid, "VmRSS")
    result = send()
    return result, (_status(serve.proc.pid, "VmHWM") - base) / 1024


def cpu_s(serve: Serve) -> float:
    """The server process's CPU time (user + system, all threads)."""
    fields = Path(f"/proc/{serve.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


# --- the table's rows ------------------------------------------------------------------------------


def test_a_thousand_images_in_one_item_are_refused_before_decoding(server: Serve) -> None:
    body = {"input": [{"content": [image_part(PIXEL_PNG)] * 1000}]}
    assert len(json.dumps(body)) < 200_000
    (r, seconds), growth = peak_growth_mb(server, lambda: post(server.url, body))
    error = assert_error(r, 413, "request_too_large", "input[0].content")
    assert "1000 parts" in error["message"], error
    assert seconds < SECONDS, f"refused after {seconds:.1f} s"
    assert growth <= RSS_GROWTH_MB, f"peak RSS grew {growth:.0f} MB"
    # Within the parts limit, the media alone are over the model's context: refused from the headers.
    body = {"input": [{"content": [image_part(PIXEL_PNG)] * 40}]}
    (r, seconds), growth = peak_growth_mb(server, lambda: post(server.url, body))
    assert "10322 tokens" in assert_error(r, 400, "invalid_request_error")["message"]
    assert seconds < SECONDS and growth <= RSS_GROWTH_MB, (seconds, growth)
    print(f"\n1,000 one-pixel PNGs: 413; 40 of them: 400 in {seconds:.2f} s, peak RSS +{growth:.0f} MB")


def test_a_30_mb_string_costs_what_a_full_length_text_costs(server: Serve) -> None:
    """A 30 MB string is cut to the model's 8,192 tokens: its memory and CPU are a full-length text's
    (an 8,190-character one, measured here first) plus what reading 30 MB takes, not +2.6 GB and 22 s;
    each within the 300 MB any single request may add (the lean text path holds no T x T mask)."""
    full = {"input": "the cat sat on the mat, " * 341}
    cpu0 = cpu_s(server)
    (r, full_s), full_growth = peak_growth_mb(server, lambda: post(server.url, full))
    full_cpu = cpu_s(server) - cpu0
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8186, r.text[:300]
    text = ("the cat sat on the mat, " * 1_300_000)[:30_000_000]
    cpu0 = cpu_s(server)
    (r, seconds), growth = peak_growth_mb(server, lambda: post(server.url, {"input": text}))
    cpu = cpu_s(server) - cpu0
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["prompt_tokens"] == 8192
    print(
        f"\n30 MB string: 200 in {seconds:.1f} s, {cpu:.1f} s of server CPU, peak RSS +{growth:.0f} MB; "
        f"8,190 characters: {full_s:.1f} s, {full_cpu:.1f} s, +{full_growth:.0f} MB"
    )
    assert full_growth <= RSS_GROWTH_MB, f"a full-length text: peak RSS +{full_growth:.0f} MB"
    # With a short text beside it: the long one runs alone (the CPU's batch budget), within the bound.
    (r, _), padded_growth = peak_growth_mb(server, lambda: post(server.url, {"input": [full["input"], "hi"]}))
    assert r.status_code == 200, r.text[:300]
    assert padded_growth <= RSS_GROWTH_MB, f"a full-length text and a short one: +{padded_growth:.0f} MB"
    assert growth <= RSS_GROWTH_MB, f"peak RSS +{growth:.0f} MB (was +2.6 GB)"
    assert cpu <= full_cpu + 3, f"{cpu:.1f} s of server CPU vs {full_cpu:.1f} s (was 22 s)"


def test_a_huge_prompt_over_many_items_is_refused_before_tokenizing(server: Serve) -> None:
    body = {"input": [chr(ord("a") + i % 26) for i in range(2048)], "prompt": "p" * 8000}
    assert len(json.dumps(body)) < 30_000
    cpu0 = cpu_s(server)
    (r, seconds), growth = peak_growth_mb(server, lambda: post(server.url, body))
    cpu = cpu_s(server) - cpu0
    error = assert_error(r, 413, "request_too_large", "input")
    assert "max_request_tokens" in error["message"], error
    assert seconds < SECONDS and cpu < 2, f"{seconds:.1f} s, {cpu:.1f} s of CPU (was 60 s)"
    assert growth <= RSS_GROWTH_MB, f"peak RSS grew {growth:.0f} MB"


def test_a_60_s_4k_clip_is_refused_from_its_metadata(server: Serve, clip_4k: bytes) -> None:
    """It cost 17 s of CPU to decode, and 300 s were allowed: now 413 before a frame is decoded."""
    cpu0 = cpu_s(server)
    r, seconds = post(server.url, {"input": [video_part(clip_4k)]})
    cpu = cpu_s(server) - cpu0
    error = assert_error(r, 413, "request_too_large")
    assert "costly to decode" in error["message"] and "3840x2160" in error["message"], error
    assert seconds < SECONDS and cpu < 1, f"{seconds:.1f} s, {cpu:.2f} s of CPU"


def test_a_150_s_clip_is_over_the_length_limit(server: Serve) -> None:
    clip = media.encode_video(150, 1, size=(48, 64))
    r, seconds = post(server.url, {"input": [video_part(clip)]})
    error = assert_error(r, 413, "request_too_large")
    assert "150 s, the limit is 120 s" in error["message"], error
    assert seconds < SECONDS, f"refused after {seconds:.1f} s"


@pytest.fixture(scope="module")
def permissive(tiny_bf16: Path) -> Iterator[Serve]:
    """The 4K clip allowed (so that decoding it takes seconds), requests given 1.5 s at most (its
    ~5 s of decoding CPU spreads over FFmpeg's threads: on 2 cores it finished inside 4 s once)."""
    args = ["--model", str(tiny_bf16), "--device", "cpu", "--log-level", "warning"]
    args += ["--max-video-decode-pixels", str(10**13), "--request-timeout-s", "1.5"]
    with Serve(args) as s:
        yield s.wait_ready(START_TIMEOUT_S)


def abandon(url: str, body: dict[str, Any], clients: int, after_s: float) -> None:
    """`clients` clients send `body` at once and hang up after `after_s` (a client read timeout)."""
    content = json.dumps(body).encode()

    def one() -> None:
        try:
            httpx.post(
                url + "/v1/embeddings",
                content=content,
                headers={"content-type": "application/json"},
                timeout=httpx.Timeout(after_s, connect=30),
            )
        except httpx.ReadTimeout:
            return
        raise AssertionError("the request was answered before its client gave up")

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)


def test_abandoned_videos_stop_decoding_and_count_as_dropped(permissive: Serve, clip_4k: bytes) -> None:
    url = permissive.url
    image = {"input": [image_part(SMALL_PNG)]}
    _, idle_s = post(url, image)  # the image's latency on an idle server
    dropped0 = metric(url, "eg2_dropped_items_total", stage="preprocessing")
    abandon(url, {"input": [video_part(clip_4k)]}, clients=4, after_s=0.3)
    cpu0 = cpu_s(permissive)
    r, behind_s = post(url, image)
    time.sleep(6)  # before: the two videos being decoded went on for ~5 s of CPU each
    cpu = cpu_s(permissive) - cpu0
    dropped = metric(url, "eg2_dropped_items_total", stage="preprocessing") - dropped0
    print(
        f"\n4 abandoned 4K clips: {cpu:.2f} s of server CPU in the 6 s after the hang-ups; an image "
        f"behind them {r.status_code} in {behind_s:.2f} s (idle: {idle_s:.2f} s); {dropped:g} items dropped"
    )
    assert r.status_code == 200, r.text[:300]
    assert cpu <= 2.5, f"{cpu:.1f} s of CPU after the hang-ups: decoding went on"
    assert behind_s <= idle_s + 3, f"the image behind them took {behind_s:.1f} s (idle {idle_s:.1f} s)"
    assert dropped == 4, dropped
    assert metric(url, "eg2_admitted_items") == 0


def test_a_timed_out_request_stops_decoding(permissive: Serve, clip_4k: bytes) -> None:
    """request_timeout_s 1.5: the client gets its 503, and the decoding stops with it."""
    r, seconds = post(permissive.url, {"input": [video_part(clip_4k)]})
    assert "timed out" in assert_error(r, 503, "unavailable")["message"]
    assert seconds < 1.5 + SECONDS, seconds
    cpu0 = cpu_s(permissive)
    time.sleep(8)  # before: the decoding went on for its remaining seconds of CPU
    cpu = cpu_s(permissive) - cpu0
    print(f"\ntimed out after {seconds:.1f} s; {cpu:.2f} s of server CPU in the 8 s after")
    assert cpu <= 0.6, f"{cpu:.2f} s of CPU in the 8 s after the timeout: decoding went on"


# --- the smaller findings ----------------------------------------------------------------------------


def vectors(r: httpx.Response) -> np.ndarray:
    return np.asarray([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def test_data_uri_scheme_and_type_are_case_insensitive(server: Serve) -> None:
    """RFC 2397: `DATA:IMAGE/PNG;BASE64,` is the same URI as `data:image/png;base64,`."""
    payload = base64.b64encode(SMALL_PNG).decode()
    lower, _ = post(
        server.url,
        {"input": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{payload}"}}]},
    )
    upper, _ = post(
        server.url,
        {"input": [{"type": "image_url", "image_url": {"url": f"DATA:IMAGE/PNG;BASE64,{payload}"}}]},
    )
    assert lower.status_code == 200 and upper.status_code == 200, upper.text[:300]
    np.testing.assert_array_equal(vectors(upper), vectors(lower))


@pytest.mark.parametrize(
    ("field", "value"),
    [("dimensions", "256"), ("dimensions", 256.0), ("truncate", "false"), ("image_tokens", "280")],
)
def test_request_fields_are_strictly_typed(server: Serve, field: str, value: Any) -> None:
    """OpenAI's API refuses `"dimensions": "256"`; it was silently read as 256."""
    r, _ = post(server.url, {"input": "x", field: value})
    assert_error(r, 400, "invalid_request_error", field)


def test_media_counts_are_limited_before_decoding(server: Serve) -> None:
    s = Settings()
    r, _ = post(server.url, {"input": [image_part(PIXEL_PNG)] * (s.max_request_media + 1)})
    assert "max_request_media" in assert_error(r, 413, "request_too_large", "input")["message"]
    r, _ = post(
        server.url, {"input": [{"content": [{"type": "text", "text": "x"}] * (s.max_item_parts + 1)}]}
    )
    assert "max_item_parts" in assert_error(r, 413, "request_too_large", "input[0].content")["message"]


def test_readme_states_the_audio_limits_the_server_applies() -> None:
    """The README promised "any rate and channels" (docs/API.md "any sample rate and channel count");
    1-32 channels at 1-384 kHz are accepted."""
    s = Settings()
    readme = next(x for x in (REPO / "README.md").read_text().splitlines() if x.startswith("# audio ("))
    api = " ".join((REPO / "docs" / "API.md").read_text().split())  # its sentences wrap
    for text in (readme, api):
        assert "any rate" not in text and "any sample rate" not in text, text[:200]
        assert (
            f"1 to {s.max_audio_channels} channels at {s.min_audio_rate // 1000} to {s.max_audio_rate // 1000} kHz"
            in text
        )


def test_the_largest_image_stays_within_the_request_bound(server: Serve) -> None:
    """One 1,120-token image (1280 x 960, 10,080 patch slots with padding) stays within the bound too:
    its key mask broadcasts over the queries (layers.key_padding_mask), no (S, S) mask is built."""
    png = media.encode_image(media.picture(960, 1280), "PNG")
    body = {"input": [image_part(png)], "image_tokens": 1120}
    (r, seconds), growth = peak_growth_mb(server, lambda: post(server.url, body))
    assert r.status_code == 200, r.text[:300]
    print(f"\n1,120-token image: 200 in {seconds:.1f} s, peak RSS +{growth:.0f} MB")
    assert growth <= RSS_GROWTH_MB, f"peak RSS +{growth:.0f} MB for one image"
