"""Float8 all-gather of torchao's float8 linear weights, through torchao's FSDP protocol.

(The conversion of a model, ``convert_to_float8``, is in ``hsdp/float8.py``.)

torchao (``hsdp[float8]``) marks the weights of a float8 linear converted with
``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` as
``WeightWithDynamicFloat8CastTensor``. hsdp puts a unit's such weights in a parameter group
of their own (``float8_dtype`` is part of the group key) whose buffers are:

- ``main`` in the original dtype, as any group's (the optimizer updates it);
- the gathered buffer (and hfsdp's inner shard) in float8: each rank casts its piece of
  every weight with that weight's global scale (torchao's ``fsdp_pre_all_gather`` with the
  precomputed scale), the inner (and hfsdp's outer) all-gather moves one byte per element
  (as uint8: gloo has no float8 type), and each unsharded weight is a torchao
  ``Float8TrainingTensor`` over its window of the gathered buffer (torchao's
  ``fsdp_post_all_gather``), which the float8 matmul uses as it is.

Scales (tensorwise: float8 max / max|w| over the whole weight, torchao's ``amax_to_scale``)
are the same on every rank, so they travel with no all-gather. They are computed at
``fully_shard`` from the whole weights (no communication) and after every
``optimizer.step()`` for all float8 weights of the model at once: one MAX all-reduce over
inner (and one over outer for hfsdp), the reduction torchao's
``precompute_float8_dynamic_scale_for_fsdp`` makes FSDP2 users call by hand.
``hsdp.precompute_float8_scales(model)`` does it after weights changed any other way; a
gather with scales older than the weights raises instead of casting with them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from hsdp.sharding.layout import ParamSpan


def float8_dtype(p: torch.Tensor) -> torch.dtype | None:
    """The float8 dtype torchao all-gathers ``p`` in, or None for any other parameter. A
    model can hold torchao's weights only once torchao is imported: no import here."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    if fsdp_utils is None or not isinstance(p, fsdp_utils.WeightWithDynamicFloat8CastTensor):
        return None
    return p._dtype


def _unwrapped(p: torch.Tensor) -> torch.Tensor:
    return getattr(p, "_tensor", p)


class Float8Weights:
    """The float8 side of one parameter group whose parameters are all torchao float8
    weights of one float8 dtype: their scales, the cast into float8 bytes and the
    unsharded ``Float8TrainingTensor`` parameters."""

    def __init__(self, params: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        self.dtype = dtype
        # torchao's weight wrapper of each parameter, over no data: what its protocol
        # methods need besides the tensor (the matmul config, the float8 dtype).
        self._protos = [WeightWithDynamicFloat8CastTensor(
            torch.empty(0, device=p.device), p._linear_mm_config, dtype) for p in params]
        self._wrap = WeightWithDynamicFloat8CastTensor
        # The group's version (``GroupBuffers.version``) the scales were computed at; None:
        # not yet (meta weights: no values).
        self.version: int | None = None
        if any(p.is_meta for p in params):
            self.scales = torch.ones(len(params), device=params[0].device)
        else:  # the whole weights are on every rank here: no communication
            self.set_amax(torch.stack([_unwrapped(p).detach().abs().max().float()
                                       for p in params]))

    def wrap(self, params: Sequence[torch.Tensor]) -> list[nn.Parameter]:
        """``params`` (laid out like this group's) as torchao float8 weights like these."""
        return [nn.Parameter(self._wrap(p, proto._linear_mm_config, self.dtype),
                             requires_grad=p.requires_grad)
                for p, proto in zip(params, self._protos)]

    def scaled_at(self, version: int | None) -> None:
        """The scales were computed from the weights at the group's ``version``."""
        self.version = version

    def set_amax(self, amax: torch.Tensor) -> None:
        """New scales from each weight's global max|w| (``amax``: one per weight)."""
        from torchao.float8.float8_utils import amax_to_scale

        self.scales = amax_to_scale(amax, self.dtype)

    def local_amax(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """max|w| over this rank's piece of each weight (0 where it holds none)."""
        held = [t for t in pieces if t.numel()]
        norms = iter(torch._foreach_norm(held, math.inf) if held else [])
        zero = torch.zeros((), dtype=torch.float32, device=pieces[0].device)
        return torch.stack([next(norms).float() if t.numel() else zero for t in pieces])

    def cast(self, out: torch.Tensor, src: torch.Tensor, pieces: Sequence[ParamSpan | None]
             ) -> None:
        """``out[piece]`` = the float8 bytes of ``src[piece]`` for each weight's piece of
        the range both cover, by torchao's ``fsdp_pre_all_gather`` with the weight's
        scale. Padding is left as it is (no weight views it)."""
        for pc in pieces:
            if pc is None:
                continue
            a, n = pc.range_offset, pc.length
            proto = self._protos[pc.index]
            piece = self._wrap(src[a:a + n], proto._linear_mm_config, self.dtype,
                               precomputed_scale=self.scales[pc.index])
            (data,), _ = piece.fsdp_pre_all_gather(None)
            out[a:a + n].copy_(data)

    def unsharded(self, views: Sequence[torch.Tensor], param_dtype: torch.dtype,
                  requires_grad: bool) -> list[nn.Parameter]:
        """The unsharded parameters: ``Float8TrainingTensor``s over ``views`` (windows of
        the float8 gathered buffer) computing in ``param_dtype``."""
        return [nn.Parameter(proto.fsdp_post_all_gather((v,), (s,), param_dtype)[0],
                             requires_grad=requires_grad)
                for proto, v, s in zip(self._protos, views, self.scales)]

    def show(self, unsharded: Sequence[nn.Parameter], param_dtype: torch.dtype) -> None:
        """Give the unsharded parameters the current scales (``fsdp_post_all_gather``'s
        in-place form, as FSDP2 calls it on each re-gather)."""
        for proto, p, s in zip(self._protos, unsharded, self.scales):
            proto.fsdp_post_all_gather((p._data,), (s,), param_dtype, out=p)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 buffer as the uint8 tensor the collectives move (gloo has no float8)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def refresh_scales(entries: Sequence[tuple[Float8Weights, list[torch.Tensor], bool]],
                   groups: tuple[dist.ProcessGroup, dist.ProcessGroup],
                   reduce: Callable[[torch.Tensor, dist.ProcessGroup], None]) -> None:
    """New scales for every float8 group of a model from its current weights, in one MAX
    all-reduce over inner (``groups[0]``) and, if a group is sharded over outer too, one
    over outer (``groups[1]``; for the others the outer replicas hold the same values).
    ``entries``: (float8 side, this rank's piece of each weight, sharded over outer)."""
    if not entries:
        return
    amax = torch.cat([f8.local_amax(pieces) for f8, pieces, _ in entries])
    reduce(amax, groups[0])
    if any(outer for *_, outer in entries):
        reduce(amax, groups[1])
    for (f8, *_), part in zip(entries, amax.split([len(p) for _, p, _ in entries])):
        f8.set_amax(part)
