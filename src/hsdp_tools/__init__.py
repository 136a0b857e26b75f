"""Tools beside the hsdp library: benchmarks (``bench``), the step simulator (``sim``),
trace reports (``report``), the model zoo (``models``; ``models_moe`` with its token
exchange ``moe_exchange`` and its placement on a mesh ``moe_placement``) and the demo.

They import :mod:`hsdp`; :mod:`hsdp` never imports them. The command line is
:mod:`hsdp_tools.cli` (``python -m hsdp`` or ``python -m hsdp_tools``)."""
