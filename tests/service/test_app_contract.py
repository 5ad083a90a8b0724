"""The HTTP contract of docs/API.md, end to end: a real uvicorn on loopback, the official `openai`
client unchanged, every documented error row.

Vectors and token counts are checked against a second, in-process instance of the same engine
(`reference`), so the tests hold for any engine with the Engine surface: today the FakeEngine, later the
real Engine on the tiny checkpoint (swap `make_engine`; rows marked FAKE-ONLY inject faults by marker
and need real corrupt media instead)."""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from app.schemas import base64_rows, encode_embeddings
from eg2_runtime.api import matryoshka
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
from tests.support.fake_engine import (
    BAD_MEDIA,
    MP4,
    PNG,
    PREPARE_BUG,
    TOO_LARGE,
    WAV,
    FakeEngine,
    LiveServer,
    assert_error,
    audio_part,
    data_uri,
    image_part,
    live,
    make_settings,
    video_part,
)

MAX_TEXT_TOKENS = 500
ALIAS = "google/embeddinggemma-2"
ATOL = 1e-6  # HTTP vs in-process; batched vs one-by-one may need more with a real model


def make_engine() -> Any:
    return FakeEngine(max_text_tokens=MAX_TEXT_TOKENS)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    settings = make_settings(
        aliases=[ALIAS], max_request_bytes=256 * 1024, max_request_items=64, max_queued_items=256
    )
    with live(settings, make_engine()) as s:
        yield s


@pytest.fixture(scope="module")
def ref_engine() -> Any:
    """A second instance, used in the test's thread (the server's engine belongs to its GPU thread)."""
    return make_engine()


def as_item(*parts: str | MediaPart) -> Item:
    return Item(tuple(TextPart(p) if isinstance(p, str) else p for p in parts))


def reference(
    engine: Any, items: list[Item], options: PrepareOptions | None = None
) -> tuple[np.ndarray, int]:
    """(vectors, usage) of `items` computed in-process, one item per batch: what the API must return."""
    prepared = [engine.prepare(item, options or PrepareOptions()) for item in items]
    vectors = np.stack([engine.embed([p])[0] for p in prepared])
    return vectors, sum(p.num_tokens for p in prepared)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


def post(client: httpx.Client, body: Any, **kw: Any) -> httpx.Response:
    return client.post("/v1/embeddings", json=body, **kw)


# --- the official SDK ------------------------------------------------------------------------------


