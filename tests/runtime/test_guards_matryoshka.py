"""`dimensions` over HTTP against Matryoshka computed here, independently of the server's code: the
leading d values of the full vector the same server returns, divided by their own L2 norm.

The fake engine's vectors are deterministic per item, so the full and the cut request see the same
vector; both encodings are checked, since each has its own path to the wire.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.fake_engine import LiveServer, live

TEXTS = ["a cat on a sofa", "the second item", "x"]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live() as s:
        yield s


def rows(body: dict[str, Any]) -> np.ndarray:
    data = sorted(body["data"], key=lambda d: d["index"])
    return np.asarray(
        [
            np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
            if isinstance(d["embedding"], str)
            else d["embedding"]
            for d in data
        ],
        dtype=np.float32,
    )


def embed(server: LiveServer, **fields: Any) -> np.ndarray:
    response = httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS, **fields}, timeout=30)
    assert response.status_code == 200, response.text
    return rows(response.json())


@pytest.mark.parametrize("encoding", ["float", "base64"])
@pytest.mark.parametrize("dim", [768, 512, 256, 128])
def test_dimensions_keep_the_leading_values_renormalized(server: LiveServer, dim: int, encoding: str) -> None:
    full = embed(server, encoding_format="base64").astype(np.float64)
    assert full.shape == (len(TEXTS), 768)
    lead = full[:, :dim]
    want = lead / np.sqrt((lead * lead).sum(axis=1, keepdims=True))
    got = embed(server, dimensions=dim, encoding_format=encoding)
    assert got.shape == want.shape
    diff = float(np.abs(got - want).max())
    assert diff <= 1e-6, f"dimensions={dim} ({encoding}): {diff:.2e} from v[:d] / |v[:d]| (1e-6)"
