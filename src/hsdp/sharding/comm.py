"""Every collective hsdp issues goes through ``Collectives``.

Calls are synchronous from the caller's point of view (``async_op=False``): on CUDA they
are ordered on the current stream, which the schedule sets to the named stream; on CPU
they block the stream's worker thread (see ``streams/cpu_backend.py``). A group of one rank needs no
collective at all.

Tools plug in by subclassing: ``before`` is called ahead of each collective with other
ranks (the bench's emulated delays, ``hsdp_tools.bench.emulate``; the simulator's recorded sizes,
``hsdp_tools.sim.engine``). On torch's ``fake`` process group (which stands for NCCL in
emulation) all-gathers are given empty views (``fake_all_gather_args``).

Averaging (``avg=True``, gradients): NCCL's ``ReduceOp.AVG`` where the backend has it (no
separate division pass over the input, as FSDP2 does), else a SUM and a division of the
output, which is 1/n the size of a reduce-scatter's input (gloo has no AVG).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hsdp.ft.outer import ElasticOuter

# torch 2.13 renamed these; 2.11 only has the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Public: a test wraps it to wait until gloo has let go of the tensors.
torch_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class BackendNames:
    """The name of the backend that runs ``t``'s collectives on ``group``, looked up once
    per group and device kind (the lookup is a call into the process group)."""

    def __init__(self) -> None:
        self._names: dict[tuple[dist.ProcessGroup, bool], str] = {}

    def __call__(self, group: dist.ProcessGroup, t: torch.Tensor) -> str:
        key = (group, t.is_cuda)
        if key not in self._names:
            device = torch.device("cpu") if t.is_meta else t.device  # meta: the simulator's
            self._names[key] = group._get_backend(device).name().lower()
        return self._names[key]


def fake_all_gather_args(out: torch.Tensor,
                         inp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What an all-gather on torch's fake process group is given: empty views of ``out``
    and ``inp``. That backend copies ``inp`` into every chunk of ``out``: a full write of
    the gathered buffer on the collective's stream and a copy launch per rank, which no
    real all-gather adds to the time the fabric models. The call itself, and its work
    handle, stay."""
    return out.narrow(0, 0, 0), inp.narrow(0, 0, 0)


class Collectives:
    """all-gather / reduce-scatter / all-reduce with SUM or average, all-to-all."""

    def __init__(self) -> None:
        self._backend = BackendNames()

    def before(self, kind: str, axis: str, nbytes: int, group_size: int) -> None:
        """Called ahead of each collective with other ranks: ``kind`` ("all_gather",
        "reduce_scatter", "all_reduce", "all_to_all") on mesh ``axis`` over ``group_size``
        ranks, of a full buffer of ``nbytes``. A real collective needs nothing; tools
        override it."""

    def _reduction(self, avg: bool, group: dist.ProcessGroup, t: torch.Tensor,
                   n: int) -> tuple[dist.ReduceOp, int]:
        """The op for a sum (or mean) of ``t`` over ``group``, and what to divide the
        result by afterwards (1: nothing)."""
        if not avg:
            return dist.ReduceOp.SUM, 1
        # NCCL has AVG; torch's fake process group stands for NCCL in emulation
        if self._backend(group, t) in ("nccl", "fake"):
            return dist.ReduceOp.AVG, 1
        return dist.ReduceOp.SUM, n

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                   axis: str) -> None:
        """``out`` = concat over ranks of ``inp``; ``inp`` may be this rank's chunk of out."""
        n = dist.get_world_size(group)
        if n == 1:
            if inp.data_ptr() != out.data_ptr():
                out.copy_(inp)
            return
        self.before("all_gather", axis, out.numel() * out.element_size(), n)
        if self._backend(group, out) == "fake":
            out, inp = fake_all_gather_args(out, inp)
        torch_all_gather(out, inp, group=group)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                   axis: str) -> None:
        """``out``'s row r = rank r's row ``rank`` of ``inp`` (both ``[n, ...]``)."""
        n = dist.get_world_size(group)
        if n == 1:
            out.copy_(inp)
            return
        self.before("all_to_all", axis, inp.numel() * inp.element_size(), n)
        dist.all_to_all_single(out, inp, group=group)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       group: dist.ProcessGroup, axis: str, avg: bool = False) -> None:
        """``out`` = this rank's chunk of the sum (``avg``: mean) over ranks of ``inp``."""
        n = dist.get_world_size(group)
        if n == 1:
            out.copy_(inp)
            return
        self.before("reduce_scatter", axis, inp.numel() * inp.element_size(), n)
        op, divisor = self._reduction(avg, group, out, n)
        _reduce_scatter(out, inp, op=op, group=group)
        if divisor > 1:
            out.div_(divisor)

    def all_reduce(self, t: torch.Tensor, group: dist.ProcessGroup | ElasticOuter, axis: str,
                   avg: bool = False) -> None:
        """``t`` = the sum (``avg``: mean) over ranks of ``t``; over the live replica
        groups when ``group`` is torchft's (even this group alone: it takes part in the
        quorum)."""
        if isinstance(group, ElasticOuter):
            n = group.size()  # the step's first call waits for torchft's quorum
            self.before("all_reduce", axis, t.numel() * t.element_size(), n)
            group.all_reduce(t, avg, n)
            return
        n = dist.get_world_size(group)
        if n == 1:
            return
        self.before("all_reduce", axis, t.numel() * t.element_size(), n)
        op, divisor = self._reduction(avg, group, t, n)
        dist.all_reduce(t, op=op, group=group)
        if divisor > 1:
            t.div_(divisor)
