"""A model's ``Step``: the phase and flags, changed only through its methods, with one
``reset()`` back to a clean step that keeps the log and ``broken``."""

from __future__ import annotations

import dataclasses

from hsdp.runtime.step import Phase, Step


def _backward(step: Step, sync: bool = True, is_last: bool | None = None) -> list:
    """One backward through the step's methods: one group reduce-scattered."""
    step.begin_backward(False, sync, is_last)
    if sync:
        step.issued_reduce_scatter("group", "rs_in", "event")
    return step.end_backward()


def test_reset_restores_every_field_of_a_new_step_but_the_log():
    step = Step()
    fresh = dataclasses.asdict(step)
    step.count_forward(backward_expected=True)
    step.begin_backward(True, True, None)
    step.issued_reduce_scatter("group", "rs_in", "event")
    step.issued_outer("outer event")
    step.give_up()
    step.mark_broken("why")
    assert dataclasses.asdict(step) != fresh
    lists = (step.pending_rs, step.outer_events, step.reduced)
    log = step.log
    step.abandon()
    assert step.log is log and (log.step, log.forwards, log.microbatches) == (1, 0, 0)
    assert step.broken == "why"
    kept = {"log", "broken"}
    assert {k: v for k, v in dataclasses.asdict(step).items() if k not in kept} == {
        k: v for k, v in fresh.items() if k not in kept}
    assert all(new is not old for new, old in
               zip((step.pending_rs, step.outer_events, step.reduced), lists))


def test_end_backward_sets_the_next_microbatchs_flags():
    step = Step()
    assert _backward(step, is_last=False) == []  # a non-last synced microbatch
    assert (step.phase, step.awaiting_last, step.first_microbatch, step.rs_first) == (
        Phase.IDLE, True, False, False)
    assert step.log.step == 0
    assert _backward(step) == ["group"]  # the last one: the next step's log
    assert (step.awaiting_last, step.first_microbatch, step.rs_first) == (False, True, True)
    assert (step.log.step, step.log.microbatches) == (1, 0)
    step = Step()
    _backward(step, sync=False)  # no sync: no RS ran, is_last is off
    assert (step.awaiting_last, step.first_microbatch, step.rs_first) == (True, False, True)


def test_rs_inputs_are_released_but_those_kept():
    step = Step()
    step.begin_backward(False, True, None)
    for g in ("a", "b", "c"):
        step.issued_reduce_scatter(g, f"in {g}", f"ev {g}")
    assert step.release_rs_inputs(keep=["b"]) == ["ev a", "ev c"]
    assert step.pending_rs == [("b", "in b", "ev b")]
    assert step.release_rs_inputs() == ["ev b"] and step.pending_rs == []


def test_a_forward_fails_only_inside_the_forward():
    step = Step()
    step.fail_forward()
    assert step.phase is Phase.IDLE
    step.count_forward(backward_expected=False)
    step.begin_forward(capturing=False)
    step.fail_forward()
    assert step.phase is Phase.FAILED and step.log.forwards == 1
