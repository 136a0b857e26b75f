"""The core stays readable: no file of its folders over 400 lines, no class over 300, no
function over 60."""

import ast
from pathlib import Path

import hsdp

ROOT = Path(hsdp.__file__).parent
LIMITS = {"file": 400, "class": 300, "function": 60}


def _oversized(path: Path) -> list[str]:
    text = path.read_text()
    out = []
    if len(text.splitlines()) > LIMITS["file"]:
        out.append(f"{path.name}: {len(text.splitlines())} lines")
    for node in ast.walk(ast.parse(text)):
        kind = ("class" if isinstance(node, ast.ClassDef) else "function"
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
        if kind is not None and node.end_lineno - node.lineno + 1 > LIMITS[kind]:
            out.append(f"{path.name}: {kind} {node.name}, {node.end_lineno - node.lineno + 1}")
    return out


def test_core_sizes():
    files = [p for pkg in ("ft", "topology", "streams", "sharding", "runtime", "checkpoint")
             for p in (ROOT / pkg).glob("*.py")]
    assert len(files) > 10
    assert [line for p in sorted(files) for line in _oversized(p)] == []
