"""Run a script under Triton's CPU interpreter, for the kernel tests that CI runs without a GPU.

TRITON_INTERPRET=1 must be set before triton is imported, hence a subprocess. The script prints
"ok" when every check in it held.
"""

from __future__ import annotations

import os
import subprocess
import sys


def assert_ok_in_interpreter(script: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
