"""hsdp stages under torch.distributed.pipelining (pipeline_jobs.py), on 2 pipeline ranks x
(2 outer x 2 inner) gloo ranks, each step clipped by ``hsdp.clip_grad_norm_`` over all
stages (``pp_group``) as one process clips the whole model, the outer reduction once per
step. GPipe (hsdp) and interleaved 1F1B (hfsdp: two stages per rank, whose outer
all-gathers after the step share the outer communicator and must be issued in one order
on every rank, even where hsdp's registry of models iterates differently per rank)
against one process training the whole model; 1F1B with bf16 parameters and fp32
reduction (hfsdp, the serialized outer reduction, an optimizer per stage stepped by a
container as torchtitan's: one outer all-gather per group and step) against FSDP2 + PP on the same schedule and mesh; 1F1B with torchao's
float8 linears and float8 all-gather (hsdp) against one process. One spawned world."""

from __future__ import annotations

import importlib.util

from dist_utils import run_ranks
from pipeline_jobs import MAX_NORM, Case, pipeline_job

TOL = 1e-5  # fp32 master weights, SGD, 2 steps
BF16_TOL = 2e-2  # bf16 compute, as test_parity.py's hsdp vs FSDP2
CASES = [Case("gpipe", "hsdp"), Case("interleaved", "hfsdp"),
         Case("1f1b", "hfsdp", "bf16", overlap_outer=False, container=True)]
if importlib.util.find_spec("torchao") is not None:
    CASES.append(Case("1f1b", "hsdp", "float8"))


def test_pipeline_schedules_match_one_process_and_fsdp2():
    per_rank = run_ranks(pipeline_job, 8, CASES, timeout=600)
    assert all(len(res) == len(CASES) for res in per_rank)
    errors = {(r, str(k)): e for r, res in enumerate(per_rank) for k, (e, *_) in res.items()}
    bad = {k: e for k, e in errors.items() if not e < (BF16_TOL if "bf16" in k[1] else TOL)}
    assert not bad, bad
    # The outer reduction once per parameter group and step, not once per microbatch; hfsdp's
    # outer all-gather once per group after the step (not once more for the container).
    counts = {(r, k): (n, gathers, groups) for r, res in enumerate(per_rank)
              for k, (_, n, gathers, groups, *_) in res.items()}
    bad = {(r, str(k)): (n, gathers, groups) for (r, k), (n, gathers, groups) in counts.items()
           if not (n == groups > 0 and gathers == (groups if k.strategy == "hfsdp" else 0))}
    assert not bad, bad
    norms = {(r, str(k)): v[4] for r, res in enumerate(per_rank) for k, v in res.items()}
    assert all(n > MAX_NORM for n in norms.values()), norms  # the clip scaled every step
    # bf16 and float8 took effect: away from one process's fp32 training, bf16 within its
    # tolerance of it
    vs_fp32 = {(r, k.precision): v[5] for r, res in enumerate(per_rank) for k, v in res.items()}
    bad = {k: e for k, e in vs_fp32.items()
           if not (e < TOL if k[1] == "fp32" else TOL < e < BF16_TOL)}
    assert not bad, bad
