"""Segments, embedding types and /tokenize (docs/API.md), end to end: the real engine on the tiny FP32
checkpoint behind a real uvicorn on loopback.

- a span of each kind is embedded as if it had been sent alone: the text `text[start:end]`, the audio
  samples of the span as a WAV of their own, the video's frames inside the span;
- media run past the single-item limits up to the segment limits, and past those get 413 before any
  decoding (the preprocessing histogram does not move);
- each embedding type is the float vector of the same request, converted as documented;
- /tokenize counts what /v1/embeddings reports in `usage`, for every modality.
"""

from __future__ import annotations

import base64
import io
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
from prometheus_client.parser import text_string_to_metric_families

from eg2_runtime.inputs import MediaLimits
from eg2_runtime.preprocess import audio as audio_pre
from tests.support import media
from tests.support.fake_engine import (
    LiveServer,
    assert_error,
    audio_part,
    image_part,
    live,
    make_settings,
    video_part,
)

TOL = 1e-5  # FP32 on the CPU: a span in a batch of spans against the span alone
RATE = 16_000
SECONDS = 5.0  # the most a refusal before decoding may take on a busy 2-core CPU
TEXT = " ".join(f"word{i} and some more text, sentence {i}." for i in range(40))
NOISE = media.noise(35.0, RATE, seed=3)[:, 0]  # 35 s: past the 30 s one audio item may have


