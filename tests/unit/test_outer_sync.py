"""``hsdp.DiLoCo``'s schedule (pure): when each fragment synchronizes, what it refuses;
with fault tolerance, what a sync applies (torchft's Manager stubbed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hsdp
from hsdp.runtime.outer_modes import parse_mode


def _sync_steps(cfg: hsdp.DiLoCo, fragment: int, steps: int) -> list[int]:
    return [s for s in range(1, steps + 1) if s % cfg.inner_steps == cfg.offset(fragment)]


def test_fragments_sync_every_h_steps_staggered_by_h_over_f() -> None:
    cfg = hsdp.DiLoCo(inner_steps=10, fragments=4)
    assert [_sync_steps(cfg, f, 30) for f in range(4)] == [
        [2, 12, 22], [5, 15, 25], [7, 17, 27], [10, 20, 30]]
    one = hsdp.DiLoCo(inner_steps=10, fragments=1)
    assert _sync_steps(one, 0, 30) == [10, 20, 30]


def test_h1_syncs_every_fragment_every_step() -> None:
    cfg = hsdp.DiLoCo(inner_steps=1, fragments=4)
    assert all(_sync_steps(cfg, f, 5) == [1, 2, 3, 4, 5] for f in range(4))


def test_fragments_must_divide_the_units() -> None:
    hsdp.DiLoCo(fragments=4).check_units(8)
    with pytest.raises(ValueError, match="fragments=3 does not divide the model's 4"):
        hsdp.DiLoCo(fragments=3).check_units(4)


@pytest.mark.parametrize("kwargs", [{"inner_steps": 0}, {"inner_steps": 2.0},
                                    {"fragments": 0}, {"outer_lr": -1.0}, {"momentum": 1.0},
                                    {"inner_steps": 5, "delay": 5}, {"delay": -1}])
def test_bad_settings_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="hsdp.DiLoCo: "):
        hsdp.DiLoCo(**kwargs)


@pytest.mark.parametrize("text", ["diloco:outer_lr=inf", "diloco:outer_lr=1e400"])
@pytest.mark.parametrize("how", ["constructor", "command line"])
def test_a_non_finite_outer_lr_is_refused(text: str, how: str) -> None:
    """inf (1e400 is inf too) would make every parameter inf or NaN at the first sync."""
    lr = float(text.partition("=")[2])
    with pytest.raises(ValueError, match="outer_lr must be finite, got inf: the first outer"):
        hsdp.DiLoCo(outer_lr=lr) if how == "constructor" else parse_mode("outer_sync", text)


def test_an_int_outer_lr_too_large_for_a_float_is_refused() -> None:
    with pytest.raises(ValueError, match="outer_lr must be finite, got 1000"):
        hsdp.DiLoCo(outer_lr=10 ** 400)


def test_nesterov_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="nesterov must be a bool"):
        hsdp.DiLoCo(nesterov=1)


def test_fault_tolerance_needs_each_outer_step_before_the_next_sync() -> None:
    """With fault tolerance a sync is one torchft quorum and commit, one at a time: the
    delay may not exceed the fewest steps between two syncs (H=10, F=4: 2, 3, 2, 3)."""
    ft = hsdp.FaultTolerance()
    hsdp.DiLoCo(inner_steps=10, fragments=4, delay=2).check_mesh(ft)
    hsdp.DiLoCo(inner_steps=10, fragments=1, delay=9).check_mesh(ft)
    hsdp.DiLoCo(inner_steps=10, fragments=4, delay=3).check_mesh(None)  # no quorums
    with pytest.raises(hsdp.FaultToleranceError, match="syncs as soon as 2 step"):
        hsdp.DiLoCo(inner_steps=10, fragments=4, delay=3).check_mesh(ft)


class _Manager:
    """torchft's Manager as hsdp's sync drives it: its step counts the commits."""

    def __init__(self, commit: bool) -> None:
        self.commit, self.step, self.quorums = commit, 0, 0

    def current_step(self) -> int:
        return self.step

    def start_quorum(self) -> None:
        self.quorums += 1

    def should_commit(self) -> bool:
        self.step += self.commit
        return self.commit


def _ft_sync(manager: _Manager) -> tuple[object, object, object]:
    """An OuterSync (H=2, one fragment, outer_lr=1, no momentum) over one group whose
    all-reduce over the replica groups is the identity, and a runtime stub."""
    from hsdp.runtime.diloco import OuterSync
    from hsdp.sharding.anchor import Anchor

    cfg = hsdp.DiLoCo(inner_steps=2, outer_lr=1.0, momentum=0.0)
    comms = SimpleNamespace(elastic=SimpleNamespace(manager=manager), grad_outer=None)
    group = SimpleNamespace(anchor=Anchor(cfg), comms=comms, main=torch.zeros(4),
                            compressed=None, label="unit/0")
    done = SimpleNamespace(synchronize=lambda: None)
    stream = SimpleNamespace(submit=lambda fn, after, label: fn() or done)
    rt = SimpleNamespace(
        streams=SimpleNamespace(compute=SimpleNamespace(record=lambda: done,
                                                        wait=lambda ev: None)),
        stream_of=lambda kind: stream, logged=lambda kind, g, ev: ev,
        coll=SimpleNamespace(all_reduce=lambda t, group, axis, avg: None))
    return OuterSync(cfg, [SimpleNamespace(groups=[group])]), group, rt


def _inner_step(sync: object, group: object, rt: object) -> None:
    sync.before_step()
    group.main += 1.0  # the optimizer
    sync.after_step(rt)


@pytest.mark.parametrize("commit", [True, False])
def test_fault_tolerant_sync_applies_only_what_commits(commit: bool) -> None:
    manager = _Manager(commit)
    sync, group, rt = _ft_sync(manager)
    _inner_step(sync, group, rt)
    assert manager.quorums == 0  # mid-period: no quorum
    _inner_step(sync, group, rt)
    assert manager.quorums == 1
    # committed: the outer step (anchor - 1 * (anchor - main)); else back to the anchor
    assert torch.equal(group.anchor.anchor, torch.full((4,), 2.0 if commit else 0.0))
    assert torch.equal(group.main, group.anchor.anchor)


def test_a_loop_that_commits_on_its_own_is_told() -> None:
    manager = _Manager(True)
    sync, group, rt = _ft_sync(manager)
    for _ in range(2):
        _inner_step(sync, group, rt)
    manager.should_commit()  # the per-step loop of fault tolerance without DiLoCo
    _inner_step(sync, group, rt)
    with pytest.raises(RuntimeError, match="must not call manager.start_quorum"):
        _inner_step(sync, group, rt)
