"""The core runtime stands alone: the tools (simulator, bench, reports) plug their streams
and collectives into it through public hooks, and it imports none of them."""

import ast
import inspect
from pathlib import Path

import hsdp
from hsdp.bench.emulate import DelayedCollectives
from hsdp.runtime.streams import SIDE_NAMES, Streams
from hsdp.sharding.comm import Collectives
from hsdp.sim.clock import VirtualBackend, VirtualCompute, VirtualSideStream
from hsdp.sim.engine import RecordedCollectives

TOOLS = ("hsdp.sim", "hsdp.bench", "hsdp.report")
ROOT = Path(hsdp.__file__).parent
CORE = [p for p in ROOT.glob("*.py") if p.stem not in ("__main__", "demo")] + [
    p for pkg in ("runtime", "sharding", "checkpoint") for p in (ROOT / pkg).glob("*.py")]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


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
