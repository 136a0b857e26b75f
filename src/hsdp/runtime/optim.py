"""Optimizer integration: checks before ``optimizer.step()``, state adoption after it,
through hooks on each optimizer that holds fully_shard-ed parameters."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hsdp.runtime.hooks import in_backward
from hsdp.sharding.float8_weights import refresh_scales
from hsdp.sharding.group import owner
from hsdp.sharding.pieces import adopt_state, same_layout

if TYPE_CHECKING:
    from hsdp.runtime.runtime import Runtime

RUNTIMES: weakref.WeakSet[Runtime] = weakref.WeakSet()



class OptimizerSteps:
    """The optimizer part of ``Runtime``."""

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self.param_ids for pg in optimizer.param_groups for p in pg["params"])

    def _check_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse, on every rank and before the step, optimizer state laid out for another
        mesh or strategy (a per-rank ``optimizer.state_dict()`` loaded elsewhere). Checked
        when the state changed size or was replaced (first steps, loads): one tiny
        all-reduce then, none otherwise."""
        key = (id(optimizer.state), len(optimizer.state))
        if self._checked_state.get(optimizer) == key:
            return
        self._checked_state[optimizer] = key
        bad = next((k for p, st in optimizer.state.items() if owner(p) is not None
                    for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0
                    and not same_layout(v, p)), None)
        flag = torch.tensor([0.0 if bad is None else 1.0], device=self.root.device)
        for dim in ("inner", "outer"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.root.mesh.get_group(dim))
        if flag.item():
            del self._checked_state[optimizer]
            raise RuntimeError(
                "hsdp: the optimizer state does not match this model's sharding (a per-rank "
                "optimizer.state_dict() taken on another mesh or strategy?); the step was "
                "not taken. Save and load with hsdp.save / hsdp.load (or hsdp.get_state_dict "
                "/ hsdp.set_state_dict with torch.distributed.checkpoint), which reshard.")

    def _before_optimizer_step(self) -> None:
        if in_backward() and not self._in_grad_hooks:
            raise RuntimeError("hsdp: optimizer.step() called during backward")
        self.settle()
        if self.step.awaiting_last:
            raise RuntimeError(
                "hsdp: optimizer.step() called while the gradient reduction is still "
                "pending: the last backward ran inside hsdp.microbatch(model, is_last=False) "
                "or with model.set_requires_gradient_sync(False). Run the step's final "
                "microbatch with is_last=True (or outside any hsdp.microbatch context) and "
                "gradient sync on before optimizer.step().")
        self.streams.compute.begin(f"OPTIMIZER:{self.root.label}")
        if self.outer_sync is not None:
            self.outer_sync.before_step()

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.streams.compute.end(f"OPTIMIZER:{self.root.label}")
        if self.outer_sync is not None:
            self.outer_sync.after_step(self)
        key = (id(optimizer.state), len(optimizer.state))
        if self._adopted_state.get(optimizer) != key:  # new state (first steps, loads)
            adopt_state(optimizer.state)
            for g in self.trainable:
                g.pack_state(optimizer.state)
            self._adopted_state[optimizer] = key
        if self._in_grad_hooks:
            self._stepped = True  # the float8 scales once, after the last hook
        else:
            self.refresh_float8_scales()
        # In-place foreach ops on DTensors bump no version counter: every group the
        # optimizer holds a parameter of counts as written (which only hfsdp's outer
        # all-gather reads: hsdp skips the walk over every parameter).
        if not self.shards_outer:
            return
        for pg in optimizer.param_groups:
            for p in pg["params"]:
                managed = owner(p)
                if managed is not None:
                    managed[0].mark_written()
        if not self._in_grad_hooks:  # else once, after the last hook
            self._refresh_outer_shards()

    def refresh_float8_scales(self) -> None:
        """New scales for every float8 weight of the model from its current values (on
        compute, after the writes that changed them), before any gather casts with them;
        hfsdp's float8 inner shards are then gathered again with them. Why after each
        optimizer step and not left to the user (torchao's FSDP2 way): a forgotten call
        would cast grown weights with stale scales, saturating them without a word."""
        if not self.float8_groups:
            return
        self.settle()

        def reduce(t: torch.Tensor, group: dist.ProcessGroup) -> None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)

        refresh_scales([(g.float8, g.float8_pieces(), g.shard_outer)
                        for g in self.float8_groups],
                       (self.comms.host_inner, self.comms.host_outer), reduce)
        for g in self.float8_groups:
            g.float8.version = g.version()
            if g.shard_outer:
                g.mark_written()


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
    calling it earlier puts hsdp's pre-step hook before hooks registered later."""
    if optimizer not in _ATTACHED:
        _ATTACHED.add(optimizer)
        optimizer.register_step_pre_hook(_before_step)
        optimizer.register_step_post_hook(_after_step)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for rt in list(RUNTIMES):
        if rt._owns(optimizer):
            if rt.outer_sync is not None:
                rt.outer_sync.check_optimizer(optimizer)
            rt._before_optimizer_step()
            rt._check_optimizer_state(optimizer)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for rt in list(RUNTIMES):
        if rt._owns(optimizer):
            rt._after_optimizer_step(optimizer)
