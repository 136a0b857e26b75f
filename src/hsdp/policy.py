"""User-facing policies (pure)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

STRATEGIES = ("hsdp", "hfsdp")


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: dtype of the gathered parameters used by compute.
    ``reduce_dtype``: dtype of the gradient reduce-scatter / all-reduce (default: param_dtype).
    Main weights, gradients handed to the optimizer and optimizer state keep the
    parameters' original dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def resolve(self, orig: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """(param_dtype, reduce_dtype) for a group whose parameters are ``orig``."""
        if not orig.is_floating_point:
            return orig, orig
        param = self.param_dtype or orig
        return param, self.reduce_dtype or param


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
