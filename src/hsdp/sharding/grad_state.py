"""A parameter group's gradient state: which parameters got a gradient, the gradients
kept without sync, carried across steps, exposed to and hidden from the optimizer."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn as nn

from hsdp.sharding.pieces import as_dtensor, placeholders_if_empty, same_layout
from hsdp.sharding.write_guard import direct


class GradientState:
    """The gradient state machine of ``ParamGroup`` (a mixin)."""

    def _init_grad_state(self) -> None:
        S, C = self.layout.shard_numel, self.layout.chunk_numel
        device = self.main.device
        self.accum = torch.empty(S, dtype=self.orig_dtype, device=device)
        self.grad_buf = (torch.empty(C, dtype=self.orig_dtype, device=device)
                         if self.shard_outer else self.accum)
        # The sharded .grad DTensors, made once (while the storage exists), then freed.
        locals_ = placeholders_if_empty([self.grad_buf[a:a + n] for a, n in self._slices])
        self._grad_views = [as_dtensor(local, dspec, start, n, groups)
                            for local, (_, n), dspec, start, groups in zip(
                                locals_, self._slices, self.specs, self.shard_starts,
                                self._groups_of)]
        self._placeholder_grads = [g._local_tensor for g, (_, n) in
                                   zip(self._grad_views, self._slices) if n == 0]
        for buf in {id(b): b for b in (self.accum, self.grad_buf)}.values():
            buf.untyped_storage().resize_(0)
        self.grads_live = False  # host view: buffers allocated (or about to be)
        segments = self.layout.segments()
        self._segment_sizes = [n for n, _ in segments]
        self._gap_segments = [j for j, (_, i) in enumerate(segments) if i is None]
        self._param_segments = [j for j, (_, i) in enumerate(segments) if i is not None]
        self.received: set[int] = set()
        self.used = [False] * len(self.unsharded)  # got a gradient on this rank in this step
        self.local_grads: torch.Tensor | None = None  # unsynced microbatches' gradients
        self._to_outer: torch.Tensor | None = None  # reduce_scatter's result for outer_reduce
        self.carry: torch.Tensor | None = None  # [C]: uncleared .grads (see hide_grads)
        self.carried: list[bool] = []  # which parameters had a .grad then
        self.reduced = False
        me = weakref.ref(self)  # see __init__
        for idx, up in enumerate(self.unsharded):
            frozen = not up.requires_grad
            up.requires_grad_(True)  # a hook needs it
            up.register_post_accumulate_grad_hook(lambda _p, idx=idx: me()._on_grad(idx))
            up.requires_grad_(not frozen)
        self.has_grads = True

    def sync_requires_grad(self) -> None:
        """Follow ``requires_grad_`` changes made on the sharded parameters since
        fully_shard (FSDP2 does the same at each unshard): a frozen parameter gets no
        gradient, no reduction and no update; a group with none trainable is not reduced."""
        with direct():
            now = [p.requires_grad for p in self.sharded]
        if now == self.param_requires_grad:
            return
        if any(now) and not self.has_grads:
            if self.strategy.shards_outer:
                module, name = self.slots[now.index(True)][0]
                raise RuntimeError(
                    f"hsdp: {type(module).__name__}.{name} was frozen when fully_shard ran; "
                    f"with strategy='hfsdp' its shards cannot become trainable later (they "
                    f"are not sharded over outer). Set requires_grad before fully_shard.")
            self._init_grad_state()
        for up, flag in zip(self.unsharded, now):
            up.requires_grad_(flag)
        self.param_requires_grad = now
        self.trainable_count = sum(now)
        self.requires_grad = any(now)

    def _grad_on_shard(self, p: nn.Parameter) -> None:
        """Autograd reached a sharded parameter: it was used outside its unit's forward
        (e.g. through ``to_local()`` in a loss term), where its gradient would be lost."""
        module, name = self.slots[p._hsdp_index][0]
        raise RuntimeError(
            f"hsdp: a gradient reached the sharded {type(module).__name__}.{name} (group "
            f"{self.label}) directly: it was used outside the forward of the unit that owns "
            f"it, where hsdp would lose that gradient. Use it inside that unit's forward, or "
            f"fully_shard the module that uses it together with it (their common parent).")

    def _on_grad(self, idx: int) -> None:
        if self.reduced:
            raise RuntimeError(
                f"hsdp: parameter {idx} of group {self.label} received a gradient after the "
                f"group was reduce-scattered in this backward (is it used outside its unit, "
                f"or both inside and outside a reentrant checkpoint?). Make it belong to the "
                f"unit that uses it.")
        self.received.add(idx)
        if len(self.received) == self.trainable_count and self.on_all_grads is not None:
            self.on_all_grads(self)

    def keep_local(self, flat: torch.Tensor) -> None:
        """A microbatch without gradient sync: keep ``copy_in``'s result (which includes
        the earlier unsynced microbatches') on this rank for the next synced one."""
        self.local_grads = flat
        self.reduced = True

    def grads_exposed(self) -> bool:
        with direct():
            return any(p.grad is not None for p in self.sharded)

    def run_grad_hooks(self) -> None:
        """The users' post-accumulate-grad hooks of the sharded parameters that have a
        ``.grad`` (set by ``expose_grads``, final), in parameter order, as FSDP2 runs
        them after its reduction; not hsdp's own guard (``_grad_on_shard``)."""
        for p, guard in zip(self.sharded, self._guard_hooks):
            with direct():
                hooks = getattr(p, "_post_accumulate_grad_hooks", None)
                if not hooks or p.grad is None:
                    continue
            for hook_id, hook in list(hooks.items()):
                if hook_id != guard:
                    hook(p)

    def reset_backward(self) -> None:
        self.received.clear()
        self.reduced = False

    def abandon_step(self) -> None:
        """Forget what a failed step left: gradients (unsharded, and sharded ones, which may be
        the last step's or set by autograd), received / used flags."""
        for p in (*self.unsharded, *self.sharded):
            p.grad = None
        self.used = [False] * len(self.used)
        self.local_grads = None
        self._to_outer = None
        self.carry = None
        if self.compressed is not None:
            self.compressed.drop()
        self.reset_backward()

    def expose_grads(self, used: Sequence[bool]) -> None:
        """Hand the reduced gradients to the optimizer; a parameter that no rank used
        keeps ``.grad = None`` (as with DDP)."""
        if self.compressed is not None:  # the step counts: its residual is the state now
            self.compressed.commit()
        if self._placeholder_grads:  # zero, whatever the user did to them last step
            torch._foreach_zero_(self._placeholder_grads)
        if self.carry is not None:  # the gradients left set before this step's backward
            self.grad_buf.add_(self.carry)
            used = [u or c for u, c in zip(used, self.carried)]
            self.carry = None
        with direct():
            for p, v, u in zip(self.sharded, self._grad_views, used):
                p.grad = v if u else None
        self.used = [False] * len(self.used)

    def hide_grads(self) -> None:
        """Take the sharded ``.grad``s off before a step's first backward. What they hold,
        if they were not cleared (still set, not all zero), is kept in ``carry`` and added
        to the new reduced gradients by ``expose_grads``, as torch accumulates into a
        ``.grad`` left set. Reads the values (a device sync) only when some are set."""
        with direct():
            grads = [p.grad for p in self.sharded]
            for p in self.sharded:
                p.grad = None
        self.carry = None
        if all(g is None for g in grads):
            return
        # Our views live in grad_buf; read it only while it is live (a .grad autograd put
        # on a shard may be set while the buffers are freed).
        carry = (self.grad_buf.clone() if self.grads_live
                 else torch.zeros_like(self.grad_buf))
        for idx, (g, view, (a, n)) in enumerate(zip(grads, self._grad_views, self._slices)):
            if g is None:
                carry[a:a + n].zero_()
            elif g is not view and n:
                carry[a:a + n].copy_(self._foreign_grad(idx, g))
        if carry.any():
            self.carry, self.carried = carry, [g is not None for g in grads]

    def _foreign_grad(self, idx: int, g: torch.Tensor) -> torch.Tensor:
        """The local piece of a ``.grad`` the user set on sharded parameter ``idx``."""
        p = self.sharded[idx]
        if not same_layout(g, p):
            module, name = self.slots[idx][0]
            raise RuntimeError(
                f"hsdp: the .grad of {type(module).__name__}.{name} was replaced by a tensor "
                f"not laid out like its shard (shape {tuple(g.shape)}), so the next backward "
                f"cannot accumulate into it. Clear it (optimizer.zero_grad()) or set it to a "
                f"tensor like the parameter (torch.zeros_like(p)).")
        return g._local_tensor.reshape(-1)[:self._slices[idx][1]]
