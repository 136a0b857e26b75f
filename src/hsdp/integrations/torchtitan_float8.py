"""torchtitan's float8 converter with hsdp's float8 all-gather (needs ``hsdp[float8]``).

torchtitan 0.3.0's ``Float8LinearConverter`` (``recipe_name`` rowwise / rowwise_with_gw_hp,
``filter_fqns``, ``emulate``) has no float8 all-gather key and no post-optimizer scale
hook: its float8 linears gather their weights in high precision. This converter takes the
same keys plus ``enable_fsdp_float8_all_gather`` (torchao's name; on by default, which
needs the ``tensorwise`` recipe, the default here). ``parallelize_llama`` then gives
such linears torchao's ``WeightWithDynamicFloat8CastTensor`` weights, which hsdp gathers
as float8 bytes and whose scales it refreshes after every ``optimizer.step()`` (no
``precompute_float8_dynamic_scale_for_fsdp`` call: on an hsdp model it finds no FSDP2
weights and does nothing). Under torchtitan's FSDP2 ``parallelize_llama`` the same model
gathers high precision, as with torchtitan's own converter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch.nn as nn
from torchao.float8.float8_linear import Float8Linear as TorchAOFloat8Linear
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
from torchtitan.components.quantization import float8 as titan_float8


class Float8LinearConverter(titan_float8.Float8LinearConverter):
    """torchtitan's float8 linear converter, with ``enable_fsdp_float8_all_gather``."""

    @dataclass(kw_only=True, slots=True)
    class Config(titan_float8.Float8LinearConverter.Config):
        recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
        """Float8 recipe name; float8 all-gather needs ``tensorwise``."""

        enable_fsdp_float8_all_gather: bool = True
        """Gather float8 weights (one byte per element) under hsdp."""

    def __init__(self, config: Config) -> None:
        if config.enable_fsdp_float8_all_gather and config.recipe_name != "tensorwise":
            raise ValueError(f"hsdp: enable_fsdp_float8_all_gather needs recipe_name "
                             f"'tensorwise' (got {config.recipe_name!r}: torchao gathers "
                             f"only tensorwise-scaled weights in float8)")
        super().__init__(config)
        if self.enabled:
            self.torchao_config = dataclasses.replace(
                self.torchao_config,
                enable_fsdp_float8_all_gather=config.enable_fsdp_float8_all_gather)


def wrap_float8_all_gather_weights(model: nn.Module) -> None:
    """Give each torchao float8 linear whose config asks for float8 all-gather torchao's
    float8 weight wrapper, as ``Float8Linear.from_float`` does (torchtitan builds its
    float8 linears through ``__init__``, which does not)."""
    for m in model.modules():
        if (isinstance(m, TorchAOFloat8Linear) and m.config.enable_fsdp_float8_all_gather
                and not isinstance(m.weight, WeightWithDynamicFloat8CastTensor)):
            m.weight = nn.Parameter(WeightWithDynamicFloat8CastTensor(
                m.weight, m.linear_mm_config, m.config.cast_config_weight.target_dtype),
                requires_grad=m.weight.requires_grad)

