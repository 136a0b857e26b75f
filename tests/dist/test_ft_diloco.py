"""DiLoCo with fault tolerance (``init_mesh(outer_sync=hsdp.DiLoCo(...),
fault_tolerance=...)``): 2 replica groups x 2 gloo ranks, H=4, 3 fragments, delay 1.

Each test (``ft_diloco_jobs.py``) first runs the same training without fault tolerance on
one 2 x 2 world; then the lighthouse in this process and the replica groups as worlds of
their own. The default tier's test checks (a) and (c); the full tier's kills and restarts
group 1 for (b). (a) No failure, steps 0-10 (five syncs): every rank's parameters,
anchors and shard parameters equal those of the run without fault tolerance bit for bit. (b) Both ranks of
group 1 SIGKILLed mid-period (step 11): group 0 trains on alone, syncing with itself.
Group 1 restarted dies right after the quorum it recovered in: group 0's sync fails to
commit and applies nothing (anchors unchanged, the fragment back at its anchor). Group 1
restarted again recovers at a sync and from then on holds group 0's anchors bit for bit.
(c) What is still refused (hfsdp, the compressed outer reduction, another outer schedule
on the same replica group) raises on every rank.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from dist_utils import Forked, free_port
from ft_diloco_jobs import main
from ft_jobs import _wait_for
from test_fault_tolerance import _logs, _wait
from torchft._torchft import LighthouseServer

STEPS, SEED, KILL_AT = 25, 7, 11
SYNCS, APPLIES = (1, 3), (2, 0)  # steps mod 4 after which a fragment syncs, applies
DEADLINE_S = 420  # each of the two runs; a hang fails here instead of blocking CI


def _launch(out: str, tag: str, world: int, **cfg) -> list[Forked]:
    port, procs = free_port(), []
    for rank in range(world):
        args = {"out": out, "tag": tag, "world": world, "rank": rank, "port": port,
                "steps": STEPS, "seed": SEED, "timeout_s": 10, **cfg}
        procs.append(Forked(main, args, os.path.join(out, f"{tag}_{rank}.log")))
    return procs


def _records(out: str, tag: str, rank: int) -> dict[int, dict]:
    path = os.path.join(out, "{}_r{}_step{}.pt")
    return {s: torch.load(path.format(tag, rank, s)) for s in range(STEPS)
            if os.path.exists(path.format(tag, rank, s))}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _no_failure(out: str, rank: int, g0: dict, g1: dict) -> None:
    """(a) The steps before KILL_AT equal DiLoCo without fault tolerance, bit for bit."""
    plain = {r: _records(out, "plain", 2 * r + rank) for r in range(2)}
    for s in range(KILL_AT):
        for replica, ft in ((0, g0), (1, g1)):
            for what in ("params", "local"):
                assert _equal(ft[s][what], plain[replica][s][what]), (rank, s, what)
        assert g0[s]["participants"] == (2 if s >= SYNCS[0] else 0), s
    assert g0[KILL_AT - 1]["commits"] == 5  # the syncs of steps 1, 3, 5, 7, 9


def _refusals(out: str) -> None:
    """(c) What is still refused raises on every rank."""
    for rank in range(2):
        with open(os.path.join(out, f"refused_{rank}.json")) as f:
            refused = json.load(f)
        assert refused["hfsdp"].startswith("FaultToleranceError: fully_shard: strategy="
                                           "'hfsdp' cannot be made fault tolerant"), refused
        assert refused["outer_reduce"].startswith("FaultToleranceError: fully_shard: "
                                                  "outer_reduce"), refused


def _plain_run(out: str) -> None:
    without_ft = _launch(out, "plain", 4, steps=KILL_AT)
    assert _wait(without_ft, time.monotonic() + DEADLINE_S, out) == [0] * 4


def _lighthouse() -> LighthouseServer:
    return LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=5000,
                            quorum_tick_ms=50, heartbeat_timeout_ms=1000)


def test_diloco_replica_groups_train_as_without_fault_tolerance(tmp_path):
    """(a) and (c), steps 0-10 with no failure (the full tier's test below goes on to kill
    and restart group 1)."""
    out = str(tmp_path)
    _plain_run(out)
    deadline = time.monotonic() + DEADLINE_S
    lighthouse = _lighthouse()
    try:
        common = dict(lighthouse=lighthouse.address(), steps=KILL_AT)
        g0 = _launch(out, "g0", 2, replica=0, gates={0: "ready_g1.0"}, await_joiner=True,
                     check_refusals=True, **common)
        g1 = _launch(out, "g1.0", 2, replica=1, gates={0: "ready_g0"}, **common)
        assert _wait(g0 + g1, deadline, out) == [0] * 4, _logs(out)
    finally:
        lighthouse.shutdown()
    for rank in range(2):
        g0, g1 = _records(out, "g0", rank), _records(out, "g1.0", rank)
        assert sorted(g0) == sorted(g1) == list(range(KILL_AT))
        _no_failure(out, rank, g0, g1)
    _refusals(out)


@pytest.mark.full
def test_diloco_replica_group_lost_and_recovered(tmp_path):
    out = str(tmp_path)
    _plain_run(out)
    deadline = time.monotonic() + DEADLINE_S
    lighthouse = _lighthouse()
    try:
        common = dict(lighthouse=lighthouse.address())
        # group 0 starts each gated step once that incarnation of group 1 is up and its
        # quorum request is pending at the lighthouse
        gates = {0: "ready_g1.0", 17: "ready_g1.1", 21: "ready_g1.2"}
        g0 = _launch(out, "g0", 2, replica=0, gates=gates, await_joiner=True,
                     check_refusals=True, **common)
        killed = _launch(out, "g1.0", 2, replica=1, kill_at=KILL_AT,
                         gates={0: "ready_g0"}, **common)
        assert _wait(killed, deadline, out) == [-9, -9], _logs(out)
        # the next incarnation starts once group 0 has synced alone (step KILL_AT's sync,
        # applied in the step after it): started earlier, it would join that sync
        for rank in range(2):
            _wait_for(os.path.join(out, f"g0_r{rank}_step{KILL_AT + 1}.pt"),
                      max(1.0, deadline - time.monotonic()))
        dies = _launch(out, "g1.1", 2, replica=1, die_after_quorum=True, **common)
        assert _wait(dies, deadline, out) == [-9, -9], _logs(out)
        rejoined = _launch(out, "g1.2", 2, replica=1, **common)
        assert _wait(g0 + rejoined, deadline, out) == [0] * 4, _logs(out)
    finally:
        lighthouse.shutdown()

    for rank in range(2):
        g0, killed = _records(out, "g0", rank), _records(out, "g1.0", rank)
        rejoined = _records(out, "g1.2", rank)
        assert sorted(killed) == list(range(KILL_AT)) and sorted(g0) == list(range(STEPS))
        _no_failure(out, rank, g0, killed)
        # (b) alone after the kill; one sync did not commit and changed nothing
        assert g0[KILL_AT + 1]["participants"] == 1
        failed = [s for s in range(KILL_AT, STEPS)
                  if s % 4 in APPLIES and g0[s]["commits"] == g0[s - 1]["commits"]]
        assert len(failed) == 1, [(s, g0[s]["commits"]) for s in g0]
        s = failed[0]
        assert g0[s - 1]["commits"] > g0[KILL_AT - 1]["commits"]  # it synced alone
        anchors = {k: v for k, v in g0[s]["local"].items() if k.endswith("/anchor")}
        assert all(torch.equal(v, g0[s - 1]["local"][k]) for k, v in anchors.items())
        back = [k for k in anchors if torch.equal(g0[s]["local"][k[:-6] + "main"], anchors[k])]
        assert back, s  # the fragment it was to update went back to its anchor
        # the restarted group recovered at a sync and holds group 0's anchors from then on
        healed = min(t for t, rec in rejoined.items() if rec["participants"] == 2)
        assert s < healed and sorted(rejoined)[-(STEPS - healed):] == list(range(healed, STEPS))
        assert g0[healed]["participants"] == 2 and healed % 4 in SYNCS, healed
        for t in range(healed, STEPS):
            mine = {k: v for k, v in rejoined[t]["local"].items() if k.endswith("/anchor")}
            assert _equal(mine, {k: g0[t]["local"][k] for k in mine}), (rank, t)
            assert rejoined[t]["commits"] == g0[t]["commits"], t
        assert g0[STEPS - 1]["commits"] > g0[healed]["commits"]  # synced together since
    _refusals(out)
