"""``OptimizerSteps``: one model's part of each optimizer step: checks before
``optimizer.step()``, state adoption and hfsdp's outer all-gather after it, and the users'
grad hooks. The process-wide hooks that call it: ``optim_hooks.py``."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from hsdp.runtime.context import RuntimeContext
from hsdp.runtime.gather import Gathering
from hsdp.runtime.graphs import Graphs
from hsdp.runtime.hooks import in_backward
from hsdp.runtime.recovery import Recovery
from hsdp.sharding.float8_weights import refresh_scales
from hsdp.sharding.group import ParamGroup, owner
from hsdp.sharding.pieces import adopt_state, same_layout
from hsdp.streams.capture import capture_refusal

FIRST_STEP = ("an optimizer step that creates or changes its state (it is checked and "
              "packed on the host)", "run the optimizer's first step eagerly, then capture")

class OptimizerSteps:
    """The optimizer part of a model's runtime: hooks around each step of an optimizer
    that holds the model's parameters, and the users' grad hooks (optimizer in backward)."""

    def __init__(self, ctx: RuntimeContext, gathering: Gathering, recovery: Recovery,
                 graphs: Graphs) -> None:
        self.ctx = ctx
        self.gathering = gathering
        self.recovery = recovery
        self.graphs = graphs
        self._capturing = False  # the step running now is being captured
        self.param_ids = {id(p) for g in ctx.groups for p in (q.sharded for q in g.params)}
        self.shards_outer = any(g.shard_outer for g in ctx.groups)  # hfsdp
        self.float8_groups = [g for g in ctx.groups if g.float8 is not None]
        self._in_grad_hooks = False  # running the users' post-accumulate-grad hooks
        self._stepped = False  # an optimizer stepped in the grad hooks now running
        self._checked_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._adopted_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def check_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse, on every rank and before the step, optimizer state laid out for another
        mesh or strategy (a per-rank ``optimizer.state_dict()`` loaded elsewhere). Checked
        when the state changed size or was replaced (first steps, loads): one tiny
        all-reduce then, none otherwise."""
        key = (id(optimizer.state), len(optimizer.state))
        if self._checked_state.get(optimizer) == key:
            return
        if self._capturing:
            raise capture_refusal(*FIRST_STEP)
        self._checked_state[optimizer] = key
        bad = next((k for p, st in optimizer.state.items() if owner(p) is not None
                    for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0
                    and not same_layout(v, p)), None)
        root = self.ctx.root
        flag = torch.tensor([0.0 if bad is None else 1.0], device=root.device)
        for dim in ("inner", "outer"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=root.mesh.get_group(dim))
        if flag.item():
            del self._checked_state[optimizer]
            raise RuntimeError(
                "hsdp: the optimizer state does not match this model's sharding (a per-rank "
                "optimizer.state_dict() taken on another mesh or strategy?); the step was "
                "not taken. Save and load with hsdp.save / hsdp.load (or hsdp.get_state_dict "
                "/ hsdp.set_state_dict with torch.distributed.checkpoint), which reshard.")

    def before_step(self) -> None:
        if in_backward() and not self._in_grad_hooks:
            raise RuntimeError("hsdp: optimizer.step() called during backward")
        self._capturing = self.graphs.enter("optimizer step")
        self.recovery.settle()
        if not self._capturing:  # the agreement on what the graphs ran (graphs.py)
            self.graphs.check_replayed()
        if self.ctx.step.awaiting_last:
            raise RuntimeError(
                "hsdp: optimizer.step() called while the gradient reduction is still "
                "pending: the last backward ran inside hsdp.microbatch(model, is_last=False) "
                "or with model.set_requires_gradient_sync(False). Run the step's final "
                "microbatch with is_last=True (or outside any hsdp.microbatch context) and "
                "gradient sync on before optimizer.step().")
        self.ctx.streams.compute.begin(f"OPTIMIZER:{self.ctx.root.label}")
        self.ctx.outer.before_step()

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.ctx.streams.compute.end(f"OPTIMIZER:{self.ctx.root.label}")
        for g in self.ctx.trainable:  # the gradients were applied (a skipped step: not)
            g.applied()
        self.ctx.outer.after_step(self.ctx)
        key = (id(optimizer.state), len(optimizer.state))
        if self._adopted_state.get(optimizer) != key:  # new state (first steps, loads)
            if self._capturing:
                raise capture_refusal(*FIRST_STEP)
            adopt_state(optimizer.state)
            for g in self.ctx.trainable:
                g.pack_state(optimizer.state)
            self._adopted_state[optimizer] = key
        if self._in_grad_hooks:
            self._stepped = True  # the float8 scales once, after the last hook
        else:
            self.refresh_float8_scales()
        # In-place foreach ops on DTensors bump no version counter: every group of this
        # model the optimizer holds a parameter of counts as written (which only hfsdp's
        # outer all-gather reads: hsdp skips the walk over every parameter). Another
        # model's groups (a rank's other pipeline stage) are its own after_step's.
        if self.shards_outer:
            for pg in optimizer.param_groups:
                for p in pg["params"]:
                    managed = owner(p)
                    if managed is not None and managed[0] in self.ctx.gid:
                        managed[0].mark_written()
            if not self._in_grad_hooks:  # else once, after the last hook
                self.gathering.refresh_outer_shards()
        if not self._in_grad_hooks:
            self.graphs.end_region(self._capturing)
        self.graphs.step_done()

    def run_grad_hooks(self, reduced: list[ParamGroup]) -> None:
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
        self.gathering.refresh_outer_shards()

    def refresh_float8_scales(self) -> None:
        """New scales for every float8 weight of the model from its current values (on
        compute, after the writes that changed them), before any gather casts with them;
        hfsdp's float8 inner shards are then gathered again with them. Why after each
        optimizer step and not left to the user (torchao's FSDP2 way): a forgotten call
        would cast grown weights with stale scales, saturating them without a word."""
        if not self.float8_groups:
            return
        self.recovery.settle()

        def reduce(t: torch.Tensor, group: dist.ProcessGroup) -> None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)

        refresh_scales([(g.float8, [q.local for q in g.params], g.shard_outer)
                        for g in self.float8_groups],
                       (self.ctx.comms.host_inner, self.ctx.comms.host_outer), reduce)
        for g in self.float8_groups:
            g.rescaled()