def test_openai_sdk_default_sends_base64_and_decodes(oai: openai.OpenAI, ref_engine: Any) -> None:
    texts = ["the quick brown fox", "jumps over", "the lazy dog"]
    raw = oai.embeddings.with_raw_response.create(model="eg2", input=texts)
    wire = json.loads(raw.http_response.text)
    assert all(isinstance(d["embedding"], str) for d in wire["data"]), "SDK default should ask for base64"
    result = raw.parse()
    assert [d.index for d in result.data] == [0, 1, 2]
    want, tokens = reference(ref_engine, [as_item(t) for t in texts])
    got = np.asarray([d.embedding for d in result.data], dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    assert result.usage.prompt_tokens == result.usage.total_tokens == tokens


def test_openai_sdk_float(oai: openai.OpenAI, ref_engine: Any) -> None:
    result = oai.embeddings.create(model="eg2", input="hello world", encoding_format="float")
    vector = np.asarray(result.data[0].embedding, dtype=np.float32)
    want, tokens = reference(ref_engine, [as_item("hello world")])
    np.testing.assert_allclose(vector, want[0], rtol=0, atol=ATOL)
    assert result.model == "eg2" and result.object == "list"
    assert result.usage.prompt_tokens == result.usage.total_tokens == tokens


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_openai_sdk_dimensions_256_unit_norm(oai: openai.OpenAI, ref_engine: Any, encoding: Any) -> None:
    result = oai.embeddings.create(model="eg2", input=["a b", "c"], dimensions=256, encoding_format=encoding)
    # The SDK decodes base64 itself only when it chose it; asked explicitly, it hands the string back.
    rows = [
        np.frombuffer(base64.b64decode(d.embedding), "<f4") if encoding == "base64" else d.embedding
        for d in result.data
    ]
    got = np.asarray(rows, dtype=np.float32)
    assert got.shape == (2, 256)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    want = matryoshka(reference(ref_engine, [as_item("a b"), as_item("c")])[0], 256)
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_openai_sdk_media_via_extra_body(oai: openai.OpenAI, ref_engine: Any) -> None:
    items = [
        image_part(),
        audio_part(),
        video_part(),
        {"content": [{"type": "text", "text": "a cat"}, image_part()]},
    ]
    result = oai.embeddings.create(
        model="eg2", input="unused", extra_body={"input": items, "image_tokens": 70}
    )
    got = np.asarray([d.embedding for d in result.data], dtype=np.float32)
    image, audio, video = (
        MediaPart("image", PNG, "png"),
        MediaPart("audio", WAV, "wav"),
        MediaPart("video", MP4, "mp4"),
    )
    items = [as_item(image), as_item(audio), as_item(video), as_item("a cat", image)]
    want, tokens = reference(ref_engine, items, PrepareOptions(image_tokens=70))
    np.testing.assert_allclose(got, want, atol=ATOL)
    assert result.usage.prompt_tokens == tokens  # soft tokens and markers included
    default_tokens = reference(ref_engine, [as_item(image)])[1]
    assert default_tokens > reference(ref_engine, [as_item(image)], PrepareOptions(image_tokens=70))[1]


def test_openai_sdk_async_client(server: LiveServer, ref_engine: Any) -> None:
    import asyncio

    async def go() -> list[float]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
            result = await c.embeddings.create(model="eg2", input="async")
            return result.data[0].embedding

    got = np.asarray(asyncio.run(go()), dtype=np.float32)
    np.testing.assert_allclose(got, reference(ref_engine, [as_item("async")])[0][0], atol=ATOL)


# --- request forms ---------------------------------------------------------------------------------


def test_base64_is_little_endian_float32(client: httpx.Client, ref_engine: Any) -> None:
    floats = post(client, {"input": "bytes"}).json()["data"][0]["embedding"]
    r = post(client, {"input": "bytes", "encoding_format": "base64"})
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert len(raw) == 768 * 4
    np.testing.assert_array_equal(np.frombuffer(raw, dtype="<f4"), np.asarray(floats, dtype=np.float32))
    np.testing.assert_allclose(
        np.frombuffer(raw, dtype="<f4"), reference(ref_engine, [as_item("bytes")])[0][0], atol=ATOL
    )


def test_float_rows_read_back_as_the_exact_float32_values() -> None:
    """JSON floats are the shortest decimals of the float32 values: parsed as float32, bit-identical,
    awkward values included; a non-finite value is a bug (500), never written as a null."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((3, 768)).astype(np.float32)
    rows[0, :6] = [0.0, -0.0, 1.0, -1.0, np.float32(1e-45), np.finfo(np.float32).max]
    for encoding in ("float", "base64"):
        body = json.loads(encode_embeddings(rows, encoding_format=encoding, model="m", num_tokens=7))
        assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["usage"]["total_tokens"] == 7
        got = [
            np.frombuffer(base64.b64decode(d["embedding"]), "<f4") if encoding == "base64" else d["embedding"]
            for d in body["data"]
        ]
        assert np.asarray(got, dtype=np.float32).tobytes() == rows.tobytes()
    one = encode_embeddings(
        np.full((1, 2), 0.1, np.float32), encoding_format="float", model="m", num_tokens=1
    )
    assert b'"embedding":[0.1,0.1]' in one  # the float32's own shortest decimal, not its double's
    rows[1, 5] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        encode_embeddings(rows, encoding_format="float", model="m", num_tokens=7)


def test_base64_rows_are_each_rows_own_encoding() -> None:
    """The one-call encoding of rows whose width is a multiple of 3 bytes (768-d float32, int8,
    uint8) and the per-row one of other widths both give each row's own base64."""
    rng = np.random.default_rng(1)
    for dtype, width in [
        ("<f4", 768),
        ("<f4", 512),
        ("<f4", 256),
        ("<f4", 128),
        ("i1", 768),
        ("u1", 96),
        ("u1", 64),
        ("<f4", 0),  # no columns: empty strings, not a zero-width cut
    ]:
        for n in (1, 2, 5):
            rows = (rng.standard_normal((n, width)) * 50).astype(dtype)
            assert base64_rows(rows) == [base64.b64encode(r.tobytes()).decode("ascii") for r in rows], (
                dtype,
                width,
                n,
            )


def test_order_and_usage_of_many_items(client: httpx.Client, ref_engine: Any) -> None:
    texts = [" ".join(["w"] * (i % 7 + 1)) + f" {i}" for i in range(40)]
    r = post(client, {"input": texts, "model": "eg2"})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(40))
    got = np.asarray([d["embedding"] for d in data], dtype=np.float32)
    want, tokens = reference(ref_engine, [as_item(t) for t in texts])
    np.testing.assert_allclose(got, want, atol=ATOL)
    assert r.json()["usage"]["prompt_tokens"] == tokens