@pytest.fixture(scope="module")
def server(tiny_fp32: Path) -> Iterator[LiveServer]:
    from eg2_runtime.engine import Engine

    settings = make_settings(
        max_video_seconds=32,  # warm-up sends a 32 s clip; 40 s is over the single-item limit
        max_segment_video_seconds=60,
        max_segment_audio_seconds=1800,
        max_request_segments=64,
        max_batch_tokens=8192,
        max_request_bytes=8 << 20,
        request_timeout_s=120,
    )
    engine = Engine.from_dir(tiny_fp32, device="cpu", limits=settings.media_limits())
    with live(settings, engine, ready_timeout=180) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def embed(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text[:500]
    return dict(r.json())


def vec(row: dict[str, Any]) -> np.ndarray:
    return np.asarray(row["embedding"], dtype=np.float32)


def wav(samples: np.ndarray) -> bytes:
    """16-bit 16 kHz mono WAV: its samples decode to exactly those of any slice written alike."""
    buf = io.BytesIO()
    sf.write(buf, samples, RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    err = float(np.abs(got - want).max())
    assert err <= TOL, f"{what}: max |diff| {err:.2e} > {TOL:g}"


# --- segments --------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [0.0, 0.25])
def test_a_text_segment_equals_its_span_sent_alone(client: httpx.Client, overlap: float) -> None:
    body = {"prompt_name": "query", "segments": {"tokens": 64, "overlap": overlap}}
    row = embed(client, input=[TEXT], **body)["data"][0]
    spans = [(s["start"], s["end"]) for s in row["segments"]]
    assert spans[0][0] == 0 and spans[-1][1] == len(TEXT) and len(spans) > 10, spans
    for (a, b), (c, d) in itertools.pairwise(spans):
        assert a < c <= b <= d, (a, b, c, d)
        assert (c == b) == (overlap == 0), (a, b, c, d)  # overlap repeats text; none leaves no gap
    alone = embed(client, input=[TEXT[a:b] for a, b in spans], prompt_name="query")["data"]
    for i, (seg, one) in enumerate(zip(row["segments"], alone, strict=True)):
        assert_close(vec(seg), vec(one), f"text span {i} {spans[i]}")
    assert_close(vec(row), vec(embed(client, input=[TEXT], prompt_name="query")["data"][0]), "the item")
    counted = client.post(
        "/tokenize", json={"input": ["", *(TEXT[a:b] for a, b in spans)], "prompt_name": "query"}
    )
    empty, *each = [d["tokens"] for d in counted.json()["data"]]  # BOS, the prompt, EOS
    assert max(each) - empty == 64, f"spans hold at most 64 text tokens: {each} over {empty}"


def test_an_audio_segment_equals_its_span_sent_alone_as_wav(client: httpx.Client) -> None:
    """35 s: past the 30 s of one item. Spans of 10 s: [0, 10) [10, 20) [20, 30) [30, 35)."""
    row = embed(client, input=[audio_part(wav(NOISE))], segments={"seconds": 10})["data"][0]
    spans = [(s["start"], s["end"]) for s in row["segments"]]
    assert spans == [(0.0, 10.0), (10.0, 20.0), (20.0, 30.0), (30.0, 35.0)], spans
    alone = embed(client, input=[audio_part(wav(NOISE[round(a * RATE) : round(b * RATE)])) for a, b in spans])
    for i, (seg, one) in enumerate(zip(row["segments"], alone["data"], strict=True)):
        assert_close(vec(seg), vec(one), f"audio span {i} {spans[i]}")
    # The item itself is as without segments: its first 30 s.
    assert_close(vec(row), vec(embed(client, input=[audio_part(wav(NOISE))])["data"][0]), "the item")


def metric(url: str, name: str, modality: str) -> float:
    """A /metrics sample's value for `modality`, 0 when absent."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and s.labels.get("modality") == modality
    )


def test_a_long_file_fills_gpu_batches(server: LiveServer, client: httpx.Client) -> None:
    """70 s in 10 s spans: 7 spans and the item itself, decoded in one pass and gathered into steps
    of up to STREAM_STEP_SPANS spans, reach the GPU in at most 2 batches, through the real engine.
    (Whether single-span steps would batch here depends on timing: the guard is in test_app_batcher.)"""
    signal = np.tile(NOISE, 2)[: 70 * RATE]
    batches = lambda: metric(server.url, "eg2_batch_size_count", "audio")  # noqa: E731
    items = lambda: metric(server.url, "eg2_batch_size_sum", "audio")  # noqa: E731
    batches_before, items_before = batches(), items()
    row = embed(client, input=[audio_part(wav(signal))], segments={"seconds": 10})["data"][0]
    assert len(row["segments"]) == 7
    ran, held = batches() - batches_before, items() - items_before
    assert held == 8 and ran <= 2, f"{held:.0f} items in {ran:.0f} GPU batches"


def test_video_segments_have_the_right_count_and_offsets(client: httpx.Client) -> None:
    """A 40 s clip, over the 32 s one item may have here: 413 alone, 200 with segments."""
    clip = media.encode_video(40, 2, size=(48, 64))
    r = client.post("/v1/embeddings", json={"input": [video_part(clip)]})
    assert "40 s, the limit is 32 s" in assert_error(r, 413, "request_too_large")["message"]
    row = embed(client, input=[video_part(clip)], segments={"seconds": 15})["data"][0]
    assert [(s["start"], s["end"]) for s in row["segments"]] == [(0, 15), (15, 30), (30, 40)]
    row = embed(client, input=[video_part(clip)], segments={"seconds": 10, "overlap": 0.4})["data"][0]
    starts = [s["start"] for s in row["segments"]]
    assert starts == [0, 6, 12, 18, 24, 30] and row["segments"][-1]["end"] == 40, row["segments"]
    assert all(s["end"] - s["start"] == 10 for s in row["segments"])
    # A span as long as the clip is the clip: sent alone, the same frames, the same vector.
    short = media.encode_video(9, 2, size=(48, 64))
    row = embed(client, input=[video_part(short)], segments={"seconds": 10})["data"][0]
    assert [(s["start"], s["end"]) for s in row["segments"]] == [(0, 9)]
    assert_close(vec(row["segments"][0]), vec(row), "a span holding the whole clip")


def test_segments_apply_to_single_items_only(client: httpx.Client) -> None:
    """Interleaved content and images get no segments; a unit that does not fit the item's kind none."""
    png = media.encode_image(media.picture(32, 32), "PNG")
    body = {
        "input": ["some text", image_part(png), {"content": [{"type": "text", "text": "x"}]}],
        "segments": {"seconds": 10},
    }
    data = embed(client, **body)["data"]
    assert all("segments" not in d for d in data), data[0].keys()


# --- limits, before decoding ----------------------------------------------------------------------


def preprocess_count(url: str, modality: str) -> float:
    return metric(url, "eg2_preprocess_seconds_count", modality)


def refused_before_decoding(
    server: LiveServer, client: httpx.Client, body: dict[str, Any], modality: str
) -> str:
    before = preprocess_count(server.url, modality)
    start = time.monotonic()
    r = client.post("/v1/embeddings", json=body)
    seconds = time.monotonic() - start
    error = assert_error(r, 413, "request_too_large")
    assert seconds < SECONDS, f"refused after {seconds:.1f} s"
    assert preprocess_count(server.url, modality) == before, "the file was decoded before the refusal"
    return str(error["message"])


def test_an_hour_of_audio_is_refused_past_the_segment_limit_before_decoding(
    server: LiveServer, client: httpx.Client
) -> None:
    """A real, decodable hour (FLAC of silence, 89 kB): over max_segment_audio_seconds (1800 here), and
    in 10 s spans over max_request_segments (64 here)."""
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", samplerate=8000, channels=1, format="FLAC", subtype="PCM_16") as f:
        for _ in range(60):
            f.write(np.zeros(8000 * 60, dtype=np.int16))
    hour = buf.getvalue()
    message = refused_before_decoding(
        server, client, {"input": [audio_part(hour, "flac")], "segments": {"seconds": 10}}, "audio"
    )
    assert "3600 s long" in message and "max_segment_audio_seconds" in message, message
    minutes = media.encode_audio(np.zeros((8000 * 700, 1), np.float32), 8000, "flac")  # 700 s
    message = refused_before_decoding(
        server, client, {"input": [audio_part(minutes, "flac")], "segments": {"seconds": 10}}, "audio"
    )
    assert "70 segments" in message and "max_request_segments" in message, message
    # Without segments an hour is one item of its first 30 s: accepted.
    r = client.post("/tokenize", json={"input": [audio_part(hour, "flac")]})
    assert r.status_code == 200 and r.json()["data"][0]["truncated"] is True, r.text[:300]


def test_a_long_video_is_refused_past_the_segment_limit_before_decoding(
    server: LiveServer, client: httpx.Client
) -> None:
    """A real 100 s clip (one 2 s clip muxed 50 times), over max_segment_video_seconds (60 here)."""
    clip = media.repeated_clip(media.encode_video(2, 2, size=(48, 64)), 50)
    body = {"input": [video_part(clip)], "segments": {"seconds": 10}}
    message = refused_before_decoding(server, client, body, "video")
    assert "100 s, the limit is 60 s" in message, message


def test_audio_streams_through_the_file_a_span_at_a_time() -> None:
    """Decoding 5 minutes (19 MB as float32) holds one span and the first 30 s, not the file: the
    Python heap's peak while all spans are cut stays far below the signal's size."""
    import tracemalloc

    minutes = wav(media.noise(300.0, RATE, seed=1)[:, 0])
    limits = MediaLimits.unbounded()
    tracemalloc.start()
    try:
        spans = 0
        for clip in audio_pre.stream_clips(minutes, seconds=10, overlap=0.0, limits=limits):
            spans += not clip.whole
            del clip
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    signal = 300 * RATE * 4
    assert spans == 30
    assert peak < signal / 3, f"peak {peak / 1e6:.1f} MB while decoding a {signal / 1e6:.1f} MB signal"


# --- embedding types ------------------------------------------------------------------------------


@pytest.mark.parametrize("dimensions", [None, 256])
def test_binary_and_ubinary_equal_quantize_embeddings(client: httpx.Client, dimensions: int | None) -> None:
    from sentence_transformers.util.quantization import quantize_embeddings

    texts = ["the quick brown fox", "jumps over the lazy dog", "x"]
    extra = {} if dimensions is None else {"dimensions": dimensions}
    floats = np.stack([vec(d) for d in embed(client, input=texts, **extra)["data"]])
    for precision, dtype in (("binary", np.int8), ("ubinary", np.uint8)):
        want = quantize_embeddings(floats, precision=precision)
        as_json = embed(client, input=texts, embedding_type=precision, **extra)["data"]
        got = np.asarray([d["embedding"] for d in as_json], dtype=dtype)
        np.testing.assert_array_equal(got, want, err_msg=precision)
        as_b64 = embed(client, input=texts, embedding_type=precision, encoding_format="base64", **extra)
        raw = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype) for d in as_b64["data"]])
        np.testing.assert_array_equal(raw, want, err_msg=f"{precision} base64")


