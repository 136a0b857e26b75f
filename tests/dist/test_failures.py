"""Failure semantics (docs/guide/failure_semantics.md) on 4 gloo ranks (a 2x2 mesh),
each rank its own process, so that a hang shows as a hang (bounded by short timeouts).

Job 1 runs every recoverable case in one spawn and compares the trained parameters with a
single-process reference (SGD with momentum, same global batch; a skipped step is skipped
there too). Jobs 2 (ranks run different numbers of microbatches) and 3 (a rank stops
taking part) leave hsdp's communicators unusable, so each has its own spawn.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist_utils import run_ranks
from torch.distributed.device_mesh import init_device_mesh

import hsdp
from hsdp.runtime.note_board import post_note, read_note
from hsdp.topology.communicators import comm_groups

WORLD = 4
V, H, ROWS = 11, 8, 2  # vocabulary, hidden size, rows per rank
STEPS = 4
LR, MOMENTUM = 0.1, 0.9
TOL = 1e-5
JOB_TIMEOUT_S = 300


class Injected(Exception):
    """The failure a test injects (a stand-in for an out-of-memory error, say)."""


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise Injected("backward")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.fail = ""  # "forward" / "backward": raise there

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail == "forward":
            raise Injected("forward")
        y = torch.tanh(self.lin(x))
        return _FailBackward.apply(y) if self.fail == "backward" else y


class Net(nn.Module):
    def __init__(self, tie: bool = False, twice: bool = False, bn: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.BatchNorm1d(H) if bn else nn.Identity()
        self.head = nn.Linear(H, V, bias=False)
        self.spare = nn.Linear(H, H)  # no rank uses it
        self.branch = nn.Linear(H, H)  # used while use_branch is set
        if tie:
            self.head.weight = self.emb.weight
        self.twice = twice
        self.use_branch = False
        self.outside = ""  # use blocks[0]'s bias outside its unit: "shard" / "local"

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if self.twice and i == 1:
                x = blk(x)  # the same unit twice in one forward
        if self.use_branch:
            x = x + self.branch(x)
        if self.outside == "shard":  # the DTensor shard, with a plain tensor
            x = x + self.blocks[0].lin.bias
        elif self.outside == "local":  # its local piece: a gradient hsdp would lose
            x = x + self.blocks[0].lin.bias.to_local().sum()
        return self.head(self.norm(x))


@dataclass(frozen=True)
class Case:
    name: str
    strategy: str = "hsdp"
    overlap: bool = True
    micro: int = 1
    tie: str = ""  # "root": emb in the root, head its own unit; "siblings": both units
    twice: bool = False
    branch: bool = False  # only rank 0 uses model.branch
    fail_where: str = ""  # "forward" / "backward": raise there; "outside": see Net.outside
    fail_step: int = 1
    fail_micro: int = 0
    fail_blocks: tuple[int, ...] = ()  # per rank: the block that raises (-1: none)
    outside: str = ""  # Net.outside in the failing step
    state_after_fail: bool = False  # full_state_dict right after the failure


CASES = [
    Case("tie_root", tie="root", micro=2),
    Case("tie_root_hfsdp", strategy="hfsdp", tie="root"),
    Case("tie_siblings", tie="siblings"),
    Case("twice", twice=True, micro=2),
    Case("unused", branch=True),
    Case("bwd_fail_same", fail_where="backward", fail_blocks=(1, 1, 1, 1),
         state_after_fail=True),
    Case("bwd_fail_diff", fail_where="backward", fail_blocks=(0, 1, 2, 1)),
    Case("bwd_fail_one", fail_where="backward", fail_blocks=(-1, 2, -1, -1)),
    Case("fwd_fail_diff", fail_where="forward", fail_blocks=(2, 0, 1, -1)),
    Case("micro_fail", micro=2, fail_where="backward", fail_blocks=(1, 1, 1, 1)),
    Case("outside_shard", fail_where="outside", fail_blocks=(0, 0, 0, 0), outside="shard"),
    Case("outside_local", fail_where="outside", fail_blocks=(0, 0, 0, 0), outside="local"),
    Case("hfsdp_serial_fail_diff", strategy="hfsdp", overlap=False, fail_where="backward",
         fail_step=2, fail_blocks=(2, 0, -1, 1)),
]


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    tokens = torch.randint(0, V, (WORLD * ROWS,), generator=g)
    return tokens, (3 * tokens + 1) % V


def _shard(model: Net, mesh, case: Case) -> None:
    kw = dict(mesh=mesh, strategy=case.strategy, overlap_outer=case.overlap)
    for blk in model.blocks:
        hsdp.fully_shard(blk, **kw)
    if case.tie == "siblings":
        hsdp.fully_shard(model.emb, **kw)
    if case.tie:
        hsdp.fully_shard(model.head, **kw)
    hsdp.fully_shard(model, **kw)


def _loss(model: Net, rank: int | None, step: int, micro: int, case: Case) -> torch.Tensor:
    """rank None: the reference, the mean over every rank's rows (each with its branch)."""
    tokens, targets = _batch(step, micro)
    ranks = range(WORLD) if rank is None else [rank]
    total = 0.0
    for r in ranks:
        rows = slice(r * ROWS, (r + 1) * ROWS)
        model.use_branch = case.branch and r == 0
        total = total + F.cross_entropy(model(tokens[rows]), targets[rows]) / len(ranks)
    return total / case.micro


