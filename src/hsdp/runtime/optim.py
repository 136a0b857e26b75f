"""Optimizer integration: checks before ``optimizer.step()``, state adoption after it,
through hooks on each optimizer that holds fully_shard-ed parameters."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

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

# Process-wide: torch's optimizer-step hook is global; it finds the models here (weak).
STEPPERS: weakref.WeakSet[OptimizerSteps] = weakref.WeakSet()  # each model's (runtime.py)


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
        self.param_ids = {id(p) for g in ctx.groups for p in g.sharded}
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
            g.grads.applied()
        self.ctx.outer.after_step(self.ctx)
        key = (id(optimizer.state), len(optimizer.state))
        if self._adopted_state.get(optimizer) != key:  # new state (first steps, loads)
            if self._capturing:
                raise capture_refusal(*FIRST_STEP)
            adopt_state(optimizer.state)
            for g in self.ctx.trainable:
                g.state.pack_state(optimizer.state)
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
                        managed[0].gather.mark_written()
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
                g.grads.run_grad_hooks()
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

        refresh_scales([(g.float8, g.buffers.float8_pieces(), g.shard_outer)
                        for g in self.float8_groups],
                       (self.ctx.comms.host_inner, self.ctx.comms.host_outer), reduce)
        for g in self.float8_groups:
            g.float8.version = g.buffers.version()
            if g.shard_outer:
                g.gather.mark_written()


# Process-wide: torch's global optimizer hook (``_detect``) sees every optimizer (weak).
# optimizer -> its number of parameters when ``_detect`` last looked at it
_SEEN: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_ATTACHED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_DETECTOR: list = []  # the handle of ``_detect``, once the first fully_shard installed it


def watch_optimizers() -> None:
    """Find the optimizers that step fully_shard-ed parameters (the first fully_shard calls
    this; importing hsdp installs nothing). One global pre-step hook looks at each
    optimizer once (again when its parameters change): it refuses an optimizer built
    before fully_shard and gives one that holds hsdp's parameters hsdp's own step hooks
    (``attach_optimizer``), which run from that step on."""
    if not _DETECTOR:
        _DETECTOR.append(register_optimizer_step_pre_hook(_detect))


def _detect(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    params = [p for pg in optimizer.param_groups for p in pg["params"]]
    if _SEEN.get(optimizer) == len(params):
        return
    stale = sum(getattr(p, "_hsdp_moved_to", None) is not None for p in params)
    if stale:
        raise RuntimeError(
            f"hsdp: this optimizer holds {stale} parameter(s) that fully_shard has replaced by "
            f"their shards, so its step would not change the model. Build the optimizer after "
            f"fully_shard, from model.parameters().")
    _SEEN[optimizer] = len(params)
    if any(owner(p) is not None for p in params):
        attach_optimizer(optimizer)  # torch runs its hooks from this step on


def attach_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` hsdp's step hooks: before the step, abandon a failed step and
    check the gradients are final and the state matches the sharding; after it, adopt the
    state and (hfsdp) issue the outer all-gather. Done at the optimizer's first step;
    calling it earlier puts hsdp's pre-step hook before hooks registered later. A
    container of optimizers (an optimizer with a list ``optimizers`` whose step runs
    theirs, as torchtitan's ``OptimizersContainer``) gets none: its optimizers get them,
    else each step would run them twice (hfsdp: every outer all-gather twice)."""
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, list) and inner and all(
            isinstance(o, torch.optim.Optimizer) for o in inner):
        for o in inner:
            attach_optimizer(o)
        return
    if optimizer not in _ATTACHED:
        _ATTACHED.add(optimizer)
        optimizer.register_step_pre_hook(_before_step)
        optimizer.register_step_post_hook(_after_step)


def steppers_of(optimizer: torch.optim.Optimizer) -> list[OptimizerSteps]:
    """The models whose parameters ``optimizer`` holds, in the order of their first
    parameter in it: the same on every rank. Why not ``STEPPERS``' order: a set's order
    follows object addresses, which differ between ranks, and the models' collectives
    after the step (hfsdp's outer all-gathers of a rank's pipeline stages, which share
    communicators) must be issued in one order everywhere."""
    params = [id(p) for pg in optimizer.param_groups for p in pg["params"]]
    first = {}
    for steps in list(STEPPERS):
        at = next((i for i, p in enumerate(params) if p in steps.param_ids), None)
        if at is not None:
            first[steps] = at
    return sorted(first, key=first.__getitem__)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for steps in steppers_of(optimizer):
        steps.ctx.outer.check_optimizer(optimizer)
        steps.before_step()
        steps.check_optimizer_state(optimizer)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for steps in steppers_of(optimizer):
        steps.after_step(optimizer)
