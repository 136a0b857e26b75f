"""The outer-axis interface (``topology/outer_mode.py``): a new mode is one class plus one
entry in ``runtime/outer_modes.MODES``. A toy ``outer_sync`` mode, registered here and
nowhere in the core, is parsed, checked, attached to every group and driven through
training steps by the schedule; its refusals reach CUDA-graph capture and
``set_all_reduce_hook``; its per-group state travels through ``hsdp.save`` / ``load`` and
torch's ``get_state_dict`` / ``set_state_dict`` by its hooks alone."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import hsdp
from hsdp.runtime import outer_modes
from hsdp.topology.outer_mode import OuterMode, OuterSchedule


class _Calls(OuterSchedule):
    """The toy's schedule: every ``period`` steps, the groups' parameters go back to what
    they were before the period's first step (each replica 'syncs' to its anchor)."""

    def __init__(self, mode: _Toy, units: list) -> None:
        self.mode, self.groups = mode, [g for u in units for g in u.groups if g.requires_grad]
        self.steps, self.saved = 0, None
        mode.log.append(("schedule", len(units)))

    def check_optimizer(self, optimizer: Any) -> None:
        self.mode.log.append(("check_optimizer", self.steps))

    def before_step(self) -> None:
        if self.saved is None:
            self.saved = [g.main.clone() for g in self.groups]

    def after_step(self, ctx: Any) -> None:
        self.steps += 1
        if self.steps % self.mode.period == 0:
            for g, s in zip(self.groups, self.saved):
                g.main.copy_(s)
                g.toy_syncs += 1
            self.saved = None
            self.mode.log.append(("sync", self.steps))


@dataclass(frozen=True)
class _Toy(OuterMode):
    period: int = 2
    log: list = None  # what the hooks saw

    argument: ClassVar[str] = "outer_sync"
    forms: ClassVar[str] = "toy[:PERIOD]"
    reduces_every_step: ClassVar[bool] = False
    state_key: ClassVar[str] = "toy_outer_state"
    state_name: ClassVar[str] = "toy sync count"

    def __hash__(self) -> int:
        return id(self)

    @classmethod
    def parse(cls, text: str) -> _Toy | None:
        kind, _, period = text.partition(":")
        return None if kind != "toy" else cls(int(period or 2), [])

    def check_shard(self, strategy, comms, device, params, names) -> None:
        self.log.append(("check_shard", tuple(names)))

    def attach(self, group: Any) -> None:
        group.toy = self
        group.toy_syncs = torch.zeros(1)
        self.log.append(("attach", group.label))

    def state_dict(self, group: Any, opt_state: Any) -> dict[str, torch.Tensor]:
        return {"syncs": group.toy_syncs.clone()} if group.requires_grad else {}

    def load_state_dict(self, group: Any, state: dict, opt_state: Any) -> None:
        group.toy_syncs = state.get("syncs", torch.zeros(1)).clone()

    def schedule(self, units: Any) -> OuterSchedule:
        return _Calls(self, list(units))

    def capture_refusal(self, group: Any) -> tuple[str, str]:
        return ("the toy outer sync", "run it eagerly")

    def hook_refusal(self, group: Any) -> str:
        return "the toy outer sync: no all-reduce"


def _register(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(outer_modes.MODES, "outer_sync", (*outer_modes.MODES["outer_sync"],
                                                          _Toy))


def _toy_model(period: int = 2) -> tuple[nn.Module, _Toy]:
    toy = _Toy(period, [])
    mesh = hsdp.init_mesh(1, 1, "cpu", outer_sync=toy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    hsdp.fully_shard(model[0], mesh=mesh)
    hsdp.fully_shard(model, mesh=mesh)
    return model, toy


def _syncs(model: nn.Module) -> list[float]:
    return [g.toy_syncs.item() for u in (model[0]._hsdp_unit, model._hsdp_unit)
            for g in u.groups]


@pytest.fixture
def gloo_world_1():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_a_registered_toy_mode_runs_through_the_schedule(gloo_world_1, monkeypatch) -> None:
    _register(monkeypatch)
    assert outer_modes.parse_mode("outer_sync", "diloco") == hsdp.DiLoCo()
    toy = outer_modes.parse_mode("outer_sync", "toy:2")
    assert toy.period == 2 and toy.log == []
    mesh = hsdp.init_mesh(1, 1, "cpu", outer_sync=toy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    hsdp.fully_shard(model[0], mesh=mesh)
    hsdp.fully_shard(model, mesh=mesh)
    assert [e[0] for e in toy.log] == ["check_shard", "attach", "check_shard", "attach"]
    assert all(g.toy is toy and not g.grads.has_outer_reduction
               for u in (model[0]._hsdp_unit, model._hsdp_unit) for g in u.groups)
    with pytest.raises(ValueError, match="not supported with the toy outer sync"):
        model.set_all_reduce_hook(lambda t: None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = [p.detach().full_tensor().clone() for p in model.parameters()]
    for step in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 1:  # the period's end: back to the values before its first step
            assert all(torch.equal(p.detach().full_tensor(), s)
                       for p, s in zip(model.parameters(), start))
    assert not all(torch.equal(p.detach().full_tensor(), s)
                   for p, s in zip(model.parameters(), start))  # step 3: its own update
    assert [e for e in toy.log if e[0] in ("schedule", "sync")] == [("schedule", 2),
                                                                   ("sync", 2)]
    assert [e[1] for e in toy.log if e[0] == "check_optimizer"] == [0, 1, 2]
    graphs = model._hsdp_unit.runtime.graphs
    assert ("the toy outer sync", "run it eagerly") in graphs.refusals("forward")


def test_a_registered_toy_mode_carries_its_state_through_checkpoints(gloo_world_1,
                                                                      monkeypatch) -> None:
    """The toy's sync counts (its state_dict / load_state_dict hooks; no checkpoint code
    names it) come back through hsdp.save / load and torch's get / set_state_dict, and a
    full optimizer state dict refuses them."""
    _register(monkeypatch)
    model, _ = _toy_model(period=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert _syncs(model) == [3.0, 3.0]
    msd, osd = hsdp.get_state_dict(model, opt)
    assert sorted(osd["toy_outer_state"]) == ["/0@syncs", "0/0@syncs"]
    with tempfile.TemporaryDirectory() as d:
        hsdp.save(f"{d}/ckpt", model, opt)
        loaded, _ = _toy_model()
        lopt = torch.optim.SGD(loaded.parameters(), lr=0.1)
        assert _syncs(loaded) == [0.0, 0.0]
        hsdp.load(f"{d}/ckpt", loaded, lopt)
        assert _syncs(loaded) == [3.0, 3.0]
    other, _ = _toy_model()
    oopt = torch.optim.SGD(other.parameters(), lr=0.1)
    hsdp.set_state_dict(other, oopt, model_state_dict=msd, optim_state_dict=osd)
    assert _syncs(other) == [3.0, 3.0]
    # last: torch steps a stateless optimizer (SGD) once to build its state
    with pytest.raises(ValueError, match="cannot hold this model's toy sync count"):
        get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
