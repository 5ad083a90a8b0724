"""The EmbeddingGemma 2 runtime: checkpoint loading, preprocessing, the model and the Engine the
service calls. It knows nothing of HTTP.

`__version__` is pyproject.toml's version, the one place it is written: read from the installed
package's metadata, or, in a source tree that was never installed (`PYTHONPATH=$PWD` on a GPU host),
from the pyproject.toml beside this package, marked `+source`.
"""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def _version() -> str:
    try:
        return version("eg2-serve")
    except PackageNotFoundError:
        pass
    try:
        pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
        return f"{pyproject['project']['version']}+source"
    except (OSError, KeyError, ValueError):
        return "0+unknown"


__version__ = _version()
