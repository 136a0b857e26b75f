"""Float8 training with torchao: converting a model before ``fully_shard``.

How hsdp then gathers the float8 weights: ``hsdp/sharding/float8_weights.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.nn as nn

log = logging.getLogger(__name__)

INSTALL = ("pip install 'hsdp[float8]' (torchao; beside a CUDA torch: pip install --no-deps "
           "torchao==0.18.0)")


def _dims_fit(module: nn.Linear, _fqn: str) -> bool:
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_float8(model: nn.Module, config: object | None = None,
                      module_filter_fn: Callable[[nn.Module, str], bool] | None = None
                      ) -> nn.Module:
    """torchao's ``convert_to_float8_training`` of ``model`` (before ``fully_shard``),
    leaving in high precision, and saying so in the log, every linear whose dims are not
    multiples of 16 (float8 matmuls need them; torchao's recipes and torchtitan leave
    them too) and those ``module_filter_fn`` refuses."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as exc:
        raise ImportError(f"hsdp: float8 training needs torchao: {INSTALL}") from exc

    skipped = []

    def keep(m: nn.Module, fqn: str) -> bool:
        if not isinstance(m, nn.Linear):
            return False
        ok = _dims_fit(m, fqn)
        if not ok:
            skipped.append(f"{fqn} ({m.in_features}x{m.out_features})")
        return ok and (module_filter_fn is None or module_filter_fn(m, fqn))

    model = convert_to_float8_training(model, config=config, module_filter_fn=keep)
    if skipped:
        log.info("hsdp float8: %d linear(s) left in high precision (dims not multiples of "
                 "16): %s", len(skipped), ", ".join(skipped))
    return model
