"""The framework's floor: uvicorn and FastAPI as `eg2 serve` runs them (libuv's loop, the llhttp parser,
no access log), one POST route that reads the body, validates it with a minimal pydantic model and
answers a fixed one-vector OpenAI body (base64, 768 floats). No middleware, no batcher, no engine.

    python -m benchmarks.bare_server PORT        (started by benchmarks/server_cpu.py --floor)

What a request costs here is what no change to this service's own code can remove.
"""

from __future__ import annotations

import base64
import json
import sys

import numpy as np
import uvicorn
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel

app = FastAPI(docs_url=None, redoc_url=None)
VECTOR = base64.b64encode(np.full(768, 0.036, dtype=np.float32).tobytes()).decode()
BODY = json.dumps(
    {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": VECTOR}],
        "model": "eg2",
        "usage": {"prompt_tokens": 8, "total_tokens": 8},
    }
).encode()


class Body(BaseModel):
    model: str | None = None
    input: str | list[str]
    encoding_format: str = "float"


@app.get("/ready")
async def ready() -> dict[str, str]:
    return {"status": "ready"}


@app.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    Body.model_validate_json(await request.body())
    return Response(BODY, media_type="application/json")


if __name__ == "__main__":
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )
