"""User-facing policies (pure)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

STRATEGIES = ("hsdp", "hfsdp")


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: dtype of the gathered parameters used by compute.
    ``reduce_dtype``: dtype of the gradient reduce-scatter / all-reduce (default: param_dtype).
    ``output_dtype``: the unit's floating-point outputs are cast to it (default: as computed).
    ``cast_forward_inputs``: the unit's floating-point inputs are cast to ``param_dtype``
    (as FSDP2's ``MixedPrecisionPolicy``, on by default).
    Main weights, gradients handed to the optimizer and optimizer state keep the
    parameters' original dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @property
    def input_dtype(self) -> torch.dtype | None:
        """What the unit's floating-point inputs are cast to (None: left as they are)."""
        return self.param_dtype if self.cast_forward_inputs else None

    def resolve(self, orig: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """(param_dtype, reduce_dtype) for a group whose parameters are ``orig``."""
        if not orig.is_floating_point:
            return orig, orig
        param = self.param_dtype or orig
        return param, self.reduce_dtype or param


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
