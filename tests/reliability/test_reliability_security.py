"""Security at the edge, against the real `eg2 serve` and engine: what answers and logs never contain,
paths that try to slip past the key, CORS that never stands in for the key, and the image's user.

The server is the installed CLI in a subprocess with DEBUG logs and the key from the environment (as
deployments pass it), so the log scan reads exactly what an operator's log shipper would receive.
Already proven in tests/service/test_app_security.py, and listed in the README reliability table rather than repeated:
the route-table walk (every route but /health and /ready needs the key), the constant-time compare,
CORS off by default, the 500 without a stack trace, and the raw-socket cases.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from eg2_runtime import samples
from tests.service.test_app_contract import ERROR_CASES
from tests.service.test_app_docker import DOCKERFILE, instructions
from tests.support import media
from tests.support.fake_engine import assert_error, audio_part, image_part, live, make_settings, video_part
from tests.support.load import Serve

KEY = "sk-live-Reliability-0d9f8e7c6b5a"
AUTH = {"authorization": f"Bearer {KEY}"}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tiny_bf16: Path) -> Iterator[Serve]:
    args = [
        "--model",
        str(tiny_bf16),
        "--device",
        "cpu",
        "--log-level",
        "debug",
        "--max-request-bytes",
        str(2 << 20),
        "--body-read-timeout-s",
        "1",
    ]
    with Serve(args, env={"EG2_API_KEY": KEY}) as s:
        yield s.wait_ready(90)


def leaks(text: str, model_dir: Path) -> list[str]:
    """What a client-facing answer must never contain."""
    needles = ["Traceback", 'File "', "/work/", "site-packages", str(REPO), str(model_dir), "/root/", "/tmp/"]
    found = [n for n in needles if n in text]
    if re.search(r"\b\w+\.py\b", text):
        found.append("a .py file name")
    return found


def raw(server: Serve, request: bytes, timeout: float = 5) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


@pytest.mark.slow
def test_no_stack_traces_or_server_paths_in_any_answer(server: Serve, tiny_bf16: Path) -> None:
    """Every kind of answer the server gives, good and bad, scanned for tracebacks and server paths."""
    answers: list[tuple[str, str]] = []
    with httpx.Client(base_url=server.url, timeout=30) as c:

        def keep(what: str, r: httpx.Response) -> None:
            answers.append(
                (
                    f"{what} -> {r.status_code}",
                    "\n".join(f"{k}: {v}" for k, v in r.headers.items()) + "\n" + r.text,
                )
            )

        for path in (
            "/health",
            "/ready",
            "/metrics",
            "/info",
            "/v1/models",
            "/openapi.json",
            "/nope",
            "/v1/../etc/passwd",
        ):
            keep(f"GET {path} no key", c.get(path))
            keep(f"GET {path}", c.get(path, headers=AUTH))
        for method in ("PUT", "DELETE", "PATCH"):
            keep(f"{method} /v1/embeddings", c.request(method, "/v1/embeddings", headers=AUTH))
        real = {"undecodable", "too-many-pixels", "bug"}  # the fake engine's marker rows: real media below
        for case, body, *_ in ERROR_CASES:
            if case not in real:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                keep(
                    case,
                    c.post(
                        "/v1/embeddings", content=content, headers=AUTH | {"content-type": "application/json"}
                    ),
                )
        png = samples.png(64, 48)
        hostile = {
            "truncated-png": image_part(png[: len(png) // 2]),
            "png-bomb": image_part(media.png_bomb(20_000, 20_000)),
            "nan-audio": audio_part(media.wav_float(media.sine(0.2, 16_000) * float("nan"), 16_000)),
            "garbage-video": video_part(media.garbage_after_magic(media.encode_video(1, 4, (48, 64)))),
            "wav-lying": audio_part(media.wav_lying_length(media.sine(0.2, 16_000), 16_000, 10**8)),
        }
        for case, part in hostile.items():
            keep(case, c.post("/v1/embeddings", json={"input": [part]}, headers=AUTH))
        keep(
            "too-long", c.post("/v1/embeddings", json={"input": "x" * 9000, "truncate": False}, headers=AUTH)
        )
        keep("over-the-byte-limit", c.post("/v1/embeddings", json={"input": "x" * (3 << 20)}, headers=AUTH))
        keep("fine", c.post("/v1/embeddings", json={"input": ["fine", image_part(png)]}, headers=AUTH))
    head = f"POST /v1/embeddings HTTP/1.1\r\nhost: t\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
    for what, request in {
        "lying-content-length": (head + "content-length: 64\r\n\r\n{}").encode(),
        "bad-content-length": (head + "content-length: 12abc\r\n\r\n{}").encode(),
        "malformed-request-line": b"GARBAGE / HTTP/9.9\r\nconnection: close\r\n\r\n",
        "header-without-colon": b"GET /health HTTP/1.1\r\nhost t\r\n\r\n",
    }.items():
        answers.append((what, raw(server, request).decode("latin-1")))
    assert len(answers) > 60
    for what, text in answers:
        assert not leaks(text, tiny_bf16), f"{what}: {leaks(text, tiny_bf16)}\n{text[:600]}"
        assert "server: uvicorn" not in text.lower(), f"{what} names the server software"
    assert server.proc.poll() is None


@pytest.mark.slow
def test_logs_never_contain_the_key_or_the_media(server: Serve) -> None:
    """DEBUG logs of successes, wrong keys, bad and hostile media and validation errors: neither the key
    (nor a near miss of it) nor any stretch of the base64 media sent appears."""
    png, wav = samples.png(80, 64, seed=11), samples.wav(0.7, hz=330.0)
    mp4 = samples.mp4(2)
    parts = [image_part(png), audio_part(wav), video_part(mp4)]
    encoded = [base64.b64encode(blob).decode() for blob in (png, wav, mp4)]
    near_misses = [KEY + "x", KEY[:-1], KEY.upper()]
    start = len(server.lines)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.post("/v1/embeddings", json={"input": parts}, headers=AUTH).status_code == 200
        for wrong in near_misses:
            r = c.post("/v1/embeddings", json={"input": parts}, headers={"authorization": f"Bearer {wrong}"})
            assert r.status_code == 401
        r = c.post("/v1/embeddings", json={"input": [image_part(png[:300])]}, headers=AUTH)  # undecodable
        assert r.status_code == 400
        r = c.post(
            "/v1/embeddings", json={"input": [audio_part(wav)], "dimensions": encoded[0][:50]}, headers=AUTH
        )
        assert r.status_code == 400
        r = c.post("/v1/embeddings", json={"input": parts, encoded[1][:60]: 1}, headers=AUTH)  # unknown field
        assert r.status_code == 400
        r = c.post(
            "/v1/embeddings", json={"input": [image_part(wav, "image/png")]}, headers=AUTH
        )  # wrong kind
        assert r.status_code == 400
        r = c.post(
            "/v1/embeddings", json={"input": parts, "model": KEY}, headers=AUTH
        )  # a key pasted as model
        assert r.status_code == 404
    deadline = time.monotonic() + 10  # the stderr reader catches up
    while (log := "".join(server.lines[start:])).count("POST /v1/embeddings") < 9:
        assert time.monotonic() < deadline, "the requests were not logged at all"
        time.sleep(0.05)
    for secret in [KEY, *near_misses]:
        assert secret not in log, "an API key leaked into the logs"
    for blob in encoded:
        for at in range(0, len(blob) - 32, max(1, len(blob) // 50)):  # ~50 windows across each payload
            window = blob[at : at + 32]
            assert window not in log, f"base64 media leaked into the logs: {window}"


def test_public_paths_do_not_open_other_routes() -> None:
    """/health and /ready are public by exact path: no spelling of another route rides on them."""
    key = "k-path-confusion"
    with live(make_settings(api_key=key)) as s, httpx.Client(base_url=s.url) as c:
        tricks = [
            "/health/../v1/embeddings",
            "/health/%2e%2e/v1/embeddings",
            "/health%2F..%2Fv1%2Fembeddings",
            "/ready/../v1/embeddings",
            "//v1/embeddings",
            "/v1/embeddings/",
            "/v1//embeddings",
            "/V1/EMBEDDINGS",
            "/health;/v1/embeddings",
            "/v1/embeddings%00",
            "/embeddings",
        ]
        for path in tricks:
            r = c.post(path, json={"input": "x"})
            assert r.status_code in (401, 404), (path, r.status_code, r.text)
            assert "data" not in r.text
        r = c.post("/v1/embeddings?/health", json={"input": "x"})
        assert_error(r, 401, "authentication_error")


def test_only_the_exact_key_opens() -> None:
    key = "k-Exact-12345"
    with live(make_settings(api_key=key)) as s, httpx.Client(base_url=s.url) as c:
        refused = [
            f"Bearer {key[:-1]}",
            f"Bearer {key}5",
            f"Bearer {key.lower()}",
            f"Bearer {key[1:]}",
            "Bearer",
            f"Bearer{key}",
            f"Bearer {key} {key}",
            f"Basic {base64.b64encode(f'user:{key}'.encode()).decode()}",
            f"Token {key}",
            key,
        ]
        for header in refused:
            r = c.post("/v1/embeddings", json={"input": "x"}, headers={"authorization": header})
            assert_error(r, 401, "authentication_error")
        # Two Authorization headers, the wrong one first: the first is the one that counts.
        r = c.post(
            "/v1/embeddings",
            json={"input": "x"},
            headers=[("authorization", "Bearer wrong"), ("authorization", f"Bearer {key}")],
        )
        assert_error(r, 401, "authentication_error")
        assert (
            c.post(
                "/v1/embeddings", json={"input": "x"}, headers={"authorization": f"bearer {key}"}
            ).status_code
            == 200
        )


def test_cors_never_stands_in_for_the_key() -> None:
    """With an origin allowed, its preflight is answered (browsers send no credentials on it), but the
    request itself still needs the key, and other origins get no CORS headers at all."""
    key = "k-cors-777"
    with (
        live(make_settings(api_key=key, cors_origins="https://app.example")) as s,
        httpx.Client(base_url=s.url) as c,
    ):
        preflight = {"origin": "https://app.example", "access-control-request-method": "POST"}
        r = c.options(
            "/v1/embeddings", headers=preflight | {"access-control-request-headers": "authorization"}
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "access-control-allow-credentials" not in r.headers
        r = c.post("/v1/embeddings", json={"input": "x"}, headers={"origin": "https://app.example"})
        assert_error(r, 401, "authentication_error")
        r = c.post(
            "/v1/embeddings",
            json={"input": "x"},
            headers={"origin": "https://evil.example", "authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = c.options("/v1/embeddings", headers=preflight | {"origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_every_image_target_runs_as_a_numeric_non_root_user() -> None:
    """Follows each stage's FROM chain: every stage built on `runtime` ends as a numeric, non-zero UID
    (Kubernetes' runAsNonRoot can only verify a numeric one)."""
    parents: dict[str, str] = {}
    users: dict[str, str | None] = {}
    current = ""
    for word, rest in instructions(DOCKERFILE):
        if word == "FROM":
            base, _, name = rest.partition(" AS ")
            current = name.strip() or base.strip()
            parents[current], users[current] = base.strip(), None
        elif word == "USER":
            users[current] = rest.split(":")[0].strip()

    def effective(stage: str) -> str | None:
        while users.get(stage) is None and stage in parents:
            stage = parents[stage]
        return users.get(stage)

    def built_on_runtime(stage: str) -> bool:
        while stage in parents:
            if stage == "runtime":
                return True
            stage = parents[stage]
        return False

    targets = [s for s in parents if built_on_runtime(s)]
    assert {"runtime", "serve"} <= set(targets), targets
    for stage in targets:
        user = effective(stage)
        assert user is not None and user.isdigit() and int(user) != 0, f"stage {stage} runs as {user!r}"
