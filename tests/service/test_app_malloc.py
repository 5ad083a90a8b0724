"""The idle server's trim (app/malloc.py, wired in app/server.py): when it comes, and that it comes
once per burst, never while work is held. The trim's own effect on the heap is tested in
tests/reliability/test_reliability_malloc.py."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from app import malloc
from app.malloc import IdleTrim
from tests.support.fake_engine import FakeEngine, live, make_settings


def test_the_policy_trims_once_per_quiet_spell_after_work() -> None:
    idle = IdleTrim(1.0, now=0.0)
    assert not idle.due(5.0, 0, False), "nothing is pending at start: no trim as the first requests come"
    assert not idle.due(5.1, 3, True)  # a burst
    assert not idle.due(6.5, 3, True)  # still held 1.4 s later: not idle
    assert not idle.due(7.4, 3, False)  # quiet since the last poll that saw work (6.5)
    assert idle.due(7.5, 3, False)
    assert not idle.due(20.0, 3, False), "one trim per quiet spell"
    assert not idle.due(20.1, 4, False)  # one request came and went between two polls
    assert idle.due(21.1, 4, False)


def trims(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(
        next(
            line.split()[-1] for line in text.splitlines() if line.startswith("eg2_malloc_trim_seconds_count")
        )
    )


def embed(url: str) -> None:
    assert httpx.post(url + "/v1/embeddings", json={"input": "a"}, timeout=10).status_code == 200


@pytest.mark.skipif(not malloc.available(), reason="glibc's malloc_trim")
def test_the_server_trims_after_a_burst_and_not_while_a_request_runs() -> None:
    idle_s = 0.5
    engine = FakeEngine(embed_delay_s=1.5, modalities=("text",))
    with live(make_settings(malloc_trim_idle_s=idle_s), engine) as s:
        time.sleep(2 * idle_s)
        assert trims(s.url) == 0, "trimmed before any request"

        # One request held on the engine for 1.5 s, 3x idle_s: no trim until it is answered.
        slow = threading.Thread(target=embed, args=(s.url,))
        slow.start()
        time.sleep(1.2)
        assert trims(s.url) == 0, "trimmed while a request was in flight"
        slow.join()
        answered = time.monotonic()
        deadline = answered + 5
        while trims(s.url) == 0:
            assert time.monotonic() < deadline, "the idle server never trimmed"
            time.sleep(0.02)
        # Quiet from the last tick that saw the request (up to 0.1 s before it ended), and the client
        # reads `answered` later still: a trim that did not wait would come within ~0.1 s.
        assert time.monotonic() - answered >= idle_s - 0.25
        time.sleep(3 * idle_s)
        assert trims(s.url) == 1, "trimmed again with no request since"


def test_zero_never_trims() -> None:
    with live(make_settings(malloc_trim_idle_s=0)) as s:
        embed(s.url)
        time.sleep(0.5)
        assert trims(s.url) == 0


@pytest.mark.skipif(not malloc.available(), reason="glibc's malloc_trim")
def test_a_failing_trim_is_logged_and_the_server_serves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Injected fault: the trim raises. Each burst still gets its attempt (nothing stays stuck), none
    is counted as a trim, and uvicorn's loop keeps serving."""
    attempts: list[float] = []

    def failing() -> float:
        attempts.append(time.monotonic())
        raise OSError("injected")

    monkeypatch.setattr(malloc, "trim", failing)
    with live(make_settings(malloc_trim_idle_s=0.2), FakeEngine(modalities=("text",))) as s:
        for burst in (1, 2):
            embed(s.url)
            deadline = time.monotonic() + 5
            while len(attempts) < burst:
                assert time.monotonic() < deadline, f"no trim attempted after burst {burst}"
                time.sleep(0.02)
        assert trims(s.url) == 0
        embed(s.url)


@pytest.mark.skipif(not malloc.available(), reason="glibc's malloc_trim")
def test_no_trim_while_a_timed_out_requests_batch_still_runs() -> None:
    """The request is answered 503 at its timeout, but its batch keeps the GPU thread for 2 s: the
    server is not idle until that call returns."""
    engine = FakeEngine(embed_delay_s=2.0, modalities=("text",))
    with live(make_settings(malloc_trim_idle_s=0.3, request_timeout_s=0.3), engine) as s:
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "a"}, timeout=10).status_code == 503
        time.sleep(1.2)  # the request is gone; the GPU call runs to ~2 s
        assert s.service.active == 0 and trims(s.url) == 0, "trimmed while a GPU call ran"
        deadline = time.monotonic() + 5
        while trims(s.url) == 0:
            assert time.monotonic() < deadline, "the idle server never trimmed"
            time.sleep(0.05)
