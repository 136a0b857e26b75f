"""A model's step state: a phase enum and one ``reset()`` back to a clean step."""

from __future__ import annotations

import dataclasses

from hsdp.runtime.state import Phase, StepState


def test_reset_restores_every_field_of_a_new_step():
    state = StepState()
    fresh = dataclasses.asdict(state)
    state.phase, state.first_microbatch, state.rs_first = Phase.FAILED, False, False
    state.awaiting_last, state.sync, state.is_last, state.gave_up = True, False, False, True
    state.pending_rs.append(("group", "rs_in", "event"))
    state.outer_events.append("event")
    state.reduced.append("group")
    assert dataclasses.asdict(state) != fresh
    lists = (state.pending_rs, state.outer_events, state.reduced)
    state.reset()
    assert dataclasses.asdict(state) == fresh
    assert all(new is not old for new, old in
               zip((state.pending_rs, state.outer_events, state.reduced), lists))


def test_end_backward_sets_the_next_microbatchs_flags():
    state = StepState(phase=Phase.BACKWARD, is_last=False)  # a non-last synced microbatch
    state.end_backward()
    assert (state.phase, state.awaiting_last, state.first_microbatch, state.rs_first) == (
        Phase.IDLE, True, False, False)
    state.phase, state.is_last = Phase.BACKWARD, True  # the last one
    state.end_backward()
    assert (state.awaiting_last, state.first_microbatch, state.rs_first) == (False, True, True)
    state = StepState(phase=Phase.BACKWARD, sync=False, is_last=False)  # no sync: no RS ran
    state.end_backward()
    assert (state.awaiting_last, state.first_microbatch, state.rs_first) == (True, False, True)
