"""Tools beside the hsdp library: benchmarks (``bench``), the step simulator (``sim``),
trace reports (``report``), the model zoo (``models``; ``models_moe`` with its token
exchange ``moe_exchange`` and its placement on a mesh ``moe_placement``) and the demo.

They import :mod:`hsdp`; :mod:`hsdp` never imports them. The command line is
:mod:`hsdp_tools.cli` (``python -m hsdp`` or ``python -m hsdp_tools``).
``hsdp_tools.advise(model, mesh)`` (``advisor.py``) prices the outer axis's modes inside a
running job; ``hsdp_tools.auto(model)`` chooses one at ``init_mesh`` / ``fully_shard``."""

from typing import Any


def __getattr__(name: str) -> Any:
    """``advise`` and ``auto``, imported on first use (they pull in the simulator)."""
    if name in ("advise", "auto"):
        from hsdp_tools import advisor

        return getattr(advisor, name)
    raise AttributeError(f"module 'hsdp_tools' has no attribute {name!r}")
