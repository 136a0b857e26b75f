"""Tools beside the hsdp library: benchmarks (``bench``), the step simulator (``sim``),
trace reports (``report``), the model zoo (``models``, ``models_moe``) and the demo.

They import :mod:`hsdp`; :mod:`hsdp` never imports them. The command line is
:mod:`hsdp_tools.cli` (``python -m hsdp`` or ``python -m hsdp_tools``).
``hsdp_tools.advise(model, mesh)`` (``advisor.py``) prices the outer axis's modes inside a
running job."""

from typing import Any


def __getattr__(name: str) -> Any:
    """``advise``, imported on first use (it pulls in the simulator)."""
    if name == "advise":
        from hsdp_tools.advisor import advise

        return advise
    raise AttributeError(f"module 'hsdp_tools' has no attribute {name!r}")
