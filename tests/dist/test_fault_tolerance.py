"""Fault tolerance: the outer axis as torchft replica groups (2 groups x 2 gloo ranks).

The lighthouse runs in this process; each replica group is a separate two-rank world
(``ft_jobs.py``). One run covers: (a) no failure, steps 0-4: equal to one process on the
global batch; (b) both ranks of group 1 SIGKILLed mid-step 5: group 0 goes on, each step
equal to one process on group 0's data alone; (d) group 1 restarted, killed during the
recovery transfer itself; (c) group 1 restarted again, recovered by step 9 and training
from step 10, its parameters, momentum and lr equal to group 0's bit for bit. A second
test: the lighthouse unreachable at start raises a clear error on every rank. hfsdp on a
fault-tolerant mesh is refused on every rank. The same scenario runs with the peer, torch
FSDP2 over each group's ranks with torchft wired by hand (``library="fsdp2"``). A third:
the live group dies while it sends its state to a joining one (its rank 0 alone, or both):
the joining group's ranks agree the recovery failed, apply and commit nothing, and refuse
to train on from step 0 unless ``allow_lost_progress``. A fourth: the live group's state
holds a type ``weights_only`` refuses: the joining group stops with an error naming it, the
live group goes on committing.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch
import torch.nn as nn
from dist_utils import Forked, free_port
from ft_jobs import batch, build_model, main, make_optimizer
from torchft._torchft import LighthouseServer

STEPS, SEED, KILL_AT, REJOIN_BY, JOIN_AT = 13, 7, 5, 10, 3
DEADLINE_S = 420  # the whole scenario; a hang fails here instead of blocking CI


def _launch(out: str, tag: str, replica: int, library: str = "hsdp",
            **cfg) -> list[Forked]:
    port = free_port()
    procs = []
    for rank in range(2):
        args = {"out": out, "tag": tag, "library": library, "replica": replica,
                "replicas": [0, 1], "rank": rank,
                "port": port, "steps": STEPS, "seed": SEED, "timeout_s": 10, "connect_s": 10,
                **cfg}
        procs.append(Forked(main, args, os.path.join(out, f"{tag}_{rank}.log")))
    return procs


def _wait(procs: list[Forked], deadline: float, out: str) -> list[int]:
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a replica group hung; logs in {out}:\n{_logs(out)}") from None
    return [p.returncode for p in procs]


def _logs(out: str) -> str:
    return "\n".join(f"--- {n}\n{open(os.path.join(out, n)).read()[-3000:]}"
                     for n in sorted(os.listdir(out)) if n.endswith(".log"))


def _records(out: str, tag: str) -> dict[int, dict]:
    return {s: torch.load(os.path.join(out, f"{tag}_step{s}.pt"))
            for s in range(STEPS) if os.path.exists(os.path.join(out, f"{tag}_step{s}.pt"))}


def _reference(records: dict[int, dict]) -> None:
    """One process, the same initial model, each step on the global batch of the replica
    groups that took part in it (group 0 always; group 1 when two took part)."""
    model = build_model(SEED)
    opt, sched = make_optimizer(model)
    for step in range(STEPS):
        rec = records[step]
        live = range(rec["participants"])
        xs, ys = zip(*(batch(step, r, i) for r in live for i in range(2)))
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        for n, p in model.named_parameters():
            torch.testing.assert_close(rec["params"][n], p.detach(), rtol=1e-6, atol=1e-7,
                                       msg=lambda m, n=n, s=step: f"step {s} {n}: {m}")
            torch.testing.assert_close(rec["momenta"][n], opt.state[p]["momentum_buffer"],
                                       rtol=1e-6, atol=1e-7,
                                       msg=lambda m, n=n, s=step: f"step {s} {n} momentum: {m}")
        assert rec["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.parametrize("library", ["hsdp", pytest.param("fsdp2", marks=pytest.mark.full)])
def test_replica_group_lost_and_recovered(tmp_path, library):
    out = str(tmp_path)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=5000,
                                  quorum_tick_ms=50, heartbeat_timeout_ms=1000)
    deadline = time.monotonic() + DEADLINE_S
    try:
        common = dict(lighthouse=lighthouse.address(), library=library)
        # group 0 starts each gated step only once that incarnation of group 1 is up and
        # its quorum request is pending at the lighthouse
        gates = {0: "ready_g1.0", 7: "ready_g1.1", 9: "ready_g1.2"}
        g0 = _launch(out, "g0", 0, gates=gates, await_joiner=True,
                     check_hfsdp=library == "hsdp", **common)
        killed = _launch(out, "g1.0", 1, kill_at=KILL_AT, gates={0: "ready_g0"}, **common)
        assert _wait(killed, deadline, out) == [-9, -9], _logs(out)
        in_transfer = _launch(out, "g1.1", 1, die_in_transfer=True, **common)
        assert _wait(in_transfer, deadline, out) == [-9, -9], _logs(out)
        rejoined = _launch(out, "g1.2", 1, **common)
        assert _wait(g0 + rejoined, deadline, out) == [0, 0, 0, 0], _logs(out)
    finally:
        lighthouse.shutdown()

    # hfsdp cannot be made fault tolerant: refused on every rank
    assert library != "hsdp" or all(os.path.exists(os.path.join(out, f"hfsdp_refused_{r}"))
                                    for r in range(2))
    g0_rec = _records(out, "g0")
    assert sorted(g0_rec) == list(range(STEPS)), _logs(out)
    assert all(r["took_part"] for r in g0_rec.values())
    # (a) no failure yet: both groups in every step
    assert [g0_rec[s]["participants"] for s in range(KILL_AT)] == [2] * KILL_AT
    # (b) the killed group's step was discarded and redone without it
    assert g0_rec[KILL_AT]["participants"] == 1
    # (d) the second incarnation died while receiving the checkpoint
    assert all(os.path.exists(os.path.join(out, f"mid_transfer_g1.1_{r}")) for r in range(2))
    # (c) the third recovered (not taking part in the step it received the state in) and
    # trains in lockstep from then on, equal to group 0 bit for bit
    g1_rec = _records(out, "g1.2")
    healed = min(g1_rec)
    assert not g1_rec[healed]["took_part"] and healed + 1 <= REJOIN_BY, g1_rec.keys()
    assert sorted(g1_rec) == list(range(healed, STEPS))
    for s in range(healed + 1, STEPS):
        assert g1_rec[s]["took_part"] and g0_rec[s]["participants"] == 2, s
    for s, rec in g1_rec.items():
        for what in ("params", "momenta"):
            for n, t in rec[what].items():
                assert torch.equal(t, g0_rec[s][what][n]), (s, what, n)
        assert rec["lr"] == g0_rec[s]["lr"]
    _reference(g0_rec)


@pytest.mark.parametrize("dying,allowed", [
    pytest.param([0], False, id="rank0", marks=pytest.mark.full),
    pytest.param([0, 1], False, id="both", marks=pytest.mark.full),
    pytest.param([0, 1], True, id="both_allowed", marks=pytest.mark.full)])
def test_live_group_dies_while_sending(tmp_path, dying, allowed):
    """Group 0 trains alone; group 1 starts after its step JOIN_AT - 1 and joins at
    step JOIN_AT; asked for its state, its
    ranks in ``dying`` die (rank 0 only once rank 1 has sent everything, so group 1's rank
    1 holds the live state and its rank 0 nothing). Group 1 applies nothing and commits
    nothing on a mixed model: its ranks agree that the recovery failed; left alone at
    step 0, both refuse to train on (the progress is lost) unless ``allow_lost_progress``,
    with which it trains from step 0 with its own initial state."""
    out = str(tmp_path)
    # group 1 must not get a quorum of its own while group 0 is alive (a loaded machine
    # may take seconds to reach the gate): the lighthouse waits for every live group
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60000,
                                  quorum_tick_ms=50, heartbeat_timeout_ms=1000)
    deadline = time.monotonic() + DEADLINE_S
    try:
        common = dict(lighthouse=lighthouse.address())
        live = _launch(out, "g0", 0, gates={JOIN_AT: "ready_g1"}, await_joiner=True,
                       die_sending=dying, **common)
        while not os.path.exists(os.path.join(out, f"g0_step{JOIN_AT - 1}.pt")):
            assert time.monotonic() < deadline and None in [p.poll() for p in live], \
                _logs(out)
            time.sleep(0.05)
        joiner = _launch(out, "g1", 1, allow_lost_progress=allowed, **common)
        joined = _wait(joiner, deadline, out)
        live_codes = _wait(live, deadline, out)
    finally:
        lighthouse.shutdown()
    logs = _logs(out)
    # group 0 is gone: its rank 0 died sending (rank 1 too, unless it failed first, its
    # group's store gone with rank 0); with dying == [0, 1], no rank sent anything
    assert live_codes[0] == -9 and all(c != 0 for c in live_codes), logs
    assert os.path.exists(os.path.join(out, "dies_sending_g0_0"))
    sent = [os.path.exists(os.path.join(out, f"sent_g0_{r}")) for r in range(2)]
    assert sent == [False, dying == [0]], sent
    g1 = {r: open(os.path.join(out, f"g1_{r}.log")).read() for r in range(2)}
    if dying == [0]:  # group 1's rank 1 received everything, its rank 0 nothing
        for r in range(2):
            assert f"recovering step {JOIN_AT} from replica rank 0 failed on 1 of this group's 2 " \
                   "ranks (rank 0: " in g1[r], g1[r][-3000:]
    records = _records(out, "g1")
    if not allowed:
        assert joined == [1, 1], logs
        for r in range(2):
            assert (f"FaultToleranceError: hsdp: this replica group was to recover step "
                    f"{JOIN_AT} from a live group") in g1[r], g1[r][-3000:]
        assert not records  # nothing committed
        return
    assert joined == [0, 0], logs
    assert "allow_lost_progress=True" in g1[0]
    # from step 0 with its own initial state, alone: one process on its data alone
    assert sorted(records) == list(range(STEPS)) and records[0]["participants"] == 1
    model = build_model(SEED)
    opt, sched = make_optimizer(model)
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, 1, i) for i in range(2)))
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        torch.testing.assert_close(records[STEPS - 1]["params"][n], p.detach(), rtol=1e-6,
                                   atol=1e-7)


def test_lighthouse_unreachable(tmp_path):
    out = str(tmp_path)
    start = time.monotonic()
    procs = _launch(out, "lonely", 0, lighthouse=f"http://127.0.0.1:{free_port()}",
                    connect_s=3)
    codes = _wait(procs, start + 120, out)
    logs = _logs(out)
    assert codes == [1, 1], logs
    assert logs.count("FaultToleranceError: hsdp: replica group 0 cannot reach the torchft "
                      "lighthouse") == 2, logs
    assert "torchft_lighthouse --min_replicas 1" in logs


@pytest.mark.full
def test_unloadable_state_stops_the_joiner_not_the_live_group(tmp_path):
    """The live group's recovery state holds a type ``torch.load(weights_only=True)``
    refuses (a numpy learning rate). The joining group's ranks raise at once, naming the
    type and why (retrying cannot succeed), instead of retrying at every quorum; the live
    group goes on alone and commits every step."""
    out = str(tmp_path)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60000,
                                  quorum_tick_ms=50, heartbeat_timeout_ms=1000)
    deadline = time.monotonic() + DEADLINE_S
    try:
        common = dict(lighthouse=lighthouse.address(), numpy_lr=True)
        live = _launch(out, "g0", 0, gates={JOIN_AT: "ready_g1"}, await_joiner=True,
                       **common)
        while not os.path.exists(os.path.join(out, f"g0_step{JOIN_AT - 1}.pt")):
            assert time.monotonic() < deadline and None in [p.poll() for p in live], \
                _logs(out)
            time.sleep(0.05)
        joiner = _launch(out, "g1", 1, **common)
        joined = _wait(joiner, deadline, out)
        live_codes = _wait(live, deadline, out)
    finally:
        lighthouse.shutdown()
    logs = _logs(out)
    assert joined == [1, 1] and live_codes == [0, 0], logs
    for r in range(2):
        g1 = open(os.path.join(out, f"g1_{r}.log")).read()
        assert (f"FaultToleranceError: hsdp: this replica group cannot recover step {JOIN_AT}"
                in g1 and "numpy._core.multiarray.scalar" in g1
                and "torch.serialization.add_safe_globals" in g1), g1[-3000:]
        assert "lost during the transfer" not in g1, g1[-3000:]
    assert not _records(out, "g1")  # nothing applied, nothing committed
    assert sorted(_records(out, "g0")) == list(range(STEPS)), logs
    # the live group redid at most the step of the failed recovery
    g0 = open(os.path.join(out, "g0_0.log")).read()
    assert g0.count("should_commit completed should_commit=false") <= 1, g0[-3000:]
