"""``Unit``: the state and module hooks of one fully_shard-ed module."""

from __future__ import annotations

import itertools
import sys
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten

from hsdp.runtime.hooks import in_backward, outside_root
from hsdp.runtime.runtime import Runtime
from hsdp.runtime.step import Phase
from hsdp.sharding.comm import Collectives
from hsdp.sharding.group import ParamGroup, Slot
from hsdp.sharding.policy import MixedPrecision
from hsdp.sharding.reductions import note_mixed
from hsdp.streams.contract import Tracer
from hsdp.streams.stream_set import Streams
from hsdp.topology.liveness import note_gone


class Unit:
    """The state and hooks of one fully_shard-ed module."""

    def __init__(self, module: nn.Module, label: str, groups: list[ParamGroup], mesh: DeviceMesh,
                 device: torch.device, overlap_outer: bool, mp: MixedPrecision,
                 reshard_after_forward: bool) -> None:
        self.module = module
        self.groups = groups
        self.mesh = mesh
        self.device = device
        self.overlap_outer = overlap_outer
        self.input_dtype = mp.input_dtype
        self.output_dtype = mp.output_dtype
        self.reshard_after_forward = reshard_after_forward
        self.gradient_sync = True  # False: backward keeps local gradients, no communication
        self.prefetch: dict[str, list[Unit] | None] = {"forward": None, "backward": None}
        self.runtime: Runtime | None = None
        self.collectives = Collectives()  # root's is used; bench swaps in an emulated one
        self.streams: Streams | None = None  # root's is used; None: the device's (sim swaps)
        self.is_last_override: bool | None = None  # set by hsdp.microbatch on the root
        self.label = label
        self.description: list[str] = []  # the fully_shard call, as api.py describes it
        self.enclosing: Unit | None = None  # set when an enclosing module is fully_shard-ed
        # Tied parameters owned by another unit's group, used here: (group, index, slot).
        self.borrowed: list[tuple[ParamGroup, int, Slot]] = []
        self.uses: list[ParamGroup] = list(groups)  # groups gathered for this unit
        self.reset_backward()
        self.shows_unsharded = False  # what the module's parameter slots show (see swap)
        module.register_forward_pre_hook(self._pre_forward_hook, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward_hook, always_call=False,
                                     with_kwargs=True)
        module.register_forward_hook(self._forward_failed_hook, always_call=True,
                                     with_kwargs=True)

    def reset_backward(self) -> None:
        """The per-backward flags, for the next backward."""
        self.pending_bwd = 0  # PostBackward nodes of this microbatch yet to run
        self.unattached = 0  # grad-mode calls with no PostBackward (no input needs grad)
        self.backward_started = False
        self.backward_done = False

    @property
    def tracer(self) -> Tracer:
        """Records the ops of every model on this device while enabled (see streams/contract.py)."""
        return (self.streams or Streams.for_device(self.device)).tracer

    @property
    def trainable(self) -> list[ParamGroup]:
        """Groups with a trainable parameter now (their gradients are reduced)."""
        return [g for g in self.groups if g.requires_grad]

    def borrow(self, group: ParamGroup, idx: int, slot: Slot) -> None:
        """A parameter tied to ``group``'s ``idx``-th, which another unit owns: ``slot``
        shows that unit's parameter, gathered while this unit runs."""
        self.borrowed.append((group, idx, slot))
        if group not in self.uses:
            self.uses.append(group)
        module, name = slot
        module._parameters[name] = group.params[idx].sharded

    def swap(self, unsharded: bool) -> None:
        """Point this unit's parameter slots at the unsharded (or sharded) parameters."""
        if unsharded == self.shows_unsharded:  # e.g. every unit at each root forward
            return
        self.shows_unsharded = unsharded
        for g in self.groups:
            if unsharded:
                g.use_unsharded()
            else:
                g.use_sharded()
        for g, idx, (module, name) in self.borrowed:
            q = g.params[idx]
            module._parameters[name] = q.unsharded if unsharded else q.sharded

    @property
    def with_grads(self) -> list[ParamGroup]:
        """Groups with gradient state (trainable now or before)."""
        return [g for g in self.groups if g.has_grads]

    def root_runtime(self) -> Runtime:
        """The runtime of this unit's model, created (as the root's first forward would)
        on first use."""
        if self.runtime is None:
            root = self
            while root.enclosing is not None:
                root = root.enclosing
            Runtime(root)
        return self.runtime

    # Hooks run eagerly, outside any compiled region (torch.compile(block), block.compile()):
    # dynamo neither traces them nor breaks the block's graph on them.
    @torch.compiler.disable
    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.runtime is None:
            if self.enclosing is not None:
                raise RuntimeError(outside_root(self))
            _refuse_meta_run(module, args, kwargs)
            Runtime(self)
        return self.runtime.pre_forward(self, args, kwargs)

    @torch.compiler.disable
    def _post_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        return self.runtime.post_forward(self, output)

    @torch.compiler.disable
    def _forward_failed_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        # Also runs after a successful forward, when _post_forward_hook has set IDLE.
        rt = self.runtime
        exc = sys.exc_info()[1]
        if rt is not None and rt.root is self and exc is not None:
            note_gone(exc)  # a collective that lost its peer: name the ranks that are gone
        if (rt is not None and rt.root is self and rt.step.phase is Phase.FORWARD
                and not in_backward()):
            rt.step.fail_forward()
            if exc is not None:
                note_mixed(exc)


def _refuse_meta_run(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A model still on the meta device may run on meta inputs (a simulation), not on data."""
    on_meta = any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))
    if on_meta and any(isinstance(t, torch.Tensor) and not t.is_meta
                       for t in tree_flatten((args, kwargs))[0]):
        raise RuntimeError(
            "hsdp: the model's parameters or buffers are on the meta device; allocate and "
            "initialize them with hsdp.materialize(model, init_fn) before running it on data")
