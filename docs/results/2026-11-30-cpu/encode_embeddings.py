"""The response body's cost on the event loop: app.schemas.encode_embeddings (orjson) against the
stdlib json it replaced, for 1 and 32 unit vectors of 768 float32, both encodings.

    python docs/results/2026-11-30-cpu/encode_embeddings.py    (from the repository root)
"""

import base64
import json
import time

import numpy as np

from app.schemas import encode_embeddings


def stdlib(vectors: np.ndarray, encoding_format: str) -> bytes:
    """encode_embeddings up to 986f6dc."""
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


def us(fn, rounds: int = 200) -> tuple[float, int]:
    fn()
    t0 = time.perf_counter()
    for _ in range(rounds):
        out = fn()
    return 1e6 * (time.perf_counter() - t0) / rounds, len(out)


rng = np.random.default_rng(0)
for n in (1, 32):
    v = rng.standard_normal((n, 768)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    for fmt in ("float", "base64"):
        old, old_bytes = us(lambda: stdlib(v, fmt))
        new, new_bytes = us(lambda: encode_embeddings(v, encoding_format=fmt, model="m", num_tokens=5))
        print(f"{n:2d} x 768 {fmt:6s}: json {old:7.0f} us {old_bytes:7d} B | orjson {new:6.0f} us {new_bytes:7d} B")
