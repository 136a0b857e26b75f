"""``hsdp.DiLoCo``'s schedule (pure): when each fragment synchronizes, what it refuses."""

from __future__ import annotations

import pytest

import hsdp


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


def test_nesterov_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="nesterov must be a bool"):
        hsdp.DiLoCo(nesterov=1)


def test_fault_tolerance_needs_each_outer_step_before_the_next_sync() -> None:
    """With fault tolerance a sync is one torchft quorum and commit, one at a time: the
    delay may not exceed the fewest steps between two syncs (H=10, F=4: 2, 3, 2, 3)."""
    hsdp.DiLoCo(inner_steps=10, fragments=4, delay=2).check_fault_tolerant()
    hsdp.DiLoCo(inner_steps=10, fragments=1, delay=9).check_fault_tolerant()
    with pytest.raises(hsdp.FaultToleranceError, match="syncs as soon as 2 step"):
        hsdp.DiLoCo(inner_steps=10, fragments=4, delay=3).check_fault_tolerant()
