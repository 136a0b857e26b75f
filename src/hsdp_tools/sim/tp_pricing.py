"""Tensor parallelism in ``hsdp sim``: the TP collectives of torch's Llama plan, priced as
compute-stream work, and each rank's 1/tp of everything else.

The plan is ``hsdp_tools.bench.tp_plan``'s (torchtitan's: sequence-parallel norms, colwise q/k/v and
w1/w3, rowwise wo/w2 into sequence shards). Per block and microbatch, with ``act`` the
bytes of one whole activation (mbs x seq x hidden in the compute dtype), torch issues on
the tp group, on the compute stream (each blocks compute while it runs):

- forward (and a recompute): an all-gather of ``act`` before attention and one before
  the MLP, a reduce-scatter of ``act`` after each;
- backward: the mirror all-gathers of ``act`` (the rowwise outputs' gradients), an
  all-reduce of ``act`` per colwise linear (5: its input gradient is Partial, made whole
  by DTensor's ``from_local`` backward) and of each norm weight's gradient (2 x hidden).

The embedding (a reduce-scatter forward, an all-gather backward) and the head (the
all-gather of its input and of the logits forward, a reduce-scatter backward) likewise,
and the root's final norm (its weight's gradient, all-reduced backward).
``bench step --tp`` counts the same bytes on its emulated run (tests/dist).

With TP each rank holds and computes 1/tp of every parameter and activation of the
units (heads and MLP columns; the norms on 1/tp of the sequence): the recorded program
of the data-parallel mesh is priced with every compute op's FLOPs and bytes, every
data-parallel collective's bytes and every side op's own tensor work divided by tp. The
loss outside the units (whole logits on every tp rank) is not divided.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from hsdp_tools.models import LlamaConfig
from hsdp_tools.sim.clock import Program, ProgramOp
from hsdp_tools.sim.costs import Price, phase_class
from hsdp_tools.sim.fabric import Fabric, Link

Collective = tuple[str, int]  # (kind, full-buffer bytes)
FORWARD_KINDS = ("FWD", "RECOMPUTE")


def unit_collectives(model: LlamaConfig, mbs: int, dtype_bytes: int
                     ) -> dict[str, list[Collective]]:
    """Per phase class (``"FWD:LlamaBlock"``, ``"BWD:Embedding"``, ...), the TP
    collectives of one instance of it (module docstring)."""
    act = mbs * model.seq * model.hidden * dtype_bytes
    norm = model.hidden * dtype_bytes
    logits = mbs * model.seq * model.vocab * dtype_bytes
    block_fwd = [("all_gather", act), ("reduce_scatter", act)] * 2
    return {
        **{f"{k}:LlamaBlock": block_fwd for k in FORWARD_KINDS},
        "BWD:LlamaBlock": [("all_gather", act)] * 2 + [("all_reduce", act)] * 5
                          + [("all_reduce", norm)] * 2,
        **{f"{k}:Embedding": [("reduce_scatter", act)] for k in FORWARD_KINDS},
        "BWD:Embedding": [("all_gather", act)],
        **{f"{k}:Linear": [("all_gather", act), ("all_gather", logits)]
           for k in FORWARD_KINDS},
        "BWD:Linear": [("reduce_scatter", act)],
        "BWD:Llama": [("all_reduce", norm)],  # the root's sequence-parallel final norm
    }


def spread_over_phases(program: Program, seconds: dict[str, float]) -> dict[int, float]:
    """``id(compute op) -> seconds`` it carries of ``seconds`` per phase class (collectives
    that block compute while they run): each phase instance's spread evenly over its
    compute ops; those of an instance without compute ops of its own (the head's backward
    runs inside the root's) go to the next compute op."""
    ops_in = Counter(op.phase for op in program.ops if op.kind == "compute" and op.phase >= 0)
    per_op: dict[int, float] = {}  # phase's begin op -> seconds per compute op
    extra: dict[int, float] = {}
    pending = 0.0
    for i, op in enumerate(program.ops):
        if op.kind == "begin":
            s = seconds.get(phase_class(op.label), 0.0)
            if ops_in[i]:
                per_op[i] = s / ops_in[i]
            else:
                pending += s
        elif op.kind == "compute":
            extra[id(op)] = per_op.get(op.phase, 0.0) + pending
            pending = 0.0
    return extra


def tp_pricer(price: Price, program: Program, model: LlamaConfig, mbs: int,
              dtype_bytes: int, tp: int, link: Link) -> Price:
    """``price`` of the data-parallel program for one rank of a tp group on ``link``
    (module docstring), the TP collectives ``spread_over_phases``."""
    fabric = Fabric(link, link)
    seconds = {cls: sum(fabric.seconds(kind, "inner", n, tp) for kind, n in colls)
               for cls, colls in unit_collectives(model, mbs, dtype_bytes).items()}
    extra = spread_over_phases(program, seconds)

    def priced(op: ProgramOp) -> tuple[float, ...]:
        if op.kind == "side":
            share = dataclasses.replace(
                op, payload=[(k, a, n // tp, g) for k, a, n, g in op.payload],
                local_bytes=op.local_bytes // tp,
                kernel_bytes=tuple((k, n // tp) for k, n in op.kernel_bytes))
            return price(share)
        if op.kind != "compute":
            return price(op)
        tp_s = extra.get(id(op), 0.0)
        if op.phase >= 0:  # the units' work: 1/tp on each tp rank
            cost = op.payload
            op = dataclasses.replace(op, payload=dataclasses.replace(
                cost, flops=cost.flops / tp, nbytes=cost.nbytes // tp))
        host, device, *rest = price(op)
        return (host, device + tp_s, *rest)

    return priced
