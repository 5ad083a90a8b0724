"""Connection-level defences, before a request reaches the app: how long and how large a request's
headers may be, how many connections may be open, and what the server writes about a client.

Each test reproduces one finding of issue 13 (probe of 2026-12-01 on the tiny model) at small scale,
with the fake engine: the engine is not the point of any of them. The cases that need the server's own
process (a file-descriptor limit) run tests/support/fake_engine.py as a script.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.logs import JsonFormatter, TextFormatter
from tests.service.test_app_lifecycle import Proc
from tests.support.fake_engine import FakeEngine, assert_error, live, make_settings

KEY = "k-connections"
REPO = Path(__file__).resolve().parents[2]


def test_a_trailing_slash_is_not_redirected_to_the_clients_host() -> None:
    """Starlette answered `/v1/models/` with a 307 whose Location was built from the Host header the
    client sent: a link to any host, from this server. Now a 404 with the error body, and no Location."""
    with live() as s, httpx.Client(base_url=s.url) as c:
        for method, path in (("GET", "/v1/models/"), ("POST", "/v1/embeddings/"), ("GET", "/health/")):
            r = c.request(method, path, headers={"host": "evil.example"}, json={"input": "x"})
            assert "location" not in r.headers, (path, r.status_code, r.headers)
            assert_error(r, 404, "invalid_request_error")
            assert "evil.example" not in r.text


def test_log_lines_are_clipped_whatever_the_client_sent(caplog: pytest.LogCaptureFixture) -> None:
    """An unauthenticated request with a 20,000-character path (under the header limit) was logged
    whole. Every line, in both log formats, now stays under 1,500 characters (a message is clipped at 1,024)."""
    caplog.set_level(logging.DEBUG)
    path = "/v1/" + "p" * 20_000
    with live(make_settings(api_key=KEY)) as s, httpx.Client(base_url=s.url) as c:
        assert_error(c.get(path), 401, "authentication_error")
        assert_error(
            c.post(path, json={"input": "x"}, headers={"x-request-id": "r" * 128}),
            401,
            "authentication_error",
        )
    mine = [r for r in caplog.records if r.name.startswith("eg2")]
    assert any(path[:200] in r.getMessage() for r in mine), "the request was not logged at all"
    for formatter in (JsonFormatter(), TextFormatter()):
        for record in mine:
            line = formatter.format(record)
            assert len(line) < 1_500, f"{type(formatter).__name__}: a {len(line)}-character line"
            assert "p" * 1_100 not in line
    entry = json.loads(JsonFormatter().format(mine[-1]))
    assert "more characters]" in entry["msg"], entry["msg"][-80:]


# --- raw connections --------------------------------------------------------------------------------


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _trickle(
    sock: socket.socket, first: bytes, line: bytes, every_s: float, for_s: float
) -> tuple[bytes, float]:
    """Send `first`, then `line` every `every_s` seconds while reading; (what came back, seconds until
    the server closed), or (what came back, `for_s`) if it never did."""
    start = time.monotonic()
    received = b""
    sock.settimeout(every_s)
    with contextlib.suppress(OSError):
        sock.sendall(first)
    while time.monotonic() - start < for_s:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            with contextlib.suppress(OSError):  # the server may have closed: the next recv says so
                sock.sendall(line)
            continue
        except ConnectionResetError:
            return received, time.monotonic() - start
        if not chunk:
            return received, time.monotonic() - start
        received += chunk
    return received, for_s


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def _error(answer: bytes) -> dict[str, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower() and b"x-request-id: " in head.lower(), head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return dict(error)


def test_slow_headers_are_cut_off_within_the_timeout() -> None:
    """Row 5 of issue 13: a header line every few seconds kept a connection open indefinitely (here every
    0.3 s, with an API key configured: it is read from the headers, so it cannot help). Now 408 and
    closed within header_read_timeout_s (1 s here); a connection that sends nothing is closed too."""
    settings = make_settings(api_key=KEY, header_read_timeout_s=1.0)
    with live(settings) as s:
        port = _port(s.url)
        with (
            socket.create_connection(("127.0.0.1", port)) as slow,
            socket.create_connection(("127.0.0.1", port)) as idle,
        ):
            answer, seconds = _trickle(
                slow, b"GET /v1/models HTTP/1.1\r\nhost: t\r\n", b"x-slow: 1\r\n", 0.3, 8
            )
            assert seconds < 3, f"a slow-header connection still open after {seconds:.1f} s"
            assert _status(answer) == 408, answer[:200]
            assert _error(answer)["type"] == "request_timeout"
            silent, idle_seconds = _trickle(idle, b"", b"", 0.3, 8)
            assert silent == b"" and idle_seconds < 3, (silent, idle_seconds)
        print(f"\nslow headers: 408 and closed after {seconds:.2f} s (header_read_timeout_s 1)")
        with httpx.Client(base_url=s.url) as keep_alive:  # the limit is per request, not per connection
            for _ in range(3):
                assert keep_alive.get("/health").status_code == 200
                time.sleep(0.6)
            assert len(s.server.connections) == 1, "the kept-alive connection was not reused"
        closed = _metric(s.url, "eg2_connections_closed_total", reason="header_timeout")
        assert closed == 2, closed


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_a_header_block_over_the_limit_gets_431_as_it_arrives() -> None:
    """300 MB header blocks were accepted. Now the request line and headers together may take
    max_header_bytes (32 KiB by default): an endless header value is answered 431 as soon as that much
    has arrived (the client stops after 4 MiB here, which the old server read without a word), a block
    sent in one write is measured exactly, and a 65 kB path (the log finding) never reaches the app."""
    with live(make_settings(api_key=KEY)) as s:
        port = _port(s.url)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\nx-endless: ")
            sent, answer = 0, b""
            while sent < 4 << 20 and not answer:  # paced, so the server reads each piece as it comes
                try:
                    sock.sendall(b"a" * 16384)
                except OSError:
                    break
                sent += 16384
                if select.select([sock], [], [], 0.005)[0]:
                    answer = sock.recv(65536)
            with contextlib.suppress(OSError):
                answer += sock.recv(65536)
        assert _status(answer) == 431, f"no 431 after {sent} bytes of one header: {answer[:100]!r}"
        assert _error(answer)["type"] == "request_too_large"
        assert sent <= 256 << 10, f"{sent >> 10} KiB of one header read before the 431"
        print(f"\nan endless header: 431 after {sent >> 10} KiB sent")

        def one_write(extra_headers: int, path: str = "/health") -> bytes:
            headers = "".join(f"x-h{i}: {'v' * 1000}\r\n" for i in range(extra_headers))
            request = f"GET {path} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n{headers}\r\n".encode()
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(request)
                return b"".join(iter(lambda: conn.recv(65536), b""))

        assert _status(one_write(30)) == 200  # 30 kB: under the limit
        big = one_write(40)  # 40 kB in one write
        assert _status(big) == 431 and _error(big)["type"] == "request_too_large"
        long_path = one_write(0, "/v1/" + "p" * 65_000)
        assert _status(long_path) == 431, long_path[:100]
        assert _metric(s.url, "eg2_connections_closed_total", reason="header_too_large") == 3
        assert httpx.get(s.url + "/health").status_code == 200


@pytest.fixture
def spawn() -> Iterator[Callable[..., Proc]]:
    procs: list[Proc] = []

    def start(env: dict[str, str], *args: str) -> Proc:
        procs.append(Proc(env, *args))
        return procs[-1]

    yield start
    for p in procs:
        p.close()


def test_idle_and_slow_connections_do_not_stop_health(spawn: Callable[..., Proc]) -> None:
    """Row 5 at small scale: 20,000 idle and slow-header connections reached the server's descriptor
    limit, and /health and every client got nothing. Here the server process runs under a limit of
    256 descriptors, so its connection cap is fitted to 256 - 64 = 192, and 400 connections are opened
    (half idle, half partway through a request line): /health on a new connection still answers each
    time, the oldest waiting connections having been closed to make room."""
    p = spawn({"EG2_API_KEY": KEY}, "--nofile", "256")
    held: list[socket.socket] = []
    worst = 0.0
    try:
        for i in range(400):
            sock = socket.create_connection(("127.0.0.1", _port(p.url)), timeout=5)
            if i % 2:
                sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: t\r\n")
            held.append(sock)
            if i % 100 == 99:
                start = time.monotonic()
                r = httpx.get(p.url + "/health", timeout=5)
                worst = max(worst, time.monotonic() - start)
                assert r.status_code == 200, (i, r.status_code, r.text)
        fds = len(os.listdir(f"/proc/{p.proc.pid}/fd"))
        open_now = _metric(p.url, "eg2_open_connections")
        evicted = _metric(p.url, "eg2_connections_closed_total", reason="evicted")
    finally:
        for sock in held:
            sock.close()
    print(
        f"\n400 idle/slow connections: /health answered in at most {worst * 1000:.0f} ms; {fds} fds, evicted {evicted:g}"
    )
    assert open_now <= 192, open_now
    assert evicted >= 400 - 192, evicted


def test_at_the_cap_with_every_connection_busy_a_new_one_gets_503_at_once() -> None:
    """FakeEngine (a stalled GPU call on demand): 4 connections (the cap here), each with a request in
    flight, so none can be closed to make room. A fifth connection is answered 503 at once, with the
    error body, `connection: close` and `retry-after`; the 4 then complete."""
    engine = FakeEngine()
    with live(make_settings(max_connections=4), engine) as s:
        engine.stall()
        answers: list[httpx.Response] = []
        threads = [
            threading.Thread(
                target=lambda i=i: answers.append(
                    httpx.post(s.url + "/v1/embeddings", json={"input": f"t{i}"})
                )
            )
            for i in range(4)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while s.service.active < 4:
            assert time.monotonic() < deadline, f"{s.service.active} requests in flight"
            time.sleep(0.01)
        assert len(s.server.connections) == 4
        start = time.monotonic()
        r = httpx.get(s.url + "/health", timeout=5)
        took = time.monotonic() - start
        assert "connection limit" in assert_error(r, 503, "unavailable")["message"]
        assert r.headers["connection"] == "close" and r.headers["retry-after"] == "1"
        assert took < 1, took
        engine.release()
        for t in threads:
            t.join(timeout=10)
        assert [a.status_code for a in answers] == [200] * 4
        assert httpx.get(s.url + "/health").status_code == 200
        assert _metric(s.url, "eg2_connections_closed_total", reason="over_limit") == 1


def test_the_connection_cap_is_fitted_to_the_descriptor_limit() -> None:
    """`eg2 serve` raises a low soft descriptor limit toward the hard one when the cap needs it, and
    lowers the cap when even the hard limit is too small (in a child process: limits are per process)."""
    code = (
        "import resource; from app.server import FD_RESERVE, fit_descriptor_limit as fit\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024))\n"
        "print(fit(500), resource.getrlimit(resource.RLIMIT_NOFILE)[0], fit(2000), FD_RESERVE)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    fits, soft, lowered, reserve = map(int, out.stdout.split())
    assert (fits, soft) == (500, 500 + reserve), out.stdout
    assert lowered == 1024 - reserve, out.stdout


def test_a_client_closing_under_pipelined_requests_is_a_disconnect_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three requests pipelined on one connection, closed after the first answer. uvicorn marks only
    the newest parsed request disconnected, so the second, running when the client goes, went on to
    embed all its 8 items and wrote its answer to the closed transport (uvloop raises: an unhandled
    error with a traceback, counted 200). The protocol now marks the running request too: its app
    hears the disconnect, stops its work, counts 499, and nothing is logged as an error."""
    caplog.set_level(logging.INFO)

    def post(texts: list[str]) -> bytes:
        body = json.dumps({"input": texts}).encode()
        head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        return head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)

    engine = FakeEngine(embed_delay_s=0.05)
    with live(make_settings(max_batch_items=1), engine) as s:
        second = [f"second {i}" for i in range(8)]
        with socket.create_connection(("127.0.0.1", _port(s.url)), timeout=5) as sock:
            sock.sendall(post(["first"]) + post(second) + post(["third"]))
            assert _status(sock.recv(65536)) == 200
        time.sleep(0.8)  # the second request's 8 batches of 50 ms would be done by now
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "after"}).status_code == 200
        gone = _metric(s.url, "eg2_requests_total", route="/v1/embeddings", status="499")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [f"{r.name}: {r.getMessage()}" for r in errors]
    assert gone == 1, f"{gone} requests counted as a client gone"
    embedded = sum(t in engine.embedded_texts for t in second)
    assert embedded < len(second), "the running request's work went on after its client left"