def test_int8_dequantizes_within_its_scale(client: httpx.Client) -> None:
    body = {"input": ["the quick brown fox", "a"], "segments": {"tokens": 64}}
    floats = embed(client, **body)["data"]
    ints = embed(client, embedding_type="int8", **body)["data"]
    b64 = embed(client, embedding_type="int8", encoding_format="base64", **body)["data"]
    rows = [(f, i, b) for f, i, b in zip(floats, ints, b64, strict=True)]
    rows += [
        (f, i, b)
        for x, y, z in rows
        for f, i, b in zip(x["segments"], y["segments"], z["segments"], strict=True)
    ]
    for f, i, b in rows:
        q = np.asarray(i["embedding"])
        assert q.dtype.kind == "i" and np.abs(q).max() == 127, q
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(b["embedding"]), np.int8), q)
        err = np.abs(q * i["scale"] - vec(f)).max()
        assert err <= 1 / 127 and err <= i["scale"] / 2 + 1e-7, (err, i["scale"])


def test_float16_is_the_float_vector_in_half_precision(client: httpx.Client) -> None:
    floats = embed(client, input=["hello"], dimensions=128)["data"][0]
    half = embed(client, input=["hello"], dimensions=128, embedding_type="float16", encoding_format="base64")
    got = np.frombuffer(base64.b64decode(half["data"][0]["embedding"]), "<f2")
    np.testing.assert_array_equal(got, vec(floats).astype(np.float16))


