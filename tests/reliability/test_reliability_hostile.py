"""Hostile input against the real engine on the tiny checkpoint, under a real uvicorn on loopback.

Decompression bombs and media whose headers lie, sent through HTTP: each is refused with its documented
status within seconds. Hostile JSON: absurd nesting, numbers, encodings, and huge values that error
messages must not echo back. No remote or file URL is ever fetched by default. Bad requests running
at the same moment as good ones leave the good ones' vectors exact. A bounded, derandomized hypothesis
fuzz over request bodies, mutated media and raw bytes never gets a 5xx.

Decoder-level hostile files are tests/preprocess/test_preprocess_hostile.py and test_preprocess_fuzz.py; the
contract's error rows with real media (bad base64, wrong MIME, NaN audio, token ids, file:// ...) are
tests/service/test_app_real_engine.py; raw-socket cases (413 before the body, slowloris, lying
Content-Length) are tests/service/test_app_security.py. the README reliability table lists them all.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from eg2_runtime import samples
from eg2_runtime.engine import Engine
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
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

SECONDS = 5.0  # the most any single hostile request may take on a busy 2-core CPU
ATOL = 1e-5
FUZZ = settings(
    max_examples=300,
    derandomize=True,  # the same cases on every run: CI must not flake on a new random seed
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

PICTURE = media.picture(48, 64)
PNG = media.encode_image(PICTURE, "PNG")
JPEG = media.encode_image(PICTURE, "JPEG")
WAV = media.encode_audio(media.sine(0.5, 16_000), 16_000, "wav")
FLAC = media.encode_audio(media.sine(0.5, 22_050), 22_050, "flac")
MP4 = media.encode_video(2, 4, size=(48, 64), fmt="mp4")
MKV = media.encode_video(2, 4, size=(48, 64), fmt="mkv")


@pytest.fixture(scope="module")
def engine(tiny_bf16: Path) -> Engine:
    """In-process reference, used from the test thread (the server's engine has its own GPU thread)."""
    return Engine.from_dir(tiny_bf16, device="cpu")


@pytest.fixture(scope="module")
def server(tiny_bf16: Path) -> Iterator[LiveServer]:
    settings_ = make_settings(
        max_request_bytes=4 << 20, max_request_items=2048, max_batch_tokens=2048, body_read_timeout_s=2.0
    )
    engine = Engine.from_dir(tiny_bf16, device="cpu", limits=settings_.media_limits())
    with live(settings_, engine, ready_timeout=120) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def post(client: httpx.Client, body: Any) -> tuple[httpx.Response, float]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    start = time.monotonic()
    r = client.post("/v1/embeddings", content=content, headers={"content-type": "application/json"})
    return r, time.monotonic() - start


def vectors(response: httpx.Response) -> np.ndarray:
    return np.asarray([d["embedding"] for d in response.json()["data"]], dtype=np.float32)


# --- bombs and liars -----------------------------------------------------------------------------

EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"  # Pillow would run Ghostscript
HOSTILE_MEDIA: list[tuple[str, dict[str, Any], int, str]] = [
    # (id, content part, status, a word of the message)
    ("png-zip-bomb-400-megapixels", image_part(media.png_bomb(20_000, 20_000)), 413, "too large"),
    ("png-header-claims-100k-x-100k", image_part(media.png_header_only(100_000, 100_000)), 413, "too large"),
    ("png-header-claims-7000-x-7000", image_part(media.png_header_only(7_000, 7_000)), 413, "7000x7000"),
    ("png-text-chunk-bomb", image_part(media.png_text_bomb(PICTURE)), 400, "too large"),
    ("jpeg-scan-bomb", image_part(media.jpeg_scan_bomb(PICTURE, 200), "image/jpeg"), 413, "too many scans"),
    ("eps-sent-as-png", image_part(EPS), 400, ""),
    ("mp4-declares-a-million-frames", video_part(media.mp4_declaring_frames(MP4, 1_000_000)), 413, "1000000"),
    (
        "mkv-declares-28-hours",
        video_part(media.mkv_declaring_seconds(MKV, 100_000.0), "video/x-matroska"),
        413,
        "too long",
    ),
    (
        "wav-claims-100-MB",
        audio_part(media.wav_lying_length(media.sine(0.5, 16_000), 16_000, 100_000_000)),
        400,
        "truncated",
    ),
    (
        "flac-8-channels-384-kHz-31-s",  # 100 KB, 93 million samples to decode
        audio_part(media.silent_flac(31, 384_000, 8), "flac"),
        413,
        "too costly to decode",
    ),
    ("wav-claims-1-GHz", audio_part(media.wav_header(1_000_000_000, 1)), 400, "sample rate"),
    ("wav-claims-1000-channels", audio_part(media.wav_header(16_000, 1000)), 400, "channel"),
    (
        "wav-infinite-samples",
        audio_part(media.wav_float(np.full((16_000, 1), np.inf, np.float32), 16_000)),
        400,
        "infinite",
    ),
    (
        "wav-mixed-nan-samples",
        audio_part(
            media.wav_float(np.where(np.arange(16_000)[:, None] % 7, 0.1, np.nan).astype(np.float32), 16_000)
        ),
        400,
        "NaN",
    ),
    ("video-bytes-as-image", image_part(MP4), 400, ""),
    ("image-bytes-as-audio", audio_part(PNG), 400, ""),
    ("audio-bytes-as-video", video_part(WAV), 400, ""),
    ("truncated-flac", audio_part(FLAC[: len(FLAC) // 2], "flac"), 400, ""),
    ("jpeg-garbage-after-magic", image_part(media.garbage_after_magic(JPEG), "image/jpeg"), 400, ""),
    ("random-bytes-as-video", video_part(np.random.default_rng(0).bytes(30_000)), 400, ""),
]


@pytest.mark.parametrize(("case", "part", "status", "word"), HOSTILE_MEDIA, ids=[c[0] for c in HOSTILE_MEDIA])
def test_hostile_media_is_refused_quickly(
    client: httpx.Client, case: str, part: dict[str, Any], status: int, word: str
) -> None:
    r, seconds = post(client, {"input": ["a good item beside it", part]})
    error = assert_error(r, status, "request_too_large" if status == 413 else "invalid_request_error")
    assert word.lower() in error["message"].lower(), error
    assert error["param"].startswith("input[1]"), error  # the item, not the whole input
    assert seconds < SECONDS, f"{case} took {seconds:.1f} s"


def test_server_is_healthy_after_the_bombs(client: httpx.Client, engine: Engine) -> None:
    assert client.get("/health").status_code == 200
    r, _ = post(client, {"input": [image_part(PNG)]})
    want = engine.embed([engine.prepare(Item((MediaPart("image", PNG),)), PrepareOptions())])
    np.testing.assert_allclose(vectors(r), want, atol=ATOL)


def test_mime_is_a_hint_the_bytes_decide(client: httpx.Client) -> None:
    """A PNG labelled image/jpeg is still a PNG: same vector as labelled right (the decoder sniffs)."""
    right, _ = post(client, {"input": [image_part(PNG, "image/png")]})
    wrong, _ = post(client, {"input": [image_part(PNG, "image/jpeg")]})
    np.testing.assert_array_equal(vectors(right), vectors(wrong))


# --- URLs are never fetched by default ------------------------------------------------------------


def test_remote_and_file_urls_are_refused_without_a_fetch(client: httpx.Client) -> None:
    """A listener on loopback stands in for an internal service (SSRF): it must never see a connection."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.3)
        port = listener.getsockname()[1]
        urls = [
            f"http://127.0.0.1:{port}/internal.png",
            f"https://127.0.0.1:{port}/internal.png",
            f"HTTP://localhost:{port}/internal.png",
            "file:///etc/passwd",
            "file://localhost/etc/hostname",
            "/etc/passwd",
            "../../etc/passwd",
            f"ftp://127.0.0.1:{port}/x.png",
        ]
        for url in urls:
            for part in (
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "video_url", "video_url": {"url": url}},
            ):
                r, _ = post(client, {"input": [part]})
                error = assert_error(r, 400, "invalid_request_error")
                assert "passwd" not in error["message"] and "root:" not in r.text
        with contextlib.suppress(TimeoutError):
            conn, _ = listener.accept()
            conn.close()
            pytest.fail("the server connected to a URL a client named")


# --- hostile JSON ---------------------------------------------------------------------------------

HOSTILE_JSON: list[tuple[str, bytes, int]] = [
    ("nesting-100k-deep", b'{"input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    (
        "nesting-in-an-object-value",
        b'{"input": "x", "user": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}",
        400,
    ),
    ("number-1e999999", b'{"input": "x", "dimensions": 1e999999}', 400),
    ("integer-5000-digits", b'{"input": "x", "dimensions": 1' + b"0" * 5000 + b"}", 400),
    ("nan-literal", b'{"input": "x", "dimensions": NaN}', 400),
    ("lone-surrogate", b'{"input": "a\\ud800"}', 400),
    ("overlong-utf8", b'{"input": "\xc0\xaf"}', 400),
    ("utf16-body", '{"input": "x"}'.encode("utf-16"), 400),
    ("bom-prefixed", b'\xef\xbb\xbf{"input": "x"}', 400),
    ("trailing-garbage", b'{"input": "x"} {"input": "y"}', 400),
    ("empty-body", b"", 400),
    ("null-body", b"null", 400),
    ("nul-characters-in-text", b'{"input": "a\\u0000b"}', 200),
    ("duplicate-keys-last-wins", b'{"input": "x", "input": ["a", "b"]}', 200),
    ("control-characters", b'{"input": "\\u0001\\u0002\\u001f\\u007f"}', 200),
]


@pytest.mark.parametrize(("case", "body", "status"), HOSTILE_JSON, ids=[c[0] for c in HOSTILE_JSON])
def test_hostile_json(client: httpx.Client, case: str, body: bytes, status: int) -> None:
    r, seconds = post(client, body)
    if status == 200:
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == (2 if case == "duplicate-keys-last-wins" else 1)
    else:
        assert_error(r, status, "invalid_request_error")
    assert seconds < SECONDS


HUGE = "A" * 500_000
ECHO_CASES: list[tuple[str, dict[str, Any], int]] = [
    ("model", {"input": "x", "model": HUGE}, 404),
    ("prompt-name", {"input": "x", "prompt_name": HUGE}, 400),
    (
        "image-mime",
        {"input": [{"type": "image_url", "image_url": {"url": f"data:image/{HUGE};base64,AAAA"}}]},
        400,
    ),
    (
        "audio-format",
        {"input": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": HUGE}}]},
        400,
    ),
    ("unknown-field", {"input": "x", HUGE: 1}, 400),
    ("encoding", {"input": "x", "encoding_format": HUGE}, 400),
    ("item-shape", {"input": [{"type": HUGE}]}, 400),
]


@pytest.mark.parametrize(("case", "body", "status"), ECHO_CASES, ids=[c[0] for c in ECHO_CASES])
def test_errors_do_not_echo_what_was_sent(
    client: httpx.Client, case: str, body: dict[str, Any], status: int
) -> None:
    """Half a megabyte in one field: the error names the field, and its answer stays under 1 KB."""
    r, _ = post(client, body)
    assert r.status_code == status, r.text[:300]
    assert len(r.content) < 1024, f"{len(r.content)} bytes of answer: the value was echoed"
    assert "A" * 100 not in r.text


def test_unknown_path_is_not_echoed(client: httpx.Client) -> None:
    r = client.get("/" + "p" * 8000)
    assert_error(r, 404, "invalid_request_error")
    assert len(r.content) < 1024


# --- big but legal --------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_largest_legal_request(client: httpx.Client, engine: Engine) -> None:
    """max_request_items (2048) texts in one request: all answered, in order, with the right vectors."""
    texts = [f"item {i}" for i in range(2048)]
    r, seconds = post(client, {"input": texts, "encoding_format": "base64"})
    assert r.status_code == 200, r.text[:300]
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(2048))
    for i in (0, 1, 777, 2047):
        got = np.frombuffer(base64.b64decode(data[i]["embedding"]), "<f4")
        want = engine.embed([engine.prepare(Item((TextPart(texts[i]),)), PrepareOptions())])[0]
        np.testing.assert_allclose(got, want, atol=ATOL, err_msg=f"item {i}")
    print(f"\n2048 items in {seconds:.1f} s")
    r, _ = post(client, {"input": [*texts, "one too many"]})
    assert "2049" in assert_error(r, 413, "request_too_large", "input")["message"]


# --- bad requests beside good ones ----------------------------------------------------------------


def test_bad_requests_running_beside_good_ones_leave_them_exact(server: LiveServer, engine: Engine) -> None:
    """16 good requests (text, image, audio, interleaved) and 12 hostile ones, all at once, twice: every
    good one gets exactly its in-process vectors; every hostile one its own 4xx."""
    png, wav = samples.png(64, 48, seed=3), samples.wav(0.5)
    good: list[tuple[dict[str, Any], list[Item]]] = []
    for i in range(16):
        kind = i % 4
        if kind == 0:
            good.append(
                (
                    {"input": [f"good text {i}", f"and another {i}"]},
                    [Item((TextPart(f"good text {i}"),)), Item((TextPart(f"and another {i}"),))],
                )
            )
        elif kind == 1:
            good.append(({"input": [image_part(png)]}, [Item((MediaPart("image", png),))]))
        elif kind == 2:
            good.append(({"input": [audio_part(wav)]}, [Item((MediaPart("audio", wav),))]))
        else:
            content = {"content": [{"type": "text", "text": f"look {i}"}, image_part(png)]}
            good.append(({"input": [content]}, [Item((TextPart(f"look {i}"), MediaPart("image", png)))]))
    bad = [
        ({"input": [f"fine {i}", part]}, status) for i, (_, part, status, _) in enumerate(HOSTILE_MEDIA[:12])
    ]
    want = [
        np.stack([engine.embed([engine.prepare(item, PrepareOptions())])[0] for item in items])
        for _, items in good
    ]
    bodies: list[tuple[dict[str, Any], Any]] = [(b, ("good", i)) for i, (b, _) in enumerate(good)]
    bodies += [(b, ("bad", status)) for b, status in bad]
    for _ in range(2):
        results: list[tuple[Any, httpx.Response | BaseException]] = []

        def send(body: dict[str, Any], tag: Any, results: list[Any] = results) -> None:
            try:
                results.append((tag, httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)))
            except httpx.HTTPError as exc:
                results.append((tag, exc))

        threads = [threading.Thread(target=send, args=pair) for pair in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(results) == len(bodies)
        for (kind, value), r in results:
            assert isinstance(r, httpx.Response), r
            if kind == "good":
                assert r.status_code == 200, r.text[:300]
                np.testing.assert_allclose(vectors(r), want[value], atol=ATOL)
            else:
                assert r.status_code == value, r.text[:300]


# --- fuzz -----------------------------------------------------------------------------------------

FIELDS = (
    "model",
    "input",
    "messages",
    "encoding_format",
    "dimensions",
    "prompt_name",
    "prompt",
    "truncate",
    "image_tokens",
    "user",
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=24)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=16,
)
SMALL_MEDIA = {"image": [PNG, JPEG, media.encode_image(PICTURE, "GIF")], "audio": [WAV, FLAC], "video": [MP4]}


@st.composite
def mutated(draw: st.DrawFn, kind: str) -> bytes:
    """A valid small file of `kind`, then a few flipped bytes, a cut, or an inserted run."""
    data = bytearray(draw(st.sampled_from(SMALL_MEDIA[kind])))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(("flip", "cut", "insert", "zero-run")))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if not data:
            data = bytearray(draw(st.binary(min_size=1, max_size=64)))
        elif op == "flip":
            data[at] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=64))
        else:
            data[at : at + draw(st.integers(1, 256))] = b"\x00" * 8
    return bytes(data)


def media_part(kind: str, data: bytes) -> dict[str, Any]:
    if kind == "image":
        return image_part(data)
    if kind == "audio":
        return audio_part(data)
    return video_part(data)


def valid_part() -> st.SearchStrategy[dict[str, Any]]:
    kinds = st.sampled_from(sorted(SMALL_MEDIA))
    return st.one_of(
        st.text(max_size=40).map(lambda t: {"type": "text", "text": t}),
        kinds.flatmap(lambda k: st.sampled_from(SMALL_MEDIA[k]).map(lambda d: media_part(k, d))),
        kinds.flatmap(lambda k: mutated(k).map(lambda d: media_part(k, d))),
    )


PARTS = valid_part() | JSON_VALUES
ITEMS = st.one_of(
    st.text(max_size=40),
    valid_part(),
    st.lists(valid_part(), min_size=1, max_size=3).map(lambda ps: {"content": ps}),
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant"]),
            "content": st.text(max_size=20) | st.lists(valid_part(), min_size=1, max_size=2),
        }
    ),
    min_size=1,
    max_size=2,
)
VALID_FIELDS = {
    "model": st.just("eg2"),
    "encoding_format": st.sampled_from(["float", "base64"]),
    "dimensions": st.sampled_from([128, 256, 512, 768]),
    "prompt_name": st.sampled_from(["query", "document"]),
    "prompt": st.text(max_size=20),
    "truncate": st.booleans(),
    "image_tokens": st.sampled_from([70, 140, 280]),
    "user": st.text(max_size=10),
}
ANY_FIELDS = {
    "model": st.sampled_from(["eg2", "other"]) | JSON_VALUES,
    "input": st.text(max_size=40) | st.lists(ITEMS | JSON_VALUES, max_size=5) | JSON_VALUES,
    "messages": MESSAGES
    | st.lists(st.fixed_dictionaries({"role": JSON_VALUES, "content": PARTS}), max_size=2)
    | JSON_VALUES,
    "encoding_format": st.sampled_from(["float", "base64", "hex"]) | JSON_VALUES,
    "dimensions": st.sampled_from([128, 256, 512, 768, 0, -1, 300]) | JSON_VALUES,
    "prompt_name": st.sampled_from(["query", "document", "nope"]) | JSON_VALUES,
    "prompt": st.text(max_size=20) | JSON_VALUES,
    "truncate": st.booleans() | JSON_VALUES,
    "image_tokens": st.sampled_from([70, 140, 280, 560, 1120, 100]) | JSON_VALUES,
    "user": st.text(max_size=10) | JSON_VALUES,
}
WELL_FORMED = st.fixed_dictionaries(
    {"input": st.text(max_size=40) | st.lists(ITEMS, min_size=1, max_size=4)}, optional=VALID_FIELDS
)
BODIES = st.one_of(
    WELL_FORMED,  # most reach the engine: media decode, batching, pooling, encoding
    WELL_FORMED,
    st.fixed_dictionaries({"messages": MESSAGES}, optional=VALID_FIELDS),
    st.fixed_dictionaries({}, optional=ANY_FIELDS),  # request-shaped, any field possibly wrong
    JSON_VALUES,  # not even an object
)


def check_answer(r: httpx.Response) -> None:
    """Any answer to any body: a documented status, the OpenAI error shape, or well-formed vectors."""
    assert r.status_code in (200, 400, 404, 413), (r.status_code, r.text[:300])
    event(f"status {r.status_code}")
    if r.status_code != 200:
        assert_error(
            r,
            r.status_code,
            {400: "invalid_request_error", 404: "model_not_found", 413: "request_too_large"}[r.status_code],
        )
        return
    body = r.json()
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
    for i, d in enumerate(body["data"]):
        assert d["index"] == i
        row = (
            np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
            if isinstance(d["embedding"], str)
            else np.asarray(d["embedding"])
        )
        assert row.shape[0] in (128, 256, 512, 768) and abs(float(np.linalg.norm(row)) - 1) < 1e-3


@pytest.mark.slow
@FUZZ
@given(body=BODIES)
def test_fuzz_request_bodies(client: httpx.Client, body: Any) -> None:
    r, seconds = post(client, body)
    check_answer(r)
    assert seconds < SECONDS


@pytest.mark.slow
@settings(FUZZ, max_examples=150)
@given(kind=st.sampled_from(sorted(SMALL_MEDIA)), data=st.data())
def test_fuzz_media_through_http(client: httpx.Client, kind: str, data: st.DataObject) -> None:
    part = media_part(kind, data.draw(mutated(kind)))
    r, seconds = post(client, {"input": [part]})
    check_answer(r)
    assert r.status_code != 404
    assert seconds < SECONDS


@settings(FUZZ, max_examples=100)
@given(raw=st.binary(max_size=512) | st.text(max_size=200).map(str.encode))
def test_fuzz_raw_bytes(client: httpx.Client, raw: bytes) -> None:
    r, _ = post(client, raw)
    check_answer(r)
