"""The service's base64 (pybase64, SIMD) against the standard library's, the reference: media payloads
decode to the same bytes and are refused in the same cases; embedding rows encode to the same text."""

from __future__ import annotations

import base64
import binascii
import os

import numpy as np
import pytest

from app.media import _b64
from app.schemas import base64_rows
from eg2_runtime.errors import MediaDecodeError

VALID = base64.b64encode(os.urandom(3000)).decode()
PAYLOADS = [
    VALID,
    VALID[:-4] + "YQ==",  # padded
    VALID[:-4] + "YWI=",
    "YQ",  # unpadded
    "YQ==YQ==",  # padding mid-stream
    "ab=c",
    "====",
    "YWJj\n",  # a newline: the strict check refuses what the lenient one would skip
    "YW Jj",
    "YWJj" * 1000 + "-_",  # the URL-safe alphabet is not this one
    "YWJjé",  # non-ASCII
    "",
]


def _stdlib(data: str) -> bytes | None:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw or None  # an empty payload is refused too


@pytest.mark.parametrize("data", PAYLOADS, ids=range(len(PAYLOADS)))
def test_media_payloads_decode_as_the_standard_library_decodes_them(data: str) -> None:
    expected = _stdlib(data)
    if expected is None:
        with pytest.raises(MediaDecodeError):
            _b64(data, "input")
    else:
        assert _b64(data, "input") == expected


@pytest.mark.parametrize(
    ("n", "k", "dtype"),
    [(1, 768, np.float32), (64, 768, np.float32), (5, 512, np.float32), (9, 768, np.int8), (3, 96, np.uint8)],
)
def test_rows_encode_as_the_standard_library_encodes_them(n: int, k: int, dtype: type) -> None:
    rows = (np.random.default_rng(0).standard_normal((n, k)) * 50).astype(dtype)
    assert base64_rows(rows) == [base64.b64encode(r.tobytes()).decode("ascii") for r in rows]
