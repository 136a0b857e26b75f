"""Every torchft replica group saving to one path (2 groups x 2 gloo ranks,
``ft_save_jobs.py``): group 1's save meets group 0's between its write and its publish
(a hook, not timing). Group 1 gets ``CheckpointBusyError`` at once, catches it as the
guide says and trains on; group 0's checkpoint is published and holds the step both
groups saved."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import Forked, free_port
from ft_jobs import build_model
from ft_save_jobs import main
from test_fault_tolerance import _logs, _wait
from torchft._torchft import LighthouseServer

STEPS, SAVE_AT, SEED, DEADLINE_S = 3, 1, 7, 300


@pytest.mark.full
def test_replica_groups_saving_to_one_path(tmp_path) -> None:
    out, path = str(tmp_path), str(tmp_path / "ckpt" / "latest")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=5000,
                                  quorum_tick_ms=50, heartbeat_timeout_ms=1000)
    procs = []
    try:
        for replica in range(2):
            port = free_port()
            for rank in range(2):
                cfg = {"out": out, "replica": replica, "rank": rank, "port": port,
                       "lighthouse": lighthouse.address(), "steps": STEPS,
                       "save_at": SAVE_AT, "seed": SEED, "path": path}
                procs.append(Forked(main, cfg, os.path.join(out, f"g{replica}_{rank}.log")))
        assert _wait(procs, time.monotonic() + DEADLINE_S, out) == [0] * 4, _logs(out)
    finally:
        lighthouse.shutdown()
    res = {(g, r): torch.load(os.path.join(out, f"g{g}_r{r}.pt")) for g in (0, 1)
           for r in (0, 1)}
    for r in (0, 1):
        assert res[0, r]["save"] == "saved", res[0, r]["save"]
        busy = res[1, r]["save"]
        assert busy.startswith("busy: hsdp.save:") and "being saved by another job" in busy
        assert res[1, r]["seconds"] < 30, res[1, r]["seconds"]  # refused, not waiting
        assert res[0, r]["steps"] == res[1, r]["steps"] == STEPS  # both trained on
    saved = res[0, 0]["params"]
    assert all(torch.equal(saved[n], t) for n, t in res[1, 0]["params"].items())
    state = {"model": build_model(SEED).state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    for n, t in saved.items():
        assert torch.equal(state["model"][n], t), n