def _train(model: Net, rank: int | None, case: Case, info: dict) -> list[str]:
    """STEPS steps; a step whose forward or backward raises is skipped (the reference skips
    it too). Returns the errors seen, one per skipped step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    errors = []
    for step in range(STEPS):
        try:
            if rank is None and case.fail_where and step == case.fail_step:
                continue
            for m in range(case.micro):
                failing = rank is not None and step == case.fail_step and m == case.fail_micro
                block = case.fail_blocks[rank] if failing and case.fail_where else -1
                for i, b in enumerate(model.blocks):
                    b.fail = case.fail_where if i == block else ""
                model.outside = case.outside if block >= 0 else ""
                if rank is None:
                    _loss(model, None, step, m, case).backward()
                    continue
                with hsdp.microbatch(model, is_last=m == case.micro - 1):
                    _loss(model, rank, step, m, case).backward()
        except (Injected, RuntimeError) as exc:
            errors.append(" ".join([f"{type(exc).__name__}: {exc}",
                                    *getattr(exc, "__notes__", ())]))
            if case.state_after_fail:
                info["state_after_fail"] = sorted(hsdp.full_state_dict(model))
            continue
        finally:
            for b in model.blocks:
                b.fail = ""
            model.outside = ""
        if step == 0 and rank is not None:
            info["spare_grads"] = [p.grad is not None for p in model.spare.parameters()]
            info["branch_grads"] = [p.grad is not None for p in model.branch.parameters()]
        opt.step()
        opt.zero_grad()
    return errors


def _rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item() for k in got)


def _run_case(rank: int, mesh, case: Case) -> dict:
    torch.manual_seed(0)
    ref = Net(tie=bool(case.tie), twice=case.twice)
    model = copy.deepcopy(ref)
    _shard(model, mesh, case)
    info: dict = {"num_params": len(list(model.parameters())),
                  "ref_num_params": len(list(ref.parameters()))}
    info["errors"] = _train(model, rank, case, info)
    _train(ref, None, case, {})
    state = hsdp.full_state_dict(model)
    info["keys"] = sorted(state)
    info["rel_err"] = _rel_err(state, ref.state_dict())
    return info


def _misuse(rank: int, mesh) -> dict:
    """Rows 7, 8, 14: each refused with an hsdp error; the model still trains correctly."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    early = torch.optim.SGD(model.parameters(), lr=LR)  # built before fully_shard
    case = Case("misuse")
    _shard(model, mesh, case)
    out = {}
    try:
        model.blocks[0](torch.randn(ROWS, H))  # a quick check of one block
    except RuntimeError as exc:
        out["child_first"] = str(exc)
    try:
        with hsdp.microbatch(model.blocks[0], is_last=False):
            pass
    except ValueError as exc:
        out["microbatch_child"] = str(exc)
    _loss(model, rank, 0, 0, case).backward()
    try:
        early.step()
    except RuntimeError as exc:
        out["stale_optimizer"] = str(exc)
    torch.optim.SGD(model.parameters(), lr=LR).zero_grad()
    _train(model, rank, case, {})
    _train(ref, None, case, {})
    out["rel_err"] = _rel_err(hsdp.full_state_dict(model), ref.state_dict())
    return out


def _batchnorm(rank: int, mesh) -> dict:
    """Row 13: full_state_dict holds rank 0's buffers on every rank."""
    torch.manual_seed(0)
    model = Net(bn=True)
    _shard(model, mesh, Case("bn"))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(2):
        _loss(model, rank, step, 0, Case("bn")).backward()
        opt.step()
        opt.zero_grad()
    return {"local": model.norm.running_mean.clone(),
            "state": hsdp.full_state_dict(model)["norm.running_mean"]}


