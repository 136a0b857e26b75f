"""The overlap schedule of ``docs/design.md``: forward, backward, reduction issue, finalize.

A ``Unit`` (``unit.py``) is one ``fully_shard``-ed module. The outermost unit to run a
forward becomes the root and owns the ``Runtime`` (``runtime.py``) shared by every unit
below it. ``Schedule`` receives what it shares with the runtime's other parts (the
``RuntimeContext`` of ``context.py``: units, groups, streams, op table, and the ``Step``
of ``step.py``, changed through its methods) and those parts: the all-gathers
(``Gathering``, ``gather.py``), failure handling (``Recovery``, ``recovery.py``), CUDA
graphs (``Graphs``, ``graphs.py``) and the optimizer steps (``OptimizerSteps``,
``optim_steps.py``).

Where each step of docs/design.md lives:
- forward AG_i, prefetch AG_{i+1} before DO_i ... ``pre_forward`` / ``post_forward``
- backward AG_{i-1} prefetch before RS_i ......... ``_pre_backward``
- copy-in, RS_i, outer_i (last microbatch) ........ ``reduce``
- finalize: compute waits rs / outer events ........ ``_finalize``
- hfsdp outer AG after ``optimizer.step()`` ........ ``Gathering.refresh_outer_shards``

Compute phases (``streams.compute.begin`` / ``end``, nested): ``FWD:<unit>`` from a unit's
forward pre-hook to its post-hook (``RECOMPUTE:<unit>`` when activation checkpointing
runs it again in backward), ``BWD:<unit>`` from its pre-backward to its post-backward,
``COPY_IN:<group>``, ``OPTIMIZER:<root>``. The simulator prices compute by phase; on CUDA
and CPU they are trace marks.

Failures (docs/guide/failure_semantics.md): every collective is logged and the step's structure
is agreed on at its end (``agreement.py``); a step whose forward or backward raised is
abandoned consistently on every rank by the next call into hsdp (``Recovery.settle``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from hsdp.runtime.context import RuntimeContext
from hsdp.runtime.gather import Gathering
from hsdp.runtime.graphs import Graphs
from hsdp.runtime.hooks import (
    PostBackward,
    cast_floats,
    cast_inputs,
    in_backward,
    outside_root,
    plain_call,
)
from hsdp.runtime.optim_steps import OptimizerSteps
from hsdp.runtime.recovery import Recovery
from hsdp.runtime.step import Phase
from hsdp.sharding.group import ParamGroup
from hsdp.streams.op_table import OpKind

if TYPE_CHECKING:
    from hsdp.runtime.unit import Unit


class Schedule:
    """The overlap policy of a model's runtime: forward, backward, reduction issue,
    finalize. Which units use (``_users``) and own (``_owner``) each group is its own."""

    def __init__(self, ctx: RuntimeContext, gathering: Gathering, recovery: Recovery,
                 optim: OptimizerSteps, graphs: Graphs) -> None:
        self.ctx = ctx
        self.gathering = gathering
        self.recovery = recovery
        self.optim = optim
        self.graphs = graphs
        self._users: dict[ParamGroup, list[Unit]] = {g: [] for g in ctx.groups}
        self._owner = {g: u for u in ctx.units for g in u.groups}
        for u in ctx.units:
            for g in u.uses:
                if g not in ctx.gid:
                    raise RuntimeError(
                        f"hsdp: {u.label} shares a parameter with {g.label}, which is not "
                        f"part of this model; tie parameters only within one model")
                self._users[g].append(u)
        self._backward_expected = False  # the last root forward's output needs a backward

    # ------------------------------------------------------------------ forward

    def _begin_forward(self) -> bool:
        """A root forward starts (before its phase does); whether it is captured."""
        capturing = self.graphs.enter("forward")
        self.recovery.settle()
        self.ctx.streams.compute.watch(self.recovery.poll)
        self.ctx.step.count_forward(self._backward_expected)
        for u in self.ctx.units:  # a forward whose backward never ran leaves buffers behind
            u.swap(False)
            for g in u.groups:
                g.sync_requires_grad()
            self.gathering.release(u)
        if self.ctx.step.first_microbatch:  # shards unchanged between microbatches of a step
            self.gathering.mark_params_written()
            self.ctx.release_cleared_grads(self.graphs.graphed)
        self.gathering.refresh_outer_shards()
        return capturing

    def pre_forward(self, unit: Unit, args: tuple, kwargs: dict):
        if unit.input_dtype is not None:
            args, kwargs = cast_inputs(args, kwargs, unit.input_dtype)
        if in_backward():  # recomputation: gather again, keep it until unit's backward
            self.ctx.streams.compute.begin(f"RECOMPUTE:{unit.label}")
            self.gathering.unshard_now(unit)
            self.gathering.prefetch(unit, "backward")
            if unit.pending_bwd:  # non-reentrant: the forward's PostBackward is still due
                return args, kwargs
            return self._attach_post_backward(unit, args, kwargs)
        if unit is not self.ctx.root and self.ctx.step.phase is not Phase.FORWARD:
            raise RuntimeError(outside_root(unit))
        self.ctx.streams.compute.begin(f"FWD:{unit.label}")
        if unit is self.ctx.root:
            self.ctx.step.begin_forward(self._begin_forward())
        self.gathering.record(unit)
        self.gathering.unshard_now(unit)
        self.gathering.prefetch(unit, "forward")  # AG_{i+1} before unit i's buffer is released
        return self._attach_post_backward(unit, args, kwargs)

    def post_forward(self, unit: Unit, output: Any) -> Any:
        unit.swap(False)
        if unit.output_dtype is not None:
            output = cast_floats(output, unit.output_dtype)
        if in_backward():
            self.ctx.streams.compute.end(f"RECOMPUTE:{unit.label}")
            return output
        expects_backward = self._register_pre_backward(unit, output)
        if unit is self.ctx.root:
            self._backward_expected = expects_backward
        # The root stays gathered for the backward, which starts with it. Every other unit
        # is resharded unless reshard_after_forward=False (as FSDP2; torchtitan sets it on
        # the last block): keeping the last one gathered would add a unit's parameters to
        # the loss computation's peak, for one all-gather that the root's backward hides.
        keep = unit is self.ctx.root or not unit.reshard_after_forward
        if not (keep and expects_backward):
            self.gathering.release(unit)
        if unit is self.ctx.root:
            self.gathering.end_recording()
            if not expects_backward:  # the region ends here
                self.graphs.end_region(self.ctx.step.capturing)
            self.ctx.step.end_forward()
            self.ctx.streams.compute.watch(None)  # the streams are shared: hold no model
        self.ctx.streams.compute.end(f"FWD:{unit.label}")
        return output

    def _attach_post_backward(self, unit: Unit, args: tuple, kwargs: dict):
        """Make ``post_backward(unit)`` run once the backward of this call is done. A unit
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
        self.ctx.step.begin_backward(self.graphs.enter("backward"), self.ctx.root.gradient_sync,
                                     self.ctx.root.is_last_override)
        self.ctx.streams.compute.watch(self.recovery.poll)
        if self.ctx.step.first_microbatch:  # uncleared gradients are accumulated into, as in torch
            for u in self.ctx.units:
                for g in u.with_grads:
                    g.hide_grads(self.ctx.step.capturing, self.ctx.step.is_last)
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _pre_backward(self, unit: Unit) -> None:
        if self.ctx.step.phase is not Phase.BACKWARD:
            self._begin_backward()
        if unit.backward_started:
            return
        unit.backward_started = True
        self.ctx.streams.compute.begin(f"BWD:{unit.label}")
        self.gathering.unshard_now(unit)
        self.gathering.prefetch(unit, "backward")  # AG_{i-1} before RS_i is issued

    def post_backward(self, unit: Unit, final: bool = False) -> None:
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
        self.gathering.release(unit)
        for g in unit.uses:  # a tied group is reduced once every unit using it is done
            if (g.awaits_reduction
                    and all(u.backward_done for u in self._users[g])):
                self.reduce(g)
        if unit.backward_started:
            self.ctx.streams.compute.end(f"BWD:{unit.label}")

    def reduce(self, g: ParamGroup) -> None:
        """Copy-in, RS_i and (last microbatch) outer_i of group ``g``, whose gradients are
        all in (the group calls this)."""
        ctx, step = self.ctx, self.ctx.step
        if step.phase is not Phase.BACKWARD:
            raise RuntimeError("hsdp: gradient reduction outside backward")
        # At most one unit's RS inputs alive (as FSDP2): the previous unit's are released
        # before this one's is allocated, which waits for their RS (one unit's backward ago).
        self._release_rs_inputs(keep=self._owner[g].groups)
        ctx.streams.compute.begin(f"COPY_IN:{g.label}")
        rs_in = g.copy_in()
        ctx.streams.compute.end(f"COPY_IN:{g.label}")
        if not step.sync:  # no communication: the gradients stay here until a synced one
            g.keep_local(rs_in)
            return
        copied = ctx.streams.compute.record()
        outer = g.outer_reduction if step.is_last else None
        # rs waits: the reduce-scatter reads rs_in, written on compute by the copy-in.
        ev_rs = ctx.logged(OpKind.REDUCE_SCATTER, g, g.reduce_scatter(
            ctx.stream_of(OpKind.REDUCE_SCATTER), ctx.coll, rs_in, step.rs_first, [copied],
            outer is not None))
        step.issued_reduce_scatter(g, rs_in, ev_rs)
        if outer is not None:
            # outer waits: it reduces the inner shard that RS_i has just accumulated.
            step.issued_outer(ctx.logged(outer, g, g.reduce_outer(
                ctx.stream_of(outer), ctx.coll, [ev_rs])))

    def _agree_or_keep(self, capturing: bool) -> list[bool]:
        """The step agreement's gradient flags; in a capture (no CPU collective there),
        this rank's, the structure kept for the agreement outside the graph."""
        if capturing:
            self.graphs.keep_captured()
            return self.graphs.used
        verdict = self.recovery.agree(failed="", on_slow=lambda: self.recovery.note("ended"))
        if not verdict.ok:
            msg = verdict.message(self.ctx.step.log.step)
            self.recovery.abandon()
            raise RuntimeError(msg)
        return verdict.used

    def _release_rs_inputs(self, keep: Sequence[ParamGroup] = ()) -> None:
        """Drop the RS inputs of every group but ``keep``'s (normally: the previous unit's,
        when the next unit's copy-in needs the memory)."""
        for ev in self.ctx.step.release_rs_inputs(keep):
            # compute waits: rs_in was allocated on compute and is read by RS on rs; its
            # memory may only return to compute's pool once that RS has finished.
            self.ctx.streams.compute.wait(ev)

    def _finalize(self) -> None:
        """End of backward (autograd engine callback): leftovers, the step agreement on the
        last microbatch, then stream waits."""
        for unit in reversed(self.gathering.order):
            self.post_backward(unit, final=True)
        self._release_rs_inputs()
        capturing = self.ctx.step.capturing
        if self.ctx.step.is_last:
            used = iter(self._agree_or_keep(capturing))
            for ev in self.ctx.step.take_outer_events():
                # compute waits: the optimizer reads grads the outer reduction produced.
                self.ctx.streams.compute.wait(ev)
            for g in self.ctx.trainable:
                g.expose_grads([next(used) for _ in g.used])
        self.graphs.end_region(capturing)
        reduced = self.ctx.step.end_backward()
        self.ctx.reset_units()
        self.ctx.streams.compute.watch(None)
        if self.ctx.step.is_last:
            self.optim.run_grad_hooks(reduced)
