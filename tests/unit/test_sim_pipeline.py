"""hsdp_tools.sim.pipeline: a 1F1B step priced from one stage's simulated step."""

from __future__ import annotations

import dataclasses

import pytest

from hsdp_tools.models import preset
from hsdp_tools.sim.costs import CostModel
from hsdp_tools.sim.engine import Setup
from hsdp_tools.sim.fabric import Fabric, Link
from hsdp_tools.sim.pipeline import StageTimes, pipeline_step, simulate_pipeline


def test_first_stage_pays_its_tail_later_stages_hide_it_in_the_drain():
    """4 stages, 6 microbatches, a microbatch 30 ms a stage (10 of it backward, 2 more
    for the serialized schedule's delay), 22 ms of outer tail: stage s has s x 12 ms of
    drain, so stages 2 and 3 hide it (1 without the delay); the step is 9 slots, the delay
    once per stage, and stage 0's time after its last backward."""
    t = StageTimes(slot=30.0, bwd=10.0, delay=2.0, after=40.0, tail=22.0)
    got = pipeline_step(t, pp=4, microbatches=6)
    assert got["step_ms"] == pytest.approx(9 * 30 + 4 * 2 + 40)
    assert got["bubble_ms"] == pytest.approx(3 * 30)
    assert got["hides"] == 2
    assert pipeline_step(dataclasses.replace(t, delay=0.0), 4, 6)["hides"] == 1


def test_serialized_outer_reduction_costs_once_per_stage_on_a_slow_link():
    """An outer link slow enough that a unit's outer reduce-scatter outlasts the next
    unit's backward: the serialized schedule ends each stage's last backward later, and
    the drain carries that delay through every stage, so what the overlap buys grows
    with the stages."""
    stage = Setup(preset("llama-8b", layers=2, seq=1024), 2, 1, "hfsdp", microbatches=2)
    costs = CostModel(Fabric(Link(370.0, 20.0), Link(2.0, 20.0)), 600.0)
    two, four = (simulate_pipeline(stage, costs, pp) for pp in (2, 4))
    assert 0 < two["saving_ms"] < four["saving_ms"]
    assert four["serial"]["step_ms"] > four["overlap"]["step_ms"]
