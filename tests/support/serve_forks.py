"""Servers, many times, for the price of one import: this process imports the server (torch
included, seconds on a busy CI core) once, then forks a child per server. Each child runs its entry
point exactly as its script does, `sys.exit(main(argv))`, exit path and interpreter finalization
included: `eg2` is the console script (app.cli.main), `fake` is tests/support/fake_engine.py. Nothing here
runs a torch op before forking, so each child starts from a clean runtime (PyTorch's own data
loaders fork the same way).

    python tests/support/serve_forks.py        commands on stdin, one JSON object a line, one answer each:
      {"start": [ARGS...], "entry": "eg2"|"fake", "env": {...}, "log": PATH}
                                         -> {"pid": N}       the child's stderr goes to PATH
      {"poll": N}                        -> {"status": S}    None while it runs; else as Popen.returncode
                                                            (-6: killed by SIGABRT)

`Forks` drives it from a test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _serve_child(command: dict[str, Any]) -> None:
    err = os.open(command["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(err, 2)
    os.environ.update(command.get("env", {}))
    if command.get("entry", "eg2") == "eg2":
        from app.cli import main
    else:
        from fake_engine import main
    sys.exit(main(command["start"]))  # as the scripts: SystemExit, then the interpreter finalizes


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _main() -> None:
    sys.path.insert(0, str(REPO))
    import fake_engine  # noqa: F401

    import app.cli
    import app.server  # noqa: F401  (torch, uvicorn, the runtime: what a start pays for)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "start" in command:
            pid = os.fork()
            if pid == 0:
                _serve_child(command)
            answer: dict[str, Any] = {"pid": pid}
        else:
            done, status = os.waitpid(command["poll"], os.WNOHANG)
            answer = {"status": _returncode(status) if done else None}
        print(json.dumps(answer), flush=True)


class Forks:
    """The fork server in a subprocess; thread-safe."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("EG2_")}
        full_env.update({"HF_HUB_OFFLINE": "1", **(env or {})})
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            cwd=REPO,
            env=full_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lock = threading.Lock()
        self._running: set[int] = set()
        assert self.proc.stdout is not None
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def _ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self._lock:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
            return dict(json.loads(self.proc.stdout.readline()))

    def start(
        self, argv: Sequence[str], log: Path, *, entry: str = "eg2", env: dict[str, str] | None = None
    ) -> int:
        command = {"start": list(argv), "entry": entry, "env": env or {}, "log": str(log)}
        pid = int(self._ask(command)["pid"])
        self._running.add(pid)
        return pid

    def poll(self, pid: int) -> int | None:
        status = self._ask({"poll": pid})["status"]
        if status is None:
            return None
        self._running.discard(pid)
        return int(status)

    def wait(self, pid: int, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while (status := self.poll(pid)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return status

    def close(self) -> None:
        """Kill what still runs (a test that failed half-way), then the fork server."""
        for pid in list(self._running):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.wait(pid, 10)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


if __name__ == "__main__":
    _main()
