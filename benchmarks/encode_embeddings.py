"""The response body's cost on the event loop: app.schemas.encode_embeddings (orjson) against the
standard library's json, for 1 and 32 unit vectors of 768 float32, both encodings.

    python -m benchmarks.encode_embeddings     (from the repository root)
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from app.schemas import encode_embeddings


def stdlib(vectors: np.ndarray, encoding_format: str) -> bytes:
    """The same body through the standard library's json: the baseline orjson replaced."""
    rows: list[object]
    if encoding_format == "base64":
        rows = [base64.b64encode(r.tobytes()).decode("ascii") for r in np.ascontiguousarray(vectors, "<f4")]
    else:
        rows = vectors.astype(np.float32, copy=False).tolist()
    body = {
        "object": "list",
        "model": "m",
        "data": [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)],
        "usage": {"prompt_tokens": 5, "total_tokens": 5},
    }
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def us(fn: Callable[[], bytes], rounds: int = 200) -> tuple[float, int]:
    """(microseconds per call, bytes of the body)."""
    out = fn()
    t0 = time.perf_counter()
    for _ in range(rounds):
        out = fn()
    return 1e6 * (time.perf_counter() - t0) / rounds, len(out)


def main() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 32):
        v = rng.standard_normal((n, 768)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        for fmt in ("float", "base64"):
            old, old_bytes = us(partial(stdlib, v, fmt))
            new, new_bytes = us(partial(encode_embeddings, v, encoding_format=fmt, model="m", num_tokens=5))
            print(
                f"{n:2d} x 768 {fmt:6s}: json {old:7.0f} us {old_bytes:7d} B | "
                f"orjson {new:6.0f} us {new_bytes:7d} B"
            )


if __name__ == "__main__":
    main()