def _evaluation_log(rank: int, mesh) -> list[int]:
    """Forward-only passes (evaluation) do not grow the step log: one pass's collectives."""
    torch.manual_seed(0)
    model = Net()
    case = Case("eval")
    _shard(model, mesh, case)
    _loss(model, rank, 0, 0, case).backward()
    sizes = []
    with torch.no_grad():
        for step in range(4):
            _loss(model, rank, step, 0, case)
            sizes.append(len(model._hsdp_unit.runtime.log.ops))
    return sizes


def recoverable_job(rank: int, world: int) -> dict:
    mesh = hsdp.init_mesh(2, 2, "cpu", timeout=timedelta(seconds=30))
    # A mesh of the user's own: hsdp's groups get the default group's timeout.
    user_mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("outer", "inner"))
    out = {"timeout": comm_groups(mesh).timeout, "default": comm_groups(user_mesh).timeout,
           "misuse": _misuse(rank, mesh), "bn": _batchnorm(rank, mesh),
           "eval_log": _evaluation_log(rank, mesh)}
    for case in CASES:
        out[case.name] = _run_case(rank, mesh, case)
    # The last case (hfsdp) ends with optimizer.step(): its outer all-gather may still run
    # while the launcher destroys the process group without hsdp.synchronize (row 11).
    return out


DEFAULT_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def recoverable() -> list[dict]:
    return run_ranks(recoverable_job, WORLD, timeout=JOB_TIMEOUT_S,
                     pg_timeout_s=DEFAULT_TIMEOUT_S)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_case_matches_reference(recoverable, case: Case) -> None:
    for r, res in enumerate(recoverable):
        info = res[case.name]
        assert info["rel_err"] < TOL, (r, info)
        assert info["num_params"] == info["ref_num_params"], info  # ties stay one parameter
        if case.fail_where:
            assert len(info["errors"]) == 1, (r, info["errors"])  # just the failed step
            # A rank without an injected failure (or blocked before reaching it) gets hsdp's.
            error = info["errors"][0]
            # A piece taken with to_local() may first fail torch's own shape check in
            # backward on some ranks; an error it is, on every rank, and the step recovers.
            assert "hsdp:" in error or (case.fail_blocks[r] >= 0 and error.startswith(
                "RuntimeError" if case.outside == "local" else "Injected")), (r, info)
        else:
            assert info["errors"] == [], (r, info["errors"])


def test_state_dict_right_after_a_failed_backward(recoverable) -> None:
    keys = [res["bwd_fail_same"]["keys"] for res in recoverable]
    assert all(res["bwd_fail_same"]["state_after_fail"] == k for res, k in zip(recoverable, keys))


def test_unused_parameters_get_no_gradient(recoverable) -> None:
    for res in recoverable:
        info = res["unused"]
        assert info["spare_grads"] == [False, False]  # no rank used it: None, as with DDP
        assert info["branch_grads"] == [True, True]  # rank 0 used it: the mean, every rank


def test_misuse_is_refused_on_every_rank_and_the_model_stays_usable(recoverable) -> None:
    for res in recoverable:
        m = res["misuse"]
        assert "outside the forward of the model" in m["child_first"]
        assert "expected the root module" in m["microbatch_child"]
        assert "Build the optimizer after fully_shard" in m["stale_optimizer"]
        assert m["rel_err"] < TOL


def test_buffers_in_the_full_state_dict_are_rank_0s(recoverable) -> None:
    bn = [res["bn"] for res in recoverable]
    assert not torch.equal(bn[0]["local"], bn[1]["local"])  # each rank's own statistics
    assert all(torch.equal(b["state"], bn[0]["local"]) for b in bn)


def test_evaluation_does_not_grow_the_step_log(recoverable) -> None:
    for res in recoverable:
        sizes = res["eval_log"]
        assert sizes[0] > 0 and len(set(sizes[1:])) == 1 and sizes[-1] <= sizes[0], sizes


def test_timeouts_of_hsdp_groups(recoverable) -> None:
    assert all(res["timeout"] == timedelta(seconds=30) for res in recoverable)  # init_mesh's
    assert all(res["default"] == timedelta(seconds=DEFAULT_TIMEOUT_S) for res in recoverable)


# --------------------------------------------------------------------------- hangs