def test_alias_route_and_model_alias(client: httpx.Client) -> None:
    for path, model in (("/embeddings", "eg2"), ("/v1/embeddings", ALIAS), ("/v1/embeddings", None)):
        body: dict[str, Any] = {"input": "x"} | ({"model": model} if model else {})
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "eg2"


def test_messages_form_gives_one_embedding(client: httpx.Client, ref_engine: Any) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, image_part()]}]
    r = post(client, {"messages": messages})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len(data) == 1
    want = reference(ref_engine, [as_item("look", MediaPart("image", PNG, "png"))])[0][0]
    np.testing.assert_allclose(data[0]["embedding"], want, atol=ATOL)


def test_text_part_equals_plain_string(client: httpx.Client) -> None:
    r = post(
        client,
        {
            "input": [
                "same",
                {"type": "text", "text": "same"},
                {"content": [{"type": "text", "text": "same"}]},
            ]
        },
    )
    rows = [d["embedding"] for d in r.json()["data"]]
    assert rows[0] == rows[1] == rows[2]


def test_prompt_name_and_prompt(client: httpx.Client, ref_engine: Any) -> None:
    name, query = sorted(ref_engine.prompts.items())[-1]
    by_name = post(client, {"input": "find me", "prompt_name": name}).json()
    literal = post(client, {"input": "find me", "prompt": query}).json()
    assert by_name["data"][0]["embedding"] == literal["data"][0]["embedding"]
    want, tokens = reference(ref_engine, [as_item("find me")], PrepareOptions(prompt=query))
    np.testing.assert_allclose(by_name["data"][0]["embedding"], want[0], atol=ATOL)
    assert by_name["usage"]["prompt_tokens"] == tokens
    plain = post(client, {"input": "find me"}).json()
    assert plain["data"][0]["embedding"] != by_name["data"][0]["embedding"]


def test_truncate_default_cuts_long_text(client: httpx.Client) -> None:
    r = post(client, {"input": "w " * (MAX_TEXT_TOKENS * 2)})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == MAX_TEXT_TOKENS


def test_user_is_accepted(client: httpx.Client) -> None:
    assert post(client, {"input": "x", "user": "someone"}).status_code == 200


def test_timing_headers_and_request_id(client: httpx.Client) -> None:
    r = post(client, {"input": "x"}, headers={"x-request-id": "my-trace.42"})
    assert r.headers["x-request-id"] == "my-trace.42"
    assert float(r.headers["x-queue-time-ms"]) >= 0 and float(r.headers["x-inference-time-ms"]) >= 0
    generated = post(client, {"input": "x"}, headers={"x-request-id": "bad id with spaces"})
    assert (
        generated.headers["x-request-id"] != "bad id with spaces"
        and len(generated.headers["x-request-id"]) == 32
    )
    assert post(client, {"input": "x"}).headers["x-request-id"] != generated.headers["x-request-id"]


# --- other routes ----------------------------------------------------------------------------------


def test_models(client: httpx.Client, oai: openai.OpenAI) -> None:
    models = oai.models.list()
    assert [m.id for m in models.data] == ["eg2"]
    assert client.get("/v1/models").json()["data"][0]["object"] == "model"


