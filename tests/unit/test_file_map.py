"""docs/design.md's file map names every module of both packages, the library and its tools
(and only existing ones)."""

import re
from pathlib import Path

import hsdp
import hsdp_tools

ROOT = Path(hsdp.__file__).parent
TOOLS = Path(hsdp_tools.__file__).parent
DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def _file_map() -> str:
    text = DESIGN.read_text()
    return text[text.index("## File map"):text.index("## Words")]


def test_every_module_is_in_the_file_map():
    named = re.findall(r"`([\w/]+\.py)`", _file_map())
    listed = {m for m in named if not m.startswith("tests/")}
    modules = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
               if p.name != "__init__.py" or p.parent == ROOT}
    modules |= {p.relative_to(TOOLS.parent).as_posix() for p in TOOLS.rglob("*.py")
                if p.name != "__init__.py" or p.parent == TOOLS}
    assert not modules - listed, f"missing from docs/design.md's file map: {modules - listed}"
    assert not listed - modules, f"the file map names modules that do not exist: {listed - modules}"
