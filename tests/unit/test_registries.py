"""Module-level state of the core: every mutable container at module level (a registry,
a cache, a counter) says in a comment above it why it must be process-wide
("# Process-wide: ..."); anything else belongs to an object."""

import ast
import re
from pathlib import Path

import hsdp

ROOT = Path(hsdp.__file__).parent
_CONTAINER = re.compile(r"(dict|list|set|WeakKeyDictionary|WeakValueDictionary|WeakSet|"
                        r"defaultdict|count|OrderedDict|deque)$")
_MUTATORS = {"append", "add", "clear", "update", "setdefault", "pop", "discard", "remove",
             "extend", "insert", "popitem"}


def _mutated(tree: ast.Module, name: str) -> bool:
    for n in ast.walk(tree):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and isinstance(n.func.value, ast.Name) and n.func.value.id == name
                and n.func.attr in _MUTATORS):
            return True
        targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else (
            [n.target] if isinstance(n, ast.AugAssign) else [])
        if any(isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
               and t.value.id == name for t in targets):
            return True
    return False


def _registries(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    out = []
    for node in tree.body:
        target = (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1
                  else node.target if isinstance(node, ast.AnnAssign) and node.value else None)
        if not isinstance(target, ast.Name) or target.id == "__all__":
            continue
        value = node.value
        literal = isinstance(value, (ast.Dict, ast.List, ast.Set))
        call = isinstance(value, ast.Call) and _CONTAINER.search(ast.unparse(value.func))
        weak = call and ("Weak" in ast.unparse(value.func) or "count" in ast.unparse(value.func))
        if (literal or call) and (weak or _mutated(tree, target.id)):
            out.append((target.id, node.lineno))
    return out


def _justified(lines: list[str], lineno: int) -> bool:
    """A "# Process-wide:" comment in the block of comments and assignments above."""
    i = lineno - 1
    while i >= 0 and lines[i].strip() and not lines[i].startswith((" ", "def ", "class ")):
        if lines[i].startswith("# Process-wide:"):
            return True
        i -= 1
    return False


def test_every_module_level_registry_says_why_it_is_process_wide():
    core = [p for p in ROOT.rglob("*.py") if p.name != "__main__.py"]
    found, unjustified = [], []
    for path in core:
        lines = path.read_text().splitlines()
        for name, lineno in _registries(path):
            found.append(name)
            if not _justified(lines, lineno):
                unjustified.append(f"{path.relative_to(ROOT)}:{lineno} {name}")
    assert len(found) > 10  # the scan finds them
    assert unjustified == []
