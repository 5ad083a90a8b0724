"""The repository refers to nothing outside itself: a fresh clone holds every file its code, tests and
docs point at.

Three checks over every tracked text file:
- no path into a sibling checkout (the development machine's shared reference folder);
- every upper-case document name (`API.md`, `docs/FORMAT.md`) names a file the repository holds;
- every relative Markdown link resolves to a file or folder inside the repository.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Written in pieces so this file does not match itself.
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", "/work/" + "shared", r"\bshared/[A-Z]+\.md"]))
DOC_NAME = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[A-Z][A-Z0-9_]*\.md)\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
SKIP_DIRS = {".git", ".venv", "node_modules", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".whl"}


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
        ).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):  # a source tree without git: walk it
        names = [
            str(p.relative_to(REPO))
            for p in REPO.rglob("*")
            if p.is_file() and not SKIP_DIRS & set(p.relative_to(REPO).parts)
        ]
    return [REPO / n for n in names if (REPO / n).is_file()]


def text_of(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None  # binary


@pytest.fixture(scope="module")
def texts() -> dict[Path, str]:
    out = {}
    for path in tracked_files():
        text = text_of(path)
        if text is not None:
            out[path] = text
    assert len(out) > 50, f"only {len(out)} text files found under {REPO}"
    return out


def where(path: Path, text: str, pos: int) -> str:
    return f"{path.relative_to(REPO)}:{text.count(chr(10), 0, pos) + 1}"


def test_no_path_outside_the_repository(texts: dict[Path, str]) -> None:
    found = [f"{where(p, t, m.start())}: {m.group(0)}" for p, t in texts.items() for m in OUTSIDE.finditer(t)]
    assert not found, "references outside the repository:\n" + "\n".join(found)


def test_every_document_named_is_in_the_repository(texts: dict[Path, str]) -> None:
    held = {p.relative_to(REPO).as_posix() for p in texts} | {
        p.relative_to(REPO).as_posix() for p in tracked_files()
    }
    basenames = {h.rsplit("/", 1)[-1] for h in held}
    missing = []
    for path, text in texts.items():
        for m in DOC_NAME.finditer(text):
            name = m.group(1)
            if "/" in name:
                here = (path.parent / name).resolve()
                ok = name in held or (here.is_relative_to(REPO) and here.relative_to(REPO).as_posix() in held)
            else:
                ok = name in basenames
            if not ok:
                missing.append(f"{where(path, text, m.start())}: {name}")
    assert not missing, "documents named but not in the repository:\n" + "\n".join(missing)


def test_every_relative_markdown_link_resolves(texts: dict[Path, str]) -> None:
    broken = []
    for path, text in texts.items():
        if path.suffix != ".md":
            continue
        for m in LINK.finditer(text):
            target = m.group(1).split("#", 1)[0]
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # an anchor, or a URL
                continue
            resolved = (REPO / target.lstrip("/")) if target.startswith("/") else (path.parent / target)
            resolved = resolved.resolve()
            if not resolved.is_relative_to(REPO) or not resolved.exists():
                broken.append(f"{where(path, text, m.start())}: {m.group(1)}")
    assert not broken, "Markdown links that leave the repository or lead nowhere:\n" + "\n".join(broken)


def test_the_readme_is_a_front_door() -> None:
    """At most 10 KB: what it is and why, the two commands, a call per modality, Docker and links;
    measurements, tables and history live in docs/."""
    size = len((REPO / "README.md").read_bytes())
    assert size <= 10 * 1024, f"README.md is {size:,} bytes: move the detail into docs/"
