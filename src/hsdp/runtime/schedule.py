"""The overlap schedule of ``docs/design.md``: forward, backward, reduction issue, finalize.

A ``Unit`` (``unit.py``) is one ``fully_shard``-ed module. The outermost unit to run a
forward becomes the root and owns the ``Runtime`` (``runtime.py``) shared by every unit
below it: the named streams, the recorded execution order, microbatch state and the
end-of-backward finalize. Its all-gathers are in ``gather.py``, failure handling in
``recovery.py``, the optimizer hooks in ``optim.py``.

Where each step of docs/design.md lives:
- forward AG_i, prefetch AG_{i+1} before DO_i ... ``_pre_forward`` / ``_post_forward``
- backward AG_{i-1} prefetch before RS_i ......... ``_pre_backward``
- copy-in, RS_i, outer_i (last microbatch) ........ ``_reduce``
- finalize: compute waits rs / outer events ........ ``_finalize``
- hfsdp outer AG after ``optimizer.step()`` ........ ``_refresh_outer_shards``

Compute phases (``streams.compute.begin`` / ``end``, nested): ``FWD:<unit>`` from a unit's
forward pre-hook to its post-hook (``RECOMPUTE:<unit>`` when activation checkpointing
runs it again in backward), ``BWD:<unit>`` from its pre-backward to its post-backward,
``COPY_IN:<group>``, ``OPTIMIZER:<root>``. The simulator prices compute by phase; on CUDA
and CPU they are trace marks.

Failures (docs/guide/failure_semantics.md): every collective is logged and the step's structure
is agreed on at its end (``agreement.py``); a step whose forward or backward raised is
abandoned consistently on every rank by the next call into hsdp (``Runtime.settle``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from hsdp.runtime.hooks import (
    PostBackward,
    cast_floats,
    cast_inputs,
    in_backward,
    outside_root,
    plain_call,
)
from hsdp.runtime.state import Phase
from hsdp.sharding.group import ParamGroup
from hsdp.streams.op_table import OpKind

if TYPE_CHECKING:
    from hsdp.runtime.unit import Unit


class Schedule:
    """The overlap policy of ``Runtime``: forward, backward, reduction issue, finalize."""

    # ------------------------------------------------------------------ forward

    def _begin_forward(self) -> None:
        self.settle()
        self.streams.compute.poll = self._poll
        if not self.log.microbatches and not self._backward_expected:
            # Only forward-only passes since the last agreement (evaluation): every rank
            # issued all their collectives, so the log need not grow with them.
            self.log.forget()
        self.log.forwards += 1
        for u in self.units:  # a forward whose backward never ran leaves buffers behind
            u.swap(False)
            for g in u.groups:
                g.sync_requires_grad()
            self._reshard(u)
        if self.step.first_microbatch:  # shards unchanged between microbatches of a step
            self._params_written = self.streams.compute.record()
            self._release_cleared_grads()
        self._refresh_outer_shards()

    def _release_cleared_grads(self) -> None:
        """Once the user has cleared the gradients (zero_grad), free their buffers until
        the next reduce-scatter needs them, so they are not held through the forward."""
        groups = [g for u in self.units for g in u.with_grads
                  if g.grads_live and not g.grads_exposed()]
        if groups:
            # rs / outer wait: the optimizer on compute may still read the gradients.
            read = self.streams.compute.record()
            for g in groups:
                g.release_grads(self.stream_of(OpKind.FREE_ACCUM),
                                self.stream_of(OpKind.FREE_GRAD_BUF), [read])

    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict):
        if unit.input_dtype is not None:
            args, kwargs = cast_inputs(args, kwargs, unit.input_dtype)
        if in_backward():  # recomputation: gather again, keep it until unit's backward
            self.streams.compute.begin(f"RECOMPUTE:{unit.label}")
            self._unshard(unit)
            self._prefetch(unit, "backward")
            if unit.pending_bwd:  # non-reentrant: the forward's PostBackward is still due
                return args, kwargs
            return self._attach_post_backward(unit, args, kwargs)
        if unit is not self.root and self.step.phase is not Phase.FORWARD:
            raise RuntimeError(outside_root(unit))
        self.streams.compute.begin(f"FWD:{unit.label}")
        if unit is self.root:
            self._begin_forward()
            self.step.phase = Phase.FORWARD
        if self._recording is not None and unit not in self._recording:
            self._recording.append(unit)
        self._unshard(unit)
        self._prefetch(unit, "forward")  # AG_{i+1} before unit i's buffer is released
        return self._attach_post_backward(unit, args, kwargs)

    def _post_forward(self, unit: Unit, output: Any) -> Any:
        unit.swap(False)
        if unit.output_dtype is not None:
            output = cast_floats(output, unit.output_dtype)
        if in_backward():
            self.streams.compute.end(f"RECOMPUTE:{unit.label}")
            return output
        expects_backward = self._register_pre_backward(unit, output)
        if unit is self.root:
            self._backward_expected = expects_backward
        # The root stays gathered for the backward, which starts with it. Every other unit
        # is resharded unless reshard_after_forward=False (as FSDP2; torchtitan sets it on
        # the last block): keeping the last one gathered would add a unit's parameters to
        # the loss computation's peak, for one all-gather that the root's backward hides.
        keep = unit is self.root or not unit.reshard_after_forward
        if not (keep and expects_backward):
            self._reshard(unit)
        if unit is self.root:
            if self._recording is not None:
                unseen = [u for u in self.units if u not in self._recording]
                self._set_order(self._recording + unseen)
                self._recording = None
            self.step.phase = Phase.IDLE
            self.streams.compute.poll = None  # the streams are shared: hold no model
        self.streams.compute.end(f"FWD:{unit.label}")
        return output

    def _attach_post_backward(self, unit: Unit, args: tuple, kwargs: dict):
        """Make ``_post_backward(unit)`` run once the backward of this call is done. A unit
        called several times is reduced after the last of its calls' backwards."""
        if not torch.is_grad_enabled():
            return args, kwargs
        plain = plain_call(args, kwargs)
        flat, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            if not in_backward():
                unit.unattached += 1  # only the finalize knows this call's backward is done
            return args, kwargs
        unit.pending_bwd += 1
        outs = PostBackward.apply(self, unit, *(flat[i] for i in idx))
        for i, t in zip(idx, outs):
            flat[i] = t
        return (tuple(flat), kwargs) if plain else tree_unflatten(flat, spec)

    def _register_pre_backward(self, unit: Unit, output: Any) -> bool:
        if not torch.is_grad_enabled():
            return False
        def hook(_grad: Any) -> None:
            self._pre_backward(unit)

        if isinstance(output, torch.Tensor):
            # One tensor (the common block output): its own hook runs once per backward
            # through it, as the multi-grad hook would, at a third of the cost.
            if output.requires_grad:
                output.register_hook(hook)
            return output.requires_grad
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, hook, mode="any")
        return bool(tensors)

    # ------------------------------------------------------------------ backward

    def _begin_backward(self) -> None:
        self.step.phase = Phase.BACKWARD
        self.streams.compute.poll = self._poll
        self.log.microbatches += 1
        override = self.root.is_last_override
        self.step.sync = self.root.gradient_sync
        self.step.is_last = (True if override is None else override) and self.step.sync
        if self.step.first_microbatch:  # uncleared gradients are accumulated into, as in torch
            for u in self.units:
                for g in u.with_grads:
                    g.hide_grads()
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _pre_backward(self, unit: Unit) -> None:
        if self.step.phase is not Phase.BACKWARD:
            self._begin_backward()
        if unit.backward_started:
            return
        unit.backward_started = True
        self.streams.compute.begin(f"BWD:{unit.label}")
        self._unshard(unit)
        self._prefetch(unit, "backward")  # AG_{i-1} before RS_i is issued

    def _post_backward(self, unit: Unit, final: bool = False) -> None:
        """After the backward of ``unit``'s (last) call; ``final``: the finalize, for units
        whose PostBackward never ran."""
        if not final:
            unit.pending_bwd -= 1
            if unit.pending_bwd > 0 or unit.unattached:
                return  # another call's backward still needs the gathered parameters
        if unit.backward_done:
            return
        unit.backward_done = True
        unit.swap(False)
        # Free first: the FREE (and every all-gather queued behind it on ag) then waits
        # for this unit's backward only, not for the reduce-scatter waits below.
        self._reshard(unit)
        for g in unit.uses:  # a tied group is reduced once every unit using it is done
            if (g.requires_grad and not g.reduced
                    and all(u.backward_done for u in self._users[g])):
                self._reduce(g)
        if unit.backward_started:
            self.streams.compute.end(f"BWD:{unit.label}")

    def _reduce(self, g: ParamGroup) -> None:
        if self.step.phase is not Phase.BACKWARD:
            raise RuntimeError("hsdp: gradient reduction outside backward")
        # At most one unit's RS inputs alive (as FSDP2): the previous unit's are released
        # before this one's is allocated, which waits for their RS (one unit's backward ago).
        self._release_rs_inputs(keep=self._owner[g].groups)
        self.streams.compute.begin(f"COPY_IN:{g.label}")
        rs_in = g.copy_in()
        self.streams.compute.end(f"COPY_IN:{g.label}")
        if not self.step.sync:  # no communication: the gradients stay here until a synced one
            g.keep_local(rs_in)
            return
        if self.step.is_last:
            self.step.reduced.append(g)
        copied = self.streams.compute.record()
        outer_next = self.step.is_last and g.has_outer_reduction
        # rs waits: the reduce-scatter reads rs_in, written on compute by the copy-in.
        ev_rs = self._logged(OpKind.REDUCE_SCATTER, g, g.reduce_scatter(
            self.stream_of(OpKind.REDUCE_SCATTER), self.coll, rs_in, self.step.rs_first, [copied],
            outer_next))
        self.step.pending_rs.append((g, rs_in, ev_rs))
        if outer_next:
            # outer waits: it reduces the inner shard that RS_i has just accumulated.
            self.step.outer_events.append(
                self._logged(g.outer_reduction, g, g.outer_reduce(
                    self.stream_of(g.outer_reduction), self.coll, [ev_rs])))

    def _release_rs_inputs(self, keep: Sequence[ParamGroup] = ()) -> None:
        """Drop the RS inputs of every group but ``keep``'s (normally: the previous unit's,
        when the next unit's copy-in needs the memory)."""
        kept = []
        for g, rs_in, ev in self.step.pending_rs:
            if g in keep:
                kept.append((g, rs_in, ev))
                continue
            # compute waits: rs_in was allocated on compute and is read by RS on rs; its
            # memory may only return to compute's pool once that RS has finished.
            self.streams.compute.wait(ev)
        self.step.pending_rs = kept

    def _finalize(self) -> None:
        """End of backward (autograd engine callback): leftovers, the step agreement on the
        last microbatch, then stream waits."""
        for unit in reversed(self.order):
            self._post_backward(unit, final=True)
        self._release_rs_inputs()
        if self.step.is_last:
            verdict = self._agree(failed="", on_slow=lambda: self._note("ended"))
            if not verdict.ok:
                msg = verdict.message(self.log.step)
                self._abandon()
                raise RuntimeError(msg)
            for ev in self.step.outer_events:
                # compute waits: the optimizer reads grads the outer reduction produced.
                self.streams.compute.wait(ev)
            self.step.outer_events.clear()
            used = iter(verdict.used)
            for g in self.trainable:
                g.expose_grads([next(used) for _ in g.used])
            self.log.next_step()
        self.step.end_backward()
        self._reset_units()
        self.streams.compute.poll = None
        reduced, self.step.reduced = self.step.reduced, []
        if self.step.is_last:
            self._run_grad_hooks(reduced)

    def _run_grad_hooks(self, reduced: list[ParamGroup]) -> None:
        """The users' post-accumulate-grad hooks, as FSDP2 runs them: once a step's
        gradients are final (reduced and exposed), group by group in reduction order. An
        optimizer may step in them (optimizer-in-backward); hfsdp then refreshes the outer
        shards once, after the last hook."""
        self._in_grad_hooks = True
        self._stepped = False
        try:
            for g in reduced:
                g.run_grad_hooks()
        finally:
            self._in_grad_hooks = False
        if self._stepped:
            self.refresh_float8_scales()
        self._refresh_outer_shards()

    def _reset_units(self) -> None:
        for u in self.units:
            u.backward_started = u.backward_done = False
            u.pending_bwd = u.unattached = 0
        for g in self.trainable:
            g.reset_backward()
