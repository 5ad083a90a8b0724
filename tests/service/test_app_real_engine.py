"""The HTTP contract against the REAL engine on the tiny checkpoint, under a real uvicorn on loopback.

tests/service/test_app_contract.py proves the contract's mechanics with the FakeEngine (and its injected
faults); this file proves the product: real media decoded, real model vectors equal to in-process
vectors, `usage` equal to the token counts of transformers' own processor, real bad media refused.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from eg2_runtime import samples
from eg2_runtime.api import matryoshka
from eg2_runtime.engine import Engine
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
from tests.service.test_app_contract import ERROR_CASES
from tests.support.fake_engine import (
    LiveServer,
    assert_error,
    audio_part,
    image_part,
    live,
    make_settings,
    video_part,
)
from tests.support.media import png_header_only

ATOL = 1e-5  # HTTP batches vs one-by-one in process: FP32 on the CPU
PNG, WAV, MP4 = samples.png(320, 240), samples.wav(2.0), samples.mp4(3)


@pytest.fixture(scope="module")
def engine(tiny_bf16: Path) -> Engine:
    """An in-process instance, used from the test thread (the server's engine has its own thread)."""
    return Engine.from_dir(tiny_bf16, device="cpu")


@pytest.fixture(scope="module", params=[0, 2], ids=["media-on-threads", "media-on-processes"])
def server(tiny_bf16: Path, request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """Every test here runs twice: media prepared on the server's threads, and on its worker processes."""
    settings = make_settings(
        max_request_items=64,
        max_request_bytes=2 << 20,
        max_batch_tokens=2048,
        preprocess_processes=request.param,
    )
    engine = Engine.from_dir(tiny_bf16, device="cpu", limits=settings.media_limits())
    with live(settings, engine, ready_timeout=120) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def in_process(
    engine: Engine, items: list[Item], options: PrepareOptions | None = None
) -> tuple[np.ndarray, int]:
    prepared = [engine.prepare(item, options or PrepareOptions()) for item in items]
    return np.concatenate([engine.embed([p]) for p in prepared]), sum(p.num_tokens for p in prepared)


def text(*texts: str) -> list[Item]:
    return [Item((TextPart(t),)) for t in texts]


def test_openai_sdk_default_base64(oai: openai.OpenAI, engine: Engine) -> None:
    texts = ["the quick brown fox", "jumps over", "the lazy dog"]
    raw = oai.embeddings.with_raw_response.create(model="eg2", input=texts)
    assert all(isinstance(d["embedding"], str) for d in json.loads(raw.http_response.text)["data"])
    result = raw.parse()
    want, tokens = in_process(engine, text(*texts))
    np.testing.assert_allclose(np.asarray([d.embedding for d in result.data]), want, atol=ATOL)
    assert result.usage.prompt_tokens == result.usage.total_tokens == tokens


def test_openai_sdk_float_and_dimensions(oai: openai.OpenAI, engine: Engine) -> None:
    result = oai.embeddings.create(model="eg2", input=["hello world", "x"], encoding_format="float")
    want, _ = in_process(engine, text("hello world", "x"))
    np.testing.assert_allclose(np.asarray([d.embedding for d in result.data]), want, atol=ATOL)
    cut = oai.embeddings.create(
        model="eg2", input=["hello world", "x"], dimensions=256, encoding_format="float"
    )
    got = np.asarray([d.embedding for d in cut.data], dtype=np.float32)
    assert got.shape == (2, 256)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(got, matryoshka(want, 256), atol=ATOL)


def test_media_via_extra_body(oai: openai.OpenAI, engine: Engine) -> None:
    body = [
        image_part(PNG),
        audio_part(WAV),
        video_part(MP4),
        {
            "content": [
                {"type": "text", "text": "a cat"},
                image_part(PNG),
                {"type": "text", "text": "on a mat"},
            ]
        },
    ]
    result = oai.embeddings.create(
        model="eg2", input="unused", extra_body={"input": body, "image_tokens": 70}
    )
    image, audio, video = MediaPart("image", PNG), MediaPart("audio", WAV), MediaPart("video", MP4)
    items = [
        Item((image,)),
        Item((audio,)),
        Item((video,)),
        Item((TextPart("a cat"), image, TextPart("on a mat"))),
    ]
    want, tokens = in_process(engine, items, PrepareOptions(image_tokens=70))
    np.testing.assert_allclose(np.asarray([d.embedding for d in result.data]), want, atol=ATOL)
    assert result.usage.prompt_tokens == tokens


def test_usage_is_the_reference_processors_token_count(client: httpx.Client, tiny_bf16: Path) -> None:
    """Not our own count checked against itself: transformers' processor counts the same tokens."""
    from PIL import Image

    from tests.support.reference import load_reference

    reference = load_reference(tiny_bf16)
    wave, rate = sf.read(io.BytesIO(WAV), dtype="float32")
    cases: list[tuple[dict[str, Any], list[Any], str | None]] = [
        ({"input": "count these tokens please"}, ["count these tokens please"], None),
        ({"input": "a query", "prompt_name": "query"}, ["a query"], "query"),
        ({"input": [image_part(PNG)]}, [Image.open(io.BytesIO(PNG))], None),
        ({"input": [audio_part(WAV)]}, [{"audio": (wave, rate)}], None),
    ]
    for body, ref_inputs, prompt_name in cases:
        r = client.post("/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        prompt = reference.model.prompts.get(prompt_name) if prompt_name else None
        expected = int(reference.model_inputs(ref_inputs, prompt=prompt)["attention_mask"].sum())
        assert r.json()["usage"]["prompt_tokens"] == expected, body


def test_batched_http_equals_one_by_one(client: httpx.Client, engine: Engine) -> None:
    texts = [" ".join(["word"] * (i % 9 + 1)) + f" {i}" for i in range(24)]
    r = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"})
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in r.json()["data"]])
    np.testing.assert_allclose(got, in_process(engine, text(*texts))[0], atol=ATOL)


def _real_case(case: str) -> tuple[Any, int, str, str | None]:
    """The contract's error rows, with real bad media in place of the fake engine's markers."""
    half_png = PNG[: len(PNG) // 2]
    replacements: dict[str, tuple[Any, int, str, str | None]] = {
        "undecodable": ({"input": [image_part(half_png)]}, 400, "invalid_request_error", None),
        "too-many-pixels": (
            {"input": [image_part(png_header_only(100_000, 100_000))]},
            413,
            "request_too_large",
            None,
        ),
        "too-long-no-truncate": (
            {"input": "x" * 9000, "truncate": False},
            400,
            "invalid_request_error",
            None,
        ),
        "body-over-limit": ({"input": "x" * (3 << 20)}, 413, "request_too_large", None),
    }
    if case in replacements:
        return replacements[case]
    body, status, name, param = next((b, s, n, p) for c, b, s, n, p in ERROR_CASES if c == case)
    return body, status, name, param


# "bug" needs an injected preprocessing fault: test_app_contract covers it with the FakeEngine.
@pytest.mark.parametrize("case", [c[0] for c in ERROR_CASES if c[0] != "bug"])
def test_error_rows_with_real_media(client: httpx.Client, case: str) -> None:
    body, status, name, param = _real_case(case)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post("/v1/embeddings", content=content, headers={"content-type": "application/json"})
    error = assert_error(r, status, name)
    if param is not None:
        assert error["param"] == param, error


def test_nan_audio_is_refused_and_others_in_the_request_survive(client: httpx.Client) -> None:
    out = io.BytesIO()
    sf.write(out, np.full(16_000, np.nan, dtype=np.float32), 16_000, format="WAV", subtype="FLOAT")
    r = client.post("/v1/embeddings", json={"input": [audio_part(out.getvalue())]})
    assert_error(r, 400, "invalid_request_error")
    assert client.post("/v1/embeddings", json={"input": ["fine", audio_part(WAV)]}).status_code == 200


def test_a_killed_media_worker_costs_no_request(
    server: LiveServer, client: httpx.Client, engine: Engine
) -> None:
    """With media on worker processes: every worker killed while a request's video is being
    prepared, that request and the ones after it still get their vectors (the pool starts again and
    runs the job once more)."""
    procs = server.service.batcher._procs
    if server.settings.preprocess_processes == 0:
        assert procs is None  # the threads prepare: nothing to kill
        return
    assert procs is not None and len(procs.pids()) == 2
    video = samples.mp4(40, width=640, height=480)
    body = {"input": [{"content": [video_part(video)]}], "encoding_format": "base64"}
    result: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: result.update(r=client.post("/v1/embeddings", json=body)))
    restarts, pids = procs.restarts, procs.pids()
    sender.start()
    deadline = time.monotonic() + 60
    while not procs.in_flight:  # the video's job is in the pool
        assert time.monotonic() < deadline
        time.sleep(0.002)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    sender.join(timeout=120)
    r = result["r"]
    assert r.status_code == 200, r.text
    got = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
    item = Item((MediaPart("video", video),))
    np.testing.assert_allclose(got, in_process(engine, [item])[0][0], atol=ATOL)
    assert procs.restarts == restarts + 1 and not set(procs.pids()) & set(pids)
    r = client.post("/v1/embeddings", json={"input": [{"content": [image_part(PNG)]}]})
    assert r.status_code == 200, r.text