MISMATCH_TIMEOUT_S = 30  # generous: detection must win on a loaded 2-core machine too


def microbatch_mismatch_job(rank: int, world: int) -> dict:
    """Row 5: rank 0 runs 2 microbatches in a step, the others 3."""
    mesh = hsdp.init_mesh(2, 2, "cpu", timeout=timedelta(seconds=MISMATCH_TIMEOUT_S))
    torch.manual_seed(0)
    model = Net()
    case = Case("mismatch")
    _shard(model, mesh, case)
    n = 2 if rank == 0 else 3
    t0 = time.monotonic()
    errors = []
    try:
        for m in range(n):
            with hsdp.microbatch(model, is_last=m == n - 1):
                _loss(model, rank, 0, m, case).backward()
    except RuntimeError as exc:
        errors.append(str(exc))
    try:
        hsdp.synchronize(model)  # what a rank that caught the error would reach next
    except RuntimeError as exc:
        errors.append(str(exc))
    return {"errors": errors, "seconds": time.monotonic() - t0}


def test_ranks_disagreeing_on_microbatches_fail_clearly_before_the_timeout() -> None:
    results = run_ranks(microbatch_mismatch_job, WORLD, timeout=JOB_TIMEOUT_S)
    for r, res in enumerate(results):
        assert res["errors"] and all(e.startswith("hsdp:") for e in res["errors"]), (r, res)
        assert any("cannot be recovered" in e or "disagree" in e for e in res["errors"]), res
        assert res["seconds"] < MISMATCH_TIMEOUT_S, (r, res)  # detected, not the timeout


def test_a_later_end_does_not_hide_an_earlier_one_or_a_failure(monkeypatch) -> None:
    """Row 5's notes: a rank ending the step after 3 microbatches must not overwrite the
    note of one that ended after 2, which ranks blocked in microbatch 3 need to see (under
    load this raced into the timeout); a failure is kept over any end."""
    store = dist.HashStore()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    post_note("k", "ended 0 2")
    post_note("k", "ended 2 3")
    assert read_note("k") == "ended 0 2"
    post_note("k", "ended 3 1")
    assert read_note("k") == "ended 3 1"
    post_note("k", "failed 1 3")
    post_note("k", "ended 2 1")
    assert read_note("k") == "failed 1 3"


STUCK_TIMEOUT_S = 3.0


def stuck_rank_job(rank: int, world: int) -> dict:
    """Row 2: rank 3 never takes part in the step; the others raise within a few of hsdp's
    timeouts instead of hanging."""
    mesh = hsdp.init_mesh(2, 2, "cpu", timeout=timedelta(seconds=STUCK_TIMEOUT_S))
    torch.manual_seed(0)
    model = Net()
    case = Case("stuck")
    _shard(model, mesh, case)
    store = dist.distributed_c10d._get_default_store()
    out = {"timeout": comm_groups(mesh).timeout.total_seconds()}
    if rank == 3:
        store.wait([f"done{r}" for r in range(3)], timedelta(seconds=60))
        return out
    t0 = time.monotonic()
    try:
        _loss(model, rank, 0, 0, case).backward()
        hsdp.synchronize(model)
    except RuntimeError as exc:
        out["error"] = str(exc)
    out["seconds"] = time.monotonic() - t0
    store.set(f"done{rank}", "1")
    return out


def test_a_stuck_rank_makes_the_others_raise_within_the_timeout() -> None:
    results = run_ranks(stuck_rank_job, WORLD, timeout=JOB_TIMEOUT_S)
    assert all(res["timeout"] == STUCK_TIMEOUT_S for res in results)
    for r, res in enumerate(results[:3]):
        assert res.get("error", "").startswith("hsdp:"), (r, res)
        assert res["seconds"] < 3 * STUCK_TIMEOUT_S + 2, (r, res)


def test_the_slow_agreement_watch_fires_only_when_still_armed() -> None:
    """The agreement's slow-wait callback (which leaves the note blocked peers read) runs
    once its time has passed, not after a disarm, and again when re-armed."""
    from hsdp.runtime.slow_watch import SlowWatch
    watch, fired = SlowWatch(), []
    armed = watch.arm(0.05, lambda: fired.append("a"))
    watch.disarm(armed)
    watch.arm(0.05, lambda: fired.append("b"))
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert fired == ["b"]
    watch.arm(0.01, lambda: fired.append("c"))
    while len(fired) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fired == ["b", "c"]
