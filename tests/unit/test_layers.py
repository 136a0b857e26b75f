"""The core runtime stands alone: the tools (simulator, bench, reports) plug their streams
and collectives into it through public hooks, and it imports none of them; inside the core,
lower layers never import higher ones."""

import ast
import inspect
from pathlib import Path

import hsdp
from hsdp.bench.emulate import DelayedCollectives
from hsdp.runtime.stream_set import Streams
from hsdp.runtime.streams import SIDE_NAMES
from hsdp.sharding.comm import Collectives
from hsdp.sim.clock import VirtualBackend, VirtualCompute, VirtualSideStream
from hsdp.sim.engine import RecordedCollectives

TOOLS = ("hsdp.sim", "hsdp.bench", "hsdp.report")
ROOT = Path(hsdp.__file__).parent
CORE = [p for p in ROOT.glob("*.py") if p.stem not in ("__main__", "demo")] + [
    p for pkg in ("runtime", "sharding", "checkpoint", "ft") for p in (ROOT / pkg).glob("*.py")]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # from a package import a module
    return out


# Lowest first; a module may import modules of its own layer or lower ones. The longest
# matching name decides (``hsdp.runtime.streams`` before ``hsdp.runtime``).
LAYERS = [
    ("hsdp.policy", "hsdp.hosts", "hsdp.models", "hsdp.runtime.consensus", "hsdp.ft.errors",
     "hsdp.ft.transport", "hsdp.ft.outer"),
    ("hsdp.mesh",),
    ("hsdp.runtime.streams", "hsdp.runtime.ops"),  # the stream contract, the op table
    ("hsdp.runtime.cpu", "hsdp.runtime.cuda", "hsdp.sharding.layout", "hsdp.sharding.comm"),
    ("hsdp.runtime.stream_set", "hsdp.runtime.agreement", "hsdp.runtime.teardown",
     "hsdp.sharding"),
    ("hsdp.runtime",),  # the schedule and everything that drives it
    ("hsdp.checkpoint", "hsdp.module", "hsdp.materialize", "hsdp.ft.replica_state"),
    ("hsdp.api", "hsdp"),
]


def _layer(module: str) -> int | None:
    """The layer of ``module`` (a module of the core, or a name imported from one)."""
    best, layer = "", None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, layer = name, i
    return layer


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_lower_layers_never_import_higher_ones():
    for path in CORE:
        me = _module(path)
        mine = _layer(me)
        assert mine is not None, me
        for imported in _imports(path):
            if (ROOT.parent / imported.replace(".", "/") / "__init__.py").exists():
                continue  # a package: the modules imported from it are checked
            theirs = _layer(imported) if imported.startswith("hsdp") else None
            assert theirs is None or theirs <= mine, f"{me} imports {imported}"


def test_core_imports_no_tool_and_tools_plug_in():
    assert CORE
    for path in CORE:
        assert not {m for m in _imports(path) if m.startswith(TOOLS)}, path.name
    # the simulator's streams come through the public backend contract
    backend = VirtualBackend()
    s = Streams.of(backend)
    assert isinstance(s.compute, VirtualCompute)
    assert [type(x) for x in s.side()] == [VirtualSideStream] * len(SIDE_NAMES)
    assert [x.name for x in s.side()] == list(SIDE_NAMES)
    # the real collectives take no tool's arguments; emulation and recording override
    # their public hook
    assert not inspect.signature(Collectives).parameters
    for tool in (DelayedCollectives, RecordedCollectives):
        assert tool.before is not Collectives.before
