"""The framework's floor: uvicorn (and FastAPI) as `eg2 serve` runs them (libuv's loop, the llhttp parser,
no access log), one POST route that reads the body, validates it with a minimal pydantic model and
answers a fixed one-vector OpenAI body (base64, 768 floats). No middleware, no batcher, no engine.

    python benchmarks/bare_server.py PORT [--raw]        (started by benchmarks/server_cpu.py --floor)

--raw serves the same answer from a bare ASGI callable instead of a FastAPI route: the difference is
what FastAPI's request handling costs. What a request costs here is what no change to this service's
own code can remove.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel

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


app = FastAPI(docs_url=None, redoc_url=None)


@app.get("/ready")
async def ready() -> dict[str, str]:
    return {"status": "ready"}


@app.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    Body.model_validate_json(await request.body())
    return Response(BODY, media_type="application/json")


async def raw_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The same two routes as a bare ASGI callable."""
    if scope["type"] != "http":
        return
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    if scope["path"] == "/v1/embeddings":
        Body.model_validate_json(b"".join(chunks))
        out = BODY
    else:
        out = b'{"status":"ready"}'
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": out})


if __name__ == "__main__":
    uvicorn.run(
        raw_app if "--raw" in sys.argv[2:] else app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )
