"""Objects own their state: no class of the runtime or sharding packages is assembled from
several hsdp classes (mixins), and none reads ``self.<name>`` that it does not define
itself (assigned in a method, a class-level name such as a dataclass field, a method or
a property), inherit from its one hsdp base, or inherit from a class outside hsdp."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import hsdp

ROOT = Path(hsdp.__file__).parent
PACKAGES = ("runtime", "sharding")


def _self_nodes(cls: ast.ClassDef) -> list[ast.Attribute]:
    """Every ``self.<name>`` in ``cls``'s methods (closures included, nested classes not)."""
    out, todo = [], [n for n in cls.body if not isinstance(n, ast.ClassDef)]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            out.append(node)
        todo.extend(n for n in ast.iter_child_nodes(node) if not isinstance(n, ast.ClassDef))
    return out


def _defined(cls: ast.ClassDef) -> set[str]:
    """Names ``cls`` itself defines: class-level names and ``self.<name>`` stores."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    names.update(a.attr for a in _self_nodes(cls) if isinstance(a.ctx, (ast.Store, ast.Del)))
    return names


def _class_def(cls: type) -> ast.ClassDef:
    tree = ast.parse(Path(inspect.getfile(cls)).read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                and n.name == cls.__name__)


def _is_hsdp(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "hsdp"


def _classes() -> list[tuple[str, type, ast.ClassDef]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).glob("*.py")):
            module = importlib.import_module(f"hsdp.{pkg}.{path.stem}")
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    out.append((f"{pkg}/{path.name}", getattr(module, node.name), node))
    return out


def _problems(where: str, cls: type, node: ast.ClassDef) -> list[str]:
    hsdp_bases = [b for b in cls.__bases__ if _is_hsdp(b)]
    if len(hsdp_bases) > 1:
        return [f"{where}: {cls.__name__} mixes {[b.__name__ for b in hsdp_bases]}"]
    known = _defined(node)
    for base in cls.__mro__[1:]:
        known |= _defined(_class_def(base)) if _is_hsdp(base) else set(dir(base))
    unknown = sorted({a.attr for a in _self_nodes(node) if isinstance(a.ctx, ast.Load)} - known)
    return [f"{where}: {cls.__name__} reads self.{n}, defined elsewhere" for n in unknown]


def test_no_class_reads_state_it_does_not_own():
    classes = _classes()
    assert len(classes) > 20
    assert [p for c in classes for p in _problems(*c)] == []


def test_the_check_sees_a_mixin():
    """The check itself: a mixin reading its host's state, and a class of two mixins."""
    tree = ast.parse("class M:\n    def f(self):\n        return self.buf + self.g()\n"
                     "    def g(self):\n        self.n = 1\n        return self.n\n")
    node = tree.body[0]
    mixin = type("M", (), {"__module__": "hsdp.x"})
    assert _problems("x.py", mixin, node) == ["x.py: M reads self.buf, defined elsewhere"]
    both = type("B", (mixin, type("N", (), {"__module__": "hsdp.y"})), {})
    assert _problems("x.py", both, node)[0].startswith("x.py: B mixes ['M', 'N']")
