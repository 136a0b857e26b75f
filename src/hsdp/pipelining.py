"""hsdp as the data-parallel layer under ``torch.distributed.pipelining``.

torch's schedules talk to FSDP2 through ``isinstance(stage.submod, FSDPModule)``: they
call ``set_is_last_backward`` / ``set_requires_gradient_sync`` /
``set_reshard_after_backward`` around each backward and reach into FSDP2's internals
(``fully_shard.state``, its param groups' ``post_backward``) once per step. An hsdp
module is not an ``FSDPModule``, so a plain ``PipelineStage`` would run every backward
as a step's last (an outer reduction per microbatch). ``PipelineStage`` here is torch's
with one change: each backward runs inside ``hsdp.microbatch(stage_module,
is_last=last_backward)``, the schedule's own flag, so the inner reduce-scatter runs per
microbatch and the outer reduction and the gradients' finalization once per stage per
step, after the stage's last backward (on the outer stream, overlapping the pipeline's
drain). torch's ``scale_grads`` then divides the final gradients by the microbatch count.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.pipelining import PipelineStage as _TorchStage

from hsdp.api import microbatch


class PipelineStage(_TorchStage):
    """torch's ``PipelineStage`` (same arguments) for a stage module that is the root of
    an hsdp-sharded model (``hsdp.fully_shard`` on the mesh of this stage's
    data-parallel ranks). Split backwards (zero-bubble schedules, ``dw_builder``) are
    refused."""

    def __init__(self, submodule: nn.Module, *args: Any, **kwargs: Any) -> None:
        check_stage_module(submodule)
        if kwargs.get("dw_builder") is not None:
            raise NotImplementedError(_SPLIT_BACKWARD)
        super().__init__(submodule, *args, **kwargs)

    @classmethod
    def adopt(cls, stage: _TorchStage) -> PipelineStage:
        """``stage``, a torch ``PipelineStage`` built before its module was sharded (as
        torchtitan's ``pipeline_llm`` builds them), made this class in place once its
        ``submod`` is an hsdp root: the schedule that holds it keeps working with it."""
        if not isinstance(stage, _TorchStage):
            raise TypeError(f"hsdp.pipelining.PipelineStage.adopt: expected a "
                            f"torch.distributed.pipelining.PipelineStage, got {type(stage)}")
        check_stage_module(stage.submod)
        if stage.dw_builder is not None:
            raise NotImplementedError(_SPLIT_BACKWARD)
        stage.__class__ = cls
        return stage

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                   last_backward: bool = False, **kwargs: Any) -> Any:
        """The stage's backward of one microbatch; the outer reduction only on the last."""
        if backward_type != "full":
            raise NotImplementedError(_SPLIT_BACKWARD)
        with microbatch(self.submod, is_last=last_backward):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs,
                                                      last_backward=last_backward, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        """torch >= 2.13 infers shapes with a real forward and backward of the first
        microbatch; drop the gradients it left (FSDP2's are dropped by torch)."""
        cleanup = getattr(super(), "_post_metadata_inference_cleanup", None)
        if cleanup is not None:
            cleanup()
        self.submod.zero_grad(set_to_none=True)


_SPLIT_BACKWARD = (
    "hsdp.pipelining: split backwards (input / weight, as zero-bubble schedules such as "
    "ScheduleZBVZeroBubble and ScheduleInterleavedZeroBubble run them, or dw_builder) are "
    "not supported: hsdp reduces a unit's gradients from its backward hooks. Use "
    "ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B")


def check_stage_module(module: nn.Module) -> None:
    """``module`` must be an hsdp root (fully_shard-ed, not inside a larger sharded model)."""
    unit = getattr(module, "_hsdp_unit", None)
    if unit is None or unit.enclosing is not None:
        raise ValueError(
            f"hsdp.pipelining.PipelineStage: the stage module ({type(module).__name__}) must "
            f"be passed to hsdp.fully_shard last (the root of the stage's sharded model), "
            f"on the mesh of this stage's data-parallel ranks")