def test_health_ready_info(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready"}
    info = client.get("/info").json()
    assert info["model"] == "eg2" and info["aliases"] == [ALIAS]
    assert info["modalities"] == ["audio", "image", "text", "video"]
    assert info["dimensions"] == [128, 256, 512, 768]
    assert info["engine"]["weights"]["sha256"] == "0" * 64
    assert info["limits"]["max_request_items"] == 64
    assert info["memory"]["weight_bytes_bf16_equivalent"] == 4000
    assert info["graphs"]["captured"] == 0 and info["graphs"]["pool_budget_bytes"] == 0  # the fake: a CPU's


def test_openapi_documents_the_request(server: LiveServer) -> None:
    schema = server.app.openapi()
    body = schema["paths"]["/v1/embeddings"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/EmbeddingRequest"
    assert "input" in schema["components"]["schemas"]["EmbeddingRequest"]["properties"]
    assert "/embeddings" not in schema["paths"]


# --- every error row of the contract ---------------------------------------------------------------

LONG = "w " * (MAX_TEXT_TOKENS + 10)

ERROR_CASES: list[tuple[str, Any, int, str, str | None]] = [
    # (id, body (dict, or raw bytes), status, name, param)
    ("malformed-json", b'{"input": ', 400, "invalid_request_error", None),
    ("invalid-utf8", b'{"input": "\xff\xfe"}', 400, "invalid_request_error", None),
    ("deep-nesting", b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "invalid_request_error", None),
    ("not-an-object", b"[1, 2]", 400, "invalid_request_error", None),
    ("no-input", {"model": "eg2"}, 400, "invalid_request_error", "input"),
    (
        "input-and-messages",
        {"input": "x", "messages": [{"role": "user", "content": "x"}]},
        400,
        "invalid_request_error",
        "input",
    ),
    ("empty-array", {"input": []}, 400, "invalid_request_error", "input"),
    ("unknown-field", {"input": "x", "dimension": 256}, 400, "invalid_request_error", "dimension"),
    ("bad-item", {"input": ["ok", {"foo": 1}]}, 400, "invalid_request_error", "input[1]"),
    (
        "bad-part",
        {"input": [{"content": [{"type": "audio"}]}]},
        400,
        "invalid_request_error",
        "input[0].content[0]",
    ),
    ("dimensions", {"input": "x", "dimensions": 300}, 400, "invalid_request_error", "dimensions"),
    ("encoding", {"input": "x", "encoding_format": "hex"}, 400, "invalid_request_error", "encoding_format"),
    ("image-tokens", {"input": "x", "image_tokens": 100}, 400, "invalid_request_error", "image_tokens"),
    (
        "prompt-and-name",
        {"input": "x", "prompt": "a", "prompt_name": "query"},
        400,
        "invalid_request_error",
        "prompt",
    ),
    ("unknown-prompt", {"input": "x", "prompt_name": "nope"}, 400, "invalid_request_error", "prompt_name"),
    ("token-ids", {"input": [1, 2, 3]}, 400, "invalid_request_error", "input"),
    ("token-id-lists", {"input": [[1, 2], [3]]}, 400, "invalid_request_error", "input"),
    (
        "bad-base64",
        {"input": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]},
        400,
        "invalid_request_error",
        "input[0].image_url.url",
    ),
    (
        "wrong-mime",
        {"input": [image_part(MP4, "video/mp4")]},
        400,
        "invalid_request_error",
        "input[0].image_url.url",
    ),
    (
        "unsupported-image",
        {"input": [image_part(PNG, "image/svg+xml")]},
        400,
        "invalid_request_error",
        "input[0].image_url.url",
    ),
    (
        "not-base64-uri",
        {"input": [{"type": "video_url", "video_url": {"url": "data:video/mp4,raw"}}]},
        400,
        "invalid_request_error",
        "input[0].video_url.url",
    ),
    (
        "bad-audio-base64",
        {"input": [{"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}]},
        400,
        "invalid_request_error",
        "input[0].input_audio.data",
    ),
    (
        "audio-format",
        {"input": [audio_part(fmt="aiff")]},
        400,
        "invalid_request_error",
        "input[0].input_audio.format",
    ),
    # FAKE-ONLY: fault injected by marker
    ("undecodable", {"input": [image_part(PNG + BAD_MEDIA.encode())]}, 400, "invalid_request_error", None),
    (
        "remote-url",
        {"input": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]},
        400,
        "invalid_request_error",
        "input[0].image_url.url",
    ),
    (
        "file-url",
        {"input": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]},
        400,
        "invalid_request_error",
        "input[0].image_url.url",
    ),
    (
        "file-path",
        {"input": [{"type": "video_url", "video_url": {"url": "/etc/passwd"}}]},
        400,
        "invalid_request_error",
        "input[0].video_url.url",
    ),
    ("too-long-no-truncate", {"input": LONG, "truncate": False}, 400, "invalid_request_error", None),
    ("unknown-model", {"input": "x", "model": "text-embedding-3-small"}, 404, "model_not_found", "model"),
    ("too-many-items", {"input": ["x"] * 65}, 413, "request_too_large", "input"),
    # FAKE-ONLY: fault injected by marker
    ("too-many-pixels", {"input": [image_part(PNG + TOO_LARGE.encode())]}, 413, "request_too_large", None),
    ("body-over-limit", {"input": "x" * 300_000}, 413, "request_too_large", None),
    # FAKE-ONLY: fault injected by marker
    ("bug", {"input": ["fine", PREPARE_BUG]}, 500, "internal_error", None),
]


@pytest.mark.parametrize(
    ("case", "body", "status", "name", "param"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES]
)
def test_error_rows(
    client: httpx.Client, case: str, body: Any, status: int, name: str, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post("/v1/embeddings", content=content, headers={"content-type": "application/json"})
    error = assert_error(r, status, name)
    if param is not None:
        assert error["param"] == param, error
    if case == "token-ids":
        assert "tokenizer" in error["message"]
    if case == "dimensions":
        assert all(str(d) in error["message"] for d in (128, 256, 512, 768))
    if case == "bug":
        assert r.headers["x-request-id"] in error["message"] and PREPARE_BUG not in r.text


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
@pytest.mark.parametrize("field", ["seconds", "overlap"])
def test_segment_numbers_must_be_finite(client: httpx.Client, field: str, number: bytes) -> None:
    """pydantic's JSON parser reads NaN, Infinity and 1e999 (infinity) as floats; the bound checks
    alone answered "less than or equal to 120" for NaN seconds, which misleads."""
    values = {"seconds": b"10", "overlap": b"0.1", field: number}
    content = b'{"input": "x", "segments": {"seconds": %s, "overlap": %s}}' % (
        values["seconds"],
        values["overlap"],
    )
    r = client.post("/v1/embeddings", content=content, headers={"content-type": "application/json"})
    error = assert_error(r, 400, "invalid_request_error", f"segments.{field}")
    assert error["message"] == f"segments.{field}: Input should be a finite number", error


def test_other_requests_in_a_batch_survive_errors(client: httpx.Client, ref_engine: Any) -> None:
    """After every error above, the server still answers correctly."""
    r = post(client, {"input": "still fine"})
    want = reference(ref_engine, [as_item("still fine")])[0][0]
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], want, atol=ATOL)


def test_non_json_content_type(client: httpx.Client) -> None:
    r = client.post("/v1/embeddings", content=b'{"input": "x"}', headers={"content-type": "text/plain"})
    assert "Content-Type" in assert_error(r, 400, "invalid_request_error")["message"]
    assert client.post("/v1/embeddings", content=b'{"input": "x"}').status_code == 200  # none given: JSON


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate", "GZIP", "identity, gzip", "x-anything"])
@pytest.mark.parametrize("path", ["/v1/embeddings", "/embeddings", "/tokenize"])
def test_content_encodings_are_refused(client: httpx.Client, path: str, encoding: str) -> None:
    """The server decodes no content coding: a body labelled gzip was read as plain JSON (a hostile-input
    audit). The body here is plain JSON, so only the refusal tells the header was read."""
    headers = {"content-type": "application/json", "content-encoding": encoding}
    r = client.post(path, content=b'{"input": "x"}', headers=headers)
    error = assert_error(r, 415, "invalid_request_error")
    assert "Content-Encoding" in error["message"] and "uncompressed" in error["message"], error
    assert r.headers["accept-encoding"] == "identity"


def test_a_gzip_body_is_refused_and_identity_is_accepted(client: httpx.Client) -> None:
    gz = {"content-type": "application/json", "content-encoding": "gzip"}
    r = client.post("/v1/embeddings", content=gzip.compress(b'{"input": "x"}'), headers=gz)
    assert "gzip is not supported" in assert_error(r, 415, "invalid_request_error")["message"]
    plain = {"content-type": "application/json", "content-encoding": "identity"}
    assert client.post("/v1/embeddings", content=b'{"input": "x"}', headers=plain).status_code == 200


def test_unknown_route_and_method(client: httpx.Client) -> None:
    assert_error(client.get("/v1/nothing"), 404, "invalid_request_error")
    r = client.get("/v1/embeddings")
    assert_error(r, 405, "invalid_request_error")
    assert r.headers["allow"] == "POST"


def test_disabled_modality() -> None:
    with live(make_settings(), FakeEngine(modalities=["text"])) as s, httpx.Client(base_url=s.url) as c:
        for part, kind in ((image_part(), "image"), (audio_part(), "audio"), (video_part(), "video")):
            r = c.post("/v1/embeddings", json={"input": ["text is fine", part]})
            error = assert_error(r, 400, "invalid_request_error", "input[1]")
            assert kind in error["message"]
        assert c.post("/v1/embeddings", json={"input": "text is fine"}).status_code == 200
        assert c.get("/info").json()["modalities"] == ["text"]


def test_data_uri_mime_variants(client: httpx.Client) -> None:
    uris = [
        data_uri(m, PNG)
        for m in ("image/jpeg", "image/webp", "image/gif", "image/bmp", "image/tiff", "IMAGE/PNG")
    ]
    items = [{"type": "image_url", "image_url": {"url": u}} for u in uris]
    items += [video_part(MP4, m) for m in ("video/webm", "video/quicktime", "video/x-matroska")]
    assert post(client, {"input": items}).status_code == 200
