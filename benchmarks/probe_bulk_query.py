"""A query behind a bulk request, over HTTP: how long the query waits (lab code).

Starts `eg2 serve` (the demo checkpoint unless --model is given), sends one bulk request (text cut
into many segments, each carrying a long prompt, so one request is many batches), then after
--after seconds a one-line query, and reports both latencies. The scenario is a hostile-input
audit's: one 17 KB body costing 1.85 M tokens held the CPU engine for a minute, and a query sent
behind it waited for all of it while the queue served requests first-in-first-out.

    python -m benchmarks.probe_bulk_query --out results.json [--model DIR] [--after 3]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.server_process import free_port, running, serve_command


def bulk_body(words: int, prompt_chars: int, span_tokens: int) -> dict[str, Any]:
    """One request of many segments: `words` two-token words, each span prefixed by the prompt."""
    return {
        "input": "hello world " * (words // 2),
        "prompt": "p" * prompt_chars,
        "segments": {"tokens": span_tokens},
    }


def timed_post(url: str, body: dict[str, Any], out: dict[str, Any], timeout: float) -> None:
    start = time.monotonic()
    try:
        r = httpx.post(url, json=body, timeout=timeout)
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = r.text[:300]
    except httpx.HTTPError as e:
        out["status"] = None
        out["error"] = repr(e)
    out["seconds"] = round(time.monotonic() - start, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", help="checkpoint directory (default: the demo checkpoint)")
    p.add_argument("--after", type=float, default=3.0, help="seconds between the bulk request and the query")
    p.add_argument("--words", type=int, default=1500)
    p.add_argument("--prompt-chars", type=int, default=8150)
    p.add_argument("--span-tokens", type=int, default=64)
    p.add_argument("--label", default="", help="a name for this run in the JSON (e.g. the commit)")
    args = p.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "EG2_HOST": "127.0.0.1", "EG2_PORT": str(port), "EG2_LOG_LEVEL": "warning"}
    if args.model:
        env["EG2_MODEL"] = args.model
    bulk: dict[str, Any] = {}
    query: dict[str, Any] = {}
    with running(serve_command(), env, url, ready_timeout=600):
        endpoint = f"{url}/v1/embeddings"
        body = bulk_body(args.words, args.prompt_chars, args.span_tokens)
        counted = httpx.post(f"{url}/tokenize", json=body, timeout=300).json()
        tokens = {"tokens": counted["usage"]["total_tokens"], "segments": len(counted["data"][0]["segments"])}
        sender = threading.Thread(target=timed_post, args=(endpoint, body, bulk, 300))
        sender.start()
        time.sleep(args.after)
        timed_post(endpoint, {"input": "a one-line query"}, query, 300)
        sender.join()
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    batches = [line for line in metrics.splitlines() if line.startswith("eg2_batch_size_count")]
    result = {
        "label": args.label,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "cores": os.cpu_count(),
        "bulk_request": {k: v for k, v in body.items() if k != "input"} | {"input_chars": len(body["input"])},
        "bulk_tokenize": tokens,
        "bulk": bulk,
        "query_sent_after_s": args.after,
        "query": query,
        "batches": batches,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"bulk": bulk, "query": query}))


if __name__ == "__main__":
    main()
