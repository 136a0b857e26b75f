"""The compressed outer gradient reduction, the ``outer_reduce`` mode
(``fully_shard(..., outer_reduce=hsdp.OuterReduce(...))``; ``topology/outer_mode.py``):
its settings, its refusals, its op kinds and its state on each group, the codec with its
error-feedback residual (``compressed.py``). The reductions run where the exact ones run
(``group_grads.py``); the residual in checkpoints: ``outer_residual.py``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from hsdp.ft.errors import FaultToleranceError
from hsdp.sharding import outer_residual
from hsdp.sharding.compressed import CompressedOuter
from hsdp.sharding.group import ParamGroup
from hsdp.sharding.policy import check_format, parse_format
from hsdp.streams.op_table import OpKind
from hsdp.topology.outer_mode import Entries, OuterMode

# Backends known to run all_to_all_single (torch's fake one stands for NCCL in emulation).
_ALL_TO_ALL = ("nccl", "gloo", "fake", "mpi", "ucc", "xccl")


@dataclass(frozen=True)
class OuterReduce(OuterMode):
    """Compressed outer gradient reduction (``fully_shard(..., outer_reduce=...)``).

    ``dtype``: what crosses the outer link, "int8" or "fp8_e4m3" (one byte per element).
    ``block``: elements per quantization block, each with an fp32 scale (4 bytes per
    block: 1.6 % at the default 256); a power of two from 16 to 65536, so that blocks
    tile each outer chunk (padded to whole blocks).
    ``error_feedback``: each rank adds what quantization dropped last step to its next
    gradient before quantizing (training state: checkpoints carry it).
    The reduced gradient's sum is taken in fp32 (docs/guide/slow_outer_links.md)."""

    dtype: str = "int8"
    block: int = 256
    error_feedback: bool = True

    argument: ClassVar[str] = "outer_reduce"
    forms: ClassVar[str] = "DTYPE[:BLOCK]"
    state_key: ClassVar[str] = "hsdp_outer_residual"
    state_name: ClassVar[str] = "error-feedback residuals"
    dropped_note: ClassVar[str] = "its error-feedback residuals are dropped (this model has none)"
    fresh_note: ClassVar[str] = ("the error-feedback residuals start from zero (none saved "
                                 "for this layout)")

    def __post_init__(self) -> None:
        check_format("OuterReduce", self.dtype, self.block)
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"hsdp.OuterReduce: error_feedback must be a bool, got "
                            f"{self.error_feedback!r}")

    @classmethod
    def parse(cls, text: str) -> OuterReduce:
        """"int8", "fp8_e4m3:128" (DTYPE[:BLOCK])."""
        return parse_format(text, "outer reduction", cls)

    def check_shard(self, strategy: Any, comms: Any, device: Any, params: list,
                    names: list[str]) -> None:
        """It needs an all-to-all on the outer communicator, which torchft's managed group
        (fault tolerance) lacks."""
        if comms.elastic is not None:
            raise FaultToleranceError(
                "fully_shard: outer_reduce (compressed outer reduction) is not supported "
                "with fault tolerance: torchft's replica-group communicator has no "
                "all-to-all, and its quorum may change the ranks a residual belongs to. Use "
                "outer_reduce=None")
        if comms.outer_size == 1:
            return
        name = comms.outer._get_backend(device).name().lower()
        if name not in _ALL_TO_ALL:
            raise ValueError(f"fully_shard: outer_reduce needs all_to_all on the outer "
                             f"communicator; its backend {name!r} is not one known to have "
                             f"it ({', '.join(_ALL_TO_ALL)})")

    def attach(self, group: ParamGroup) -> None:
        """The group's codec and residual over more than one outer rank (one: exact)."""
        c = group.comms
        if c.outer_size > 1:
            group.compressed = CompressedOuter(self, group.layout.shard_numel, c.outer_size,
                                               c.outer_rank, group.main.device)

    def capture_refusal(self, group: ParamGroup) -> tuple[str, str] | None:
        why = None if group.compressed is None else group.compressed.capture_refusal()
        return None if why is None else (why, "run one eager optimizer step before capturing")

    def before_capture(self, group: ParamGroup) -> None:
        if group.compressed is not None:  # its residual: fixed buffers
            group.compressed.make_static()

    def hook_refusal(self, group: ParamGroup) -> str | None:
        if group.compressed is None:
            return None
        return ("outer_reduce: the compressed outer reduction has no all-reduce output of "
                "the reduce dtype for the hook; use outer_reduce=None with an all-reduce hook")

    def reduce_op(self, shard_outer: bool) -> OpKind:
        return OpKind.OUTER_Q_REDUCE_SCATTER if shard_outer else OpKind.OUTER_Q_ALL_REDUCE

    def state_dict(self, group: ParamGroup, opt_state: Mapping | None) -> Entries:
        return outer_residual.state(group)

    def load_state_dict(self, group: ParamGroup, state: Entries,
                        opt_state: Mapping | None) -> None:
        outer_residual.load(group, state)

    def to_read(self, group: ParamGroup, ours: Entries,
                saved: dict[str, tuple[int, ...]]) -> Entries:
        return outer_residual.to_read(group, ours, saved)

    def from_read(self, group: ParamGroup, read: Entries) -> Entries:
        return outer_residual.from_read(group, read)
