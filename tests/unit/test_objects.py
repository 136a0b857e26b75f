"""Objects own their state: no class of the runtime or sharding packages is assembled from
several hsdp classes (mixins), and none reads ``self.<name>`` that it does not define
itself (assigned in a method, a class-level name such as a dataclass field, a method or
a property), inherit from its one hsdp base, or inherit from a class outside hsdp. A write
through an object it holds (``self.ctx.step.phase = ...``, ``step.gave_up = True`` after
``step = self.ctx.step``, ``self.ctx.log.forwards += 1``, ``self.ctx.step.reduced.append``)
counts as a read of state it does not own: the holder's own methods change it. Code
outside ``sharding/`` calls a parameter group's methods and never reaches into its parts
(``g.grads.used``, ``g.gather.unshard(...)``, ``g.buffers.version()``)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import torch

import hsdp

ROOT = Path(hsdp.__file__).parent
PACKAGES = ("runtime", "sharding")
GROUP_PARTS = ("grads", "gather", "buffers")  # a ParamGroup's parts (sharding/group.py)


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


TORCH_FIELDS = set(dir(torch.Tensor))  # p.grad = ...: torch's API for a tensor's fields
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "add", "discard",
            "update", "setdefault"}


def _chain(node: ast.AST, aliases: dict[str, int]) -> int | None:
    """How many attributes below ``self`` ``node`` is (``self.a.b``: 2; a local name bound
    to ``self.a``: 1), None if it is not reached from ``self``."""
    depth = 0
    while isinstance(node, ast.Attribute):
        node, depth = node.value, depth + 1
    if isinstance(node, ast.Name):
        if node.id == "self":
            return depth
        if node.id in aliases:
            return depth + aliases[node.id]
    return None


def _aliases(func: ast.AST) -> dict[str, int]:
    """Local names bound to objects reached from ``self`` (``ctx = self.ctx``, ``ctx, step =
    self.ctx, self.ctx.step``, ``for g in self.groups``), with their depth below ``self``."""
    out: dict[str, int] = {}
    for node in ast.walk(func):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            depth = _chain(node.iter, out)
            if depth:  # an element of a held list is held one level further down
                out[node.target.id] = depth + 1
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = ([(target, node.value)] if isinstance(target, ast.Name) else
                     list(zip(target.elts, node.value.elts))
                     if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                     else [])
            for name, value in pairs:
                depth = _chain(value, out) if isinstance(name, ast.Name) else None
                if depth:
                    out[name.id] = depth
    return out


def _foreign_writes(cls: ast.ClassDef) -> list[str]:
    """Writes into objects ``cls`` holds rather than into itself: stores, augmented
    stores and deletes of ``<held>.<name>`` and ``<held>[...]``, and list / set / dict
    mutators called on a held object's field."""
    out = []
    for func in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        aliases = _aliases(func)
        for node in ast.walk(func):
            if isinstance(node, (ast.Attribute, ast.Subscript)) \
                    and isinstance(node.ctx, (ast.Store, ast.Del)):
                depth = _chain(node.value, aliases)  # self.x[k] = v: its own container
                if getattr(node, "attr", None) in TORCH_FIELDS:
                    continue
                if depth is not None and depth >= 1 + isinstance(node, ast.Subscript):
                    out.append(ast.unparse(node))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in MUTATORS:
                depth = _chain(node.func.value, aliases)
                if depth is not None and depth >= 3 - (
                        isinstance(node.func.value, ast.Name)
                        and node.func.value.id in aliases):
                    out.append(ast.unparse(node.func))
    return sorted(set(out))


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
    return [f"{where}: {cls.__name__} reads self.{n}, defined elsewhere" for n in unknown] + [
        f"{where}: {cls.__name__} writes {w}, state it does not own"
        for w in _foreign_writes(node)]


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


def test_the_check_sees_writes_through_a_shared_context():
    """The check itself: writes into a held object's fields, direct or through a local
    name, count; the holder's methods and the class's own containers do not."""
    tree = ast.parse(
        "class S:\n"
        "    def __init__(self, ctx):\n"
        "        self.ctx, self.own, self.table = ctx, [], {}\n"
        "    def f(self):\n"
        "        self.ctx.step.phase = 1\n"
        "        self.ctx.log.forwards += 1\n"
        "        ctx, step = self.ctx, self.ctx.step\n"
        "        ctx.broken = 'x'\n"
        "        step.reduced.append(2)\n"
        "        self.ctx.step.pending.clear()\n"
        "        self.ctx.log.add(3)\n"
        "        self.ctx.step.begin_backward()\n"
        "        self.own.append(4)\n"
        "        self.table[1] = 2\n"
        "        self.n = 5\n"
        "        for u in self.ctx.units:\n"
        "            u.done = True\n")
    node = tree.body[0]
    cls = type("S", (), {"__module__": "hsdp.x"})
    assert [p.split("writes ")[1].split(",")[0] for p in _problems("x.py", cls, node)] == [
        "ctx.broken", "self.ctx.log.forwards", "self.ctx.step.pending.clear",
        "self.ctx.step.phase", "step.reduced.append", "u.done"]


def _reach_throughs(tree: ast.AST, where: str) -> list[str]:
    """``x.grads.y``, ``x.gather.y`` and ``x.buffers.y`` with ``x`` not ``self``: code
    reaching through another object's parameter group into its parts."""
    return sorted(f"{where}:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                  and node.value.attr in GROUP_PARTS
                  and not (isinstance(node.value.value, ast.Name)
                           and node.value.value.id == "self"))


def test_no_code_outside_sharding_reaches_into_a_group():
    """Outside ``sharding/`` (the rest of the core, the API, the tools) a group is used
    through its methods (``g.unshard``, ``g.copy_in``, ``g.full_flat``...), so that
    each part's state has one user: the group. No exception is allowed."""
    files = [p for base in (ROOT, ROOT.parent / "hsdp_tools") for p in sorted(base.rglob("*.py"))
             if p.relative_to(ROOT.parent).parts[:2] != ("hsdp", "sharding")]
    assert len(files) > 50
    assert [r for p in files for r in _reach_throughs(
        ast.parse(p.read_text()), p.relative_to(ROOT.parent).as_posix())] == []


def test_the_check_sees_a_reach_through():
    """The check itself: a part of another object's group, followed by a name, counts;
    the group's own methods, a class's own parts and a bare part do not."""
    tree = ast.parse("def f(self, g, ctx):\n"
                     "    g.grads.copy_in()\n"
                     "    ctx.groups[0].gather.unshard(1)\n"
                     "    x = g.buffers.version() + self.gather.n\n"
                     "    g.unshard()\n"
                     "    return g.grads is None\n")
    assert _reach_throughs(tree, "x.py") == [
        "x.py:2: g.grads.copy_in", "x.py:3: ctx.groups[0].gather.unshard",
        "x.py:4: g.buffers.version"]
