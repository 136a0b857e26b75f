"""Every collective hsdp issues goes through ``Collectives``.

Calls are synchronous from the caller's point of view (``async_op=False``): on CUDA they
are ordered on the current stream, which the schedule sets to the named stream; on CPU
they block the stream's worker thread (see ``streams.py``). A group of one rank needs no
collective at all.

Emulation: with a ``Fabric``, each collective is preceded by a delay of its modelled
duration on the same stream (``torch.cuda._sleep`` on GPU, ``time.sleep`` on CPU). Under
torch's ``fake`` process group the collective itself does nothing, so the delay is the
whole cost: the real schedule, streams and compute, with the network of a cluster we do
not have. (Its all-gathers would copy the input into every chunk of the output: they are
given empty views, ``fake_all_gather_args``.)

Simulation: with ``record``, each collective only reports ``(kind, axis, nbytes,
group_size)`` to it (the simulator's virtual streams time it later).

Averaging (``avg=True``, gradients): NCCL's ``ReduceOp.AVG`` where the backend has it (no
separate division pass over the input, as FSDP2 does), else a SUM and a division of the
output, which is 1/n the size of a reduce-scatter's input (gloo has no AVG).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hsdp.fabric import Fabric

# torch 2.13 renamed these; 2.11 only has the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class SleepClock:
    """Turns seconds into a device delay on the current CUDA stream (calibrated)."""

    cycles_per_s: float

    @staticmethod
    def calibrate(device: torch.device, probe_cycles: int = 20_000_000) -> SleepClock:
        with torch.cuda.device(device):
            torch.cuda._sleep(probe_cycles // 10)  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            torch.cuda._sleep(probe_cycles)
            end.record()
            end.synchronize()
        return SleepClock(probe_cycles / (start.elapsed_time(end) * 1e-3))

    def check(self, seconds: float = 2e-3, repeats: int = 5) -> float:
        """Relative error of a calibrated delay of ``seconds`` measured again now (median
        of ``repeats``)."""
        errs = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            self(seconds)
            end.record()
            end.synchronize()
            errs.append(start.elapsed_time(end) * 1e-3 / seconds - 1.0)
        return sorted(errs)[len(errs) // 2]

    def __call__(self, seconds: float) -> None:
        if seconds > 0:
            torch.cuda._sleep(int(seconds * self.cycles_per_s))


def _host_sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


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
    """all-gather / reduce-scatter / all-reduce with SUM or average, optionally emulated or
    recorded."""

    def __init__(self, fabric: Fabric | None = None, sleep=None,
                 record: Callable[[str, str, int, int], None] | None = None) -> None:
        self.fabric = fabric
        self._sleep = sleep or _host_sleep
        self._record = record
        self._backend = BackendNames()

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

    def _delay(self, kind: str, axis: str, nbytes: int, n: int) -> None:
        if self._record is not None:
            self._record(kind, axis, nbytes, n)
        elif self.fabric is not None:
            self._sleep(self.fabric.seconds(kind, axis, nbytes, n))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                   axis: str) -> None:
        """``out`` = concat over ranks of ``inp``; ``inp`` may be this rank's chunk of out."""
        n = dist.get_world_size(group)
        if n == 1:
            if inp.data_ptr() != out.data_ptr():
                out.copy_(inp)
            return
        self._delay("all_gather", axis, out.numel() * out.element_size(), n)
        if self._backend(group, out) == "fake":
            out, inp = fake_all_gather_args(out, inp)
        _all_gather(out, inp, group=group)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       group: dist.ProcessGroup, axis: str, avg: bool = False) -> None:
        """``out`` = this rank's chunk of the sum (``avg``: mean) over ranks of ``inp``."""
        n = dist.get_world_size(group)
        if n == 1:
            out.copy_(inp)
            return
        self._delay("reduce_scatter", axis, inp.numel() * inp.element_size(), n)
        op, divisor = self._reduction(avg, group, out, n)
        _reduce_scatter(out, inp, op=op, group=group)
        if divisor > 1:
            out.div_(divisor)

    def all_reduce(self, t: torch.Tensor, group: dist.ProcessGroup, axis: str,
                   avg: bool = False) -> None:
        """``t`` = the sum (``avg``: mean) over ranks of ``t``."""
        n = dist.get_world_size(group)
        if n == 1:
            return
        self._delay("all_reduce", axis, t.numel() * t.element_size(), n)
        op, divisor = self._reduction(avg, group, t, n)
        dist.all_reduce(t, op=op, group=group)
        if divisor > 1:
            t.div_(divisor)