def test_bytes_after_a_running_request_that_fail_to_parse_do_not_answer_it() -> None:
    """A valid request, still running, followed by bytes that are not a request: the error is the
    later request's, so the running one gets no 400 in its place (the connection is reset)."""
    body = b'{"input": "hello"}'
    request = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    request += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    with live(engine=FakeEngine(embed_delay_s=0.3)) as s:
        with socket.create_connection(("127.0.0.1", _port(s.url)), timeout=5) as sock:
            sock.sendall(request + b"NOT A REQUEST\r\n\r\n")
            answer = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(65536):
                    answer += chunk
        assert _status(answer) in (0, 200), answer[:200]
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "after"}).status_code == 200


@pytest.mark.parametrize(
    "chunk", [b"zz\r\nabc\r\n0\r\n\r\n", b"ffffffffffffffffff\r\nabc"], ids=["size-zz", "size-huge"]
)
def test_a_malformed_chunked_body_gets_400_with_the_error_body(chunk: bytes) -> None:
    """The body's framing fails to parse while the app waits for it: the request has no answer yet, so
    it gets the 400 (the connection was reset with no answer)."""
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with live() as s, socket.create_connection(("127.0.0.1", _port(s.url)), timeout=5) as sock:
        sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n" + chunk)
        answer = b""
        while chunk_in := sock.recv(65536):
            answer += chunk_in
        assert _status(answer) == 400, answer[:200]
        assert _error(answer)["type"] == "invalid_request_error"
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "after"}).status_code == 200