# --- /tokenize -------------------------------------------------------------------------------------


def test_tokenize_counts_equal_the_usage_of_the_same_request(client: httpx.Client) -> None:
    png = media.encode_image(media.picture(40, 60), "PNG")
    clip = media.encode_video(3, 2, size=(48, 64))
    cases: dict[str, dict[str, Any]] = {
        "text": {"input": ["hello world", TEXT * 30], "prompt_name": "document"},
        "image": {"input": [image_part(png)], "image_tokens": 70},
        "audio": {"input": [audio_part(wav(NOISE))]},
        "video": {"input": [video_part(clip)]},
        "content": {
            "input": [
                {"content": [{"type": "text", "text": "a"}, image_part(png), audio_part(wav(NOISE[:RATE]))]}
            ]
        },
        "messages": {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "b"}, video_part(clip)]}]
        },
        "segments": {
            "input": [TEXT, audio_part(wav(NOISE)), video_part(clip)],
            "segments": {"tokens": 100, "seconds": 2, "overlap": 0.25},
        },
    }
    for name, body in cases.items():
        counted = client.post("/tokenize", json=body)
        assert counted.status_code == 200, (name, counted.text[:300])
        # Each item alone: its usage is its count.
        alone = [{**body, "input": [x]} for x in body["input"]] if "input" in body else [body]
        for d, one in zip(counted.json()["data"], alone, strict=True):
            used = embed(client, **one)["usage"]
            assert d["tokens"] == used["prompt_tokens"], (name, d["tokens"], used)
        assert counted.json()["usage"] == embed(client, **body)["usage"], name
    data = client.post("/tokenize", json=cases["text"]).json()["data"]
    assert data[0]["ids"][0] == 2 and data[0]["ids"][-1] == 1 and len(data[0]["ids"]) == data[0]["tokens"]
    assert data[1]["truncated"] is True and data[0]["truncated"] is False
    data = client.post("/tokenize", json=cases["content"]).json()["data"]
    assert [p["type"] for p in data[0]["parts"]] == ["image_url", "input_audio"], data
    data = client.post("/tokenize", json=cases["segments"]).json()["data"]
    assert all(len(d["segments"]) > 1 for d in data), data


def test_eg2_embed_writes_segments_as_json_lines(
    tiny_fp32: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], client: httpx.Client
) -> None:
    import json

    from eg2_runtime.inputs import Segments
    from eg2_runtime.tools.embed import embed_cli

    path = tmp_path / "clip.wav"
    path.write_bytes(wav(NOISE[: 25 * RATE]))
    assert embed_cli(tiny_fp32, [str(path)], as_json=True, device="cpu", segments=Segments(seconds=10)) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x.get("start"), x.get("end")) for x in lines] == [(0, 10), (10, 20), (20, 25), (None, None)]
    served = embed(client, input=[audio_part(path.read_bytes())], segments={"seconds": 10})["data"][0]
    for line, seg in zip(lines, [*served["segments"], served], strict=True):
        assert_close(np.asarray(line["embedding"], np.float32), vec(seg), "eg2 embed against the server")


def test_text_spans_move_on_past_characters_of_several_tokens(tiny_fp32: Path) -> None:
    """'𐍈' is 4 byte-fallback tokens sharing one character's offsets: a cut can only fall between
    characters, so a span of 3 tokens holds one whole character, and the spans still cover the text."""
    from eg2_runtime.preprocess import Preprocessor

    pre = Preprocessor.from_dir(tiny_fp32)
    text = "ab𐍈𐍈c𐍈"
    spans = pre._text_spans(text, 3, 0.0)
    assert spans == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)], spans
    assert pre._text_spans(text, 3, 0.4)[-1][1] == len(text)
