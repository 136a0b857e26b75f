"""hsdp stages under torch.distributed.pipelining (pipeline_jobs.py): GPipe (hsdp), 1F1B
(hfsdp) and interleaved 1F1B (hfsdp: two stages per rank, whose outer all-gathers after
the step share the outer communicator and must be issued in one order on every rank, even
where hsdp's registry of models iterates differently per rank), the outer reduction once
per step, on 2 pipeline ranks x (2 outer x 2 inner) gloo ranks, against one process
training the whole model, each step clipped by ``hsdp.clip_grad_norm_`` over all stages
(``pp_group``) as one process clips the whole model."""

from __future__ import annotations

from dist_utils import run_ranks
from pipeline_jobs import pipeline_job


def test_pipeline_schedules_match_one_process():
    per_rank = run_ranks(pipeline_job, 8, timeout=600)
    bad = {(r, k): e for r, res in enumerate(per_rank) for k, (e, *_) in res.items()
           if not e < 1e-5}
    assert not bad, bad
    # The outer reduction once per parameter group and step, not once per microbatch.
    counts = {(r, k): (n, groups) for r, res in enumerate(per_rank)
              for k, (_, n, groups, _) in res.items()}
    bad = {k: v for k, v in counts.items() if not v[0] == v[1] > 0}
    assert not bad, bad
    assert len(per_rank[0]) == 3
    norms = {(r, k): v[3] for r, res in enumerate(per_rank) for k, v in res.items()}
    assert all(n > 0.2 for n in norms.values()), norms  # the clip scaled every step
