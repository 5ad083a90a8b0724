"""The layering rules, checked on the source: the runtime never imports the app nor transformers'
modeling code (transformers is the reference, in tests and in the benchmark's reference config only)."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "eg2_runtime"
# Reference-only imports allowed in the benchmarks, which time the reference on purpose.
BENCHMARKS = {"tools/bench_measure.py", "preprocess/bench.py"}


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_runtime_never_imports_the_app() -> None:
    offenders = {
        str(p.relative_to(RUNTIME)): sorted(n for n in imports(p) if n == "app" or n.startswith("app."))
        for p in RUNTIME.rglob("*.py")
    }
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_runtime_never_imports_transformers_modeling_code() -> None:
    found = {}
    for p in RUNTIME.rglob("*.py"):
        rel = str(p.relative_to(RUNTIME))
        names = [n for n in imports(p) if n.split(".")[0] in {"transformers", "sentence_transformers"}]
        if names and rel not in BENCHMARKS:
            found[rel] = names
        if any("modeling" in n for n in names):
            found[rel] = names
    assert not found, f"transformers imported by the runtime: {found}"
