"""The core runtime stands alone: the tools (simulator, bench, reports) plug their streams
and collectives into it through public hooks, and it imports none of them; inside the core,
each folder is one layer and no import goes up."""

import ast
import inspect
from pathlib import Path

import hsdp
from hsdp.sharding.comm import Collectives
from hsdp.streams.contract import SIDE_NAMES
from hsdp.streams.stream_set import Streams
from hsdp_tools.bench.emulate import DelayedCollectives
from hsdp_tools.sim.clock import VirtualBackend, VirtualCompute, VirtualSideStream
from hsdp_tools.sim.engine import RecordedCollectives

TOOLS = ("hsdp_tools",)
ROOT = Path(hsdp.__file__).parent
CORE = [p for p in ROOT.glob("*.py") if p.stem != "__main__"] + [
    p for pkg in ("ft", "topology", "streams", "sharding", "runtime", "checkpoint")
    for p in (ROOT / pkg).glob("*.py")]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # from a package import a module
    return out


# The core's folders, lowest first; a module imports modules of its own folder or lower
# ones. The top-level modules (the public API: ``api``, ``module``, ``materialize``,
# ``float8``, ``clip``, ``pipelining``) sit above every folder.
FOLDERS = ["ft", "topology", "streams", "sharding", "runtime", "checkpoint"]
API = len(FOLDERS)


def _layer(module: str) -> int:
    """The layer of ``module``, a module of the core (or a name imported from one)."""
    parts = module.split(".")
    return FOLDERS.index(parts[1]) if len(parts) > 1 and parts[1] in FOLDERS else API


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_lower_layers_never_import_higher_ones():
    for path in CORE:
        me = _module(path)
        mine = _layer(me)
        for imported in _imports(path):
            if (ROOT.parent / imported.replace(".", "/") / "__init__.py").exists():
                continue  # a package: the modules imported from it are checked
            if imported.startswith("hsdp."):
                assert _layer(imported) <= mine, f"{me} imports {imported}"


def test_core_imports_no_tool_and_tools_plug_in():
    assert CORE
    for path in CORE:
        assert not {m for m in _imports(path) if m.startswith(TOOLS)}, path.name
    # ``python -m hsdp`` hands over to the tools' command line and does nothing else
    assert _imports(ROOT / "__main__.py") == {"sys", "hsdp_tools.cli", "hsdp_tools.cli.main"}
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
