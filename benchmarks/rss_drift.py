"""Probe (CPU): where does `eg2 serve`'s RSS settle under the reliability suite's mixed load, before
and after the idle server trims its heap?

    python -m benchmarks.rss_drift [--phases 4] [--requests 2000]     (from the repository root)

Serves the tiny demo checkpoint on the CPU with default settings, then drives it with
tests/reliability/test_reliability_load.py's mix (its requests, its checks, 128 clients): a first
phase of 1,000 requests, then `--phases` phases of `--requests` each. After each phase, once the
queues have drained, prints the server's RSS, how it splits over its mappings (file-backed, [heap],
anonymous: glibc's other arenas and large blocks), and the same once the idle server has trimmed
its heap (malloc_trim_idle_s, app/malloc.py). A leak grows with every phase whether trimmed or not;
freed memory kept by the allocator goes back at the trim.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from eg2_runtime.tools.demo_model import write_demo_model
from tests.reliability.test_reliability_load import (
    Reference,
    drained,
    phase,
    trimmed_rss_kb,
    trims,
)
from tests.support.load import Serve

FIRST_PHASE = 1000


def rss_by_mapping(pid: int) -> dict[str, int]:
    """kB resident per kind of mapping: "file", "anon", or the kernel's name ("[heap]", "[stack]")."""
    kb: dict[str, int] = {}
    kind = "anon"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header: range perms ... [path]
            path = fields[5] if len(fields) > 5 else ""
            kind = path if path.startswith("[") else ("file" if path else "anon")
        elif fields[0] == "Rss:":
            kb[kind] = kb.get(kind, 0) + int(fields[1])
    return {k: v for k, v in sorted(kb.items()) if v}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", type=int, default=4, help="phases after the first 1,000 requests")
    parser.add_argument("--requests", type=int, default=2000, help="requests per phase")
    args = parser.parse_args()

    model = write_demo_model(Path(tempfile.mkdtemp()), size="tiny", seed=0, dtype="bfloat16")
    reference = Reference(model).embed_every_item()
    serve = ["--model", str(model), "--device", "cpu", "--log-level", "warning", "--malloc-trim-idle-s", "1"]
    with Serve(serve) as server:
        server.wait_ready()
        done = 0
        for n in [FIRST_PHASE] + [args.requests] * args.phases:
            before = trims(server)
            phase(server, reference, done, n)
            done += n
            drained(server)
            print(
                f"after {done} requests: RSS {server.rss_kb()} kB {rss_by_mapping(server.proc.pid)}",
                flush=True,
            )
            rss = trimmed_rss_kb(server, before)
            print(f"  trimmed: RSS {rss} kB {rss_by_mapping(server.proc.pid)}", flush=True)


if __name__ == "__main__":
    main()
