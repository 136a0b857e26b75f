"""The runtime of ``docs/design.md``: hooks, prefetch order, reduction issue, finalize.

A ``Unit`` is one ``fully_shard``-ed module. The outermost unit to run a forward becomes the
root and owns the ``Runtime`` shared by every unit below it: the named streams, the
recorded execution order, microbatch state and the end-of-backward finalize.

Where each step of docs/design.md lives:
- forward AG_i, prefetch AG_{i+1} before DO_i ... ``_pre_forward`` / ``_post_forward``
- backward AG_{i-1} prefetch before RS_i ......... ``_pre_backward``
- copy-in, RS_i, outer_i (last microbatch) ........ ``_reduce``
- finalize: compute waits rs / outer events ........ ``_finalize``
- hfsdp outer AG after ``optimizer.step()`` ........ ``_after_optimizer_step``

Compute phases (``streams.compute.begin`` / ``end``, nested): ``FWD:<unit>`` from a unit's
forward pre-hook to its post-hook (``RECOMPUTE:<unit>`` when activation checkpointing
runs it again in backward), ``BWD:<unit>`` from its pre-backward to its post-backward,
``COPY_IN:<group>``, ``OPTIMIZER:<root>``. The simulator prices compute by phase; on CUDA
and CPU they are trace marks.

Failures (README, "Failure semantics"): every collective is logged and the step's structure
is agreed on at its end (``agreement.py``); a step whose forward or backward raised is
abandoned consistently on every rank by the next call into hsdp (``Runtime.settle``).
"""

from __future__ import annotations

import functools
import itertools
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

import hsdp.runtime.teardown  # noqa: F401  (destroy_process_group waits for hsdp's streams)
from hsdp.mesh import CommGroups, comm_groups
from hsdp.policy import MixedPrecision
from hsdp.runtime.agreement import COMM_OF, StepLog, Verdict, agree, missing, post_note, read_note
from hsdp.runtime.consensus import agree_on_group
from hsdp.runtime.streams import Event, SideStream, Streams, Tracer
from hsdp.sharding.comm import Collectives
from hsdp.sharding.group import ParamGroup, Slot, owner
from hsdp.sharding.pieces import PENDING, adopt_state, same_layout


def _in_backward() -> bool:
    """True while the autograd engine runs (activation-checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


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
        self.pending_bwd = 0  # _PostBackward nodes of this microbatch yet to run
        self.unattached = 0  # grad-mode calls with no _PostBackward (no input needs grad)
        self.backward_started = False
        self.backward_done = False
        self.shows_unsharded = False  # what the module's parameter slots show (see swap)
        module.register_forward_pre_hook(self._pre_forward_hook, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward_hook, always_call=False,
                                     with_kwargs=True)
        module.register_forward_hook(self._forward_failed_hook, always_call=True,
                                     with_kwargs=True)

    @property
    def tracer(self) -> Tracer:
        """Records the ops of every model on this device while enabled (see streams.py)."""
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
        module._parameters[name] = group.sharded[idx]

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
            module._parameters[name] = (g.unsharded if unsharded else g.sharded)[idx]

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
                raise RuntimeError(_outside_root(self))
            _refuse_meta_run(module, args, kwargs)
            Runtime(self)
        return self.runtime._pre_forward(self, args, kwargs)

    @torch.compiler.disable
    def _post_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        return self.runtime._post_forward(self, output)

    @torch.compiler.disable
    def _forward_failed_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        # Also runs after a successful forward, when _post_forward_hook has set "idle".
        rt = self.runtime
        if rt is not None and rt.root is self and rt.phase == "forward" and not _in_backward():
            rt.phase = "failed"
            exc = sys.exc_info()[1]
            if exc is not None and "mixed torch.Tensor and DTensor" in str(exc):
                exc.add_note(
                    "hsdp: outside its unit's forward a parameter is this rank's shard (a "
                    "DTensor): it was probably used outside the forward of the unit that "
                    "owns it. Use it inside that forward, or fully_shard the module that uses "
                    "it together with it (their common parent).")


def _outside_root(unit: Unit) -> str:
    root = unit
    while root.enclosing is not None:
        root = root.enclosing
    return (f"hsdp: forward of {unit.label} outside the forward of the model it belongs to "
            f"({root.label}, the outermost fully_shard-ed module): hsdp gathers a unit's "
            f"parameters only inside that forward. Call the model itself (nothing has been "
            f"changed; the model can still be used).")


def _refuse_meta_run(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A model still on the meta device may run on meta inputs (a simulation), not on data."""
    on_meta = any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))
    if on_meta and any(isinstance(t, torch.Tensor) and not t.is_meta
                       for t in tree_flatten((args, kwargs))[0]):
        raise RuntimeError(
            "hsdp: the model's parameters or buffers are on the meta device; allocate and "
            "initialize them with hsdp.materialize(model, init_fn) before running it on data")


def _cast(t: Any, dtype: torch.dtype) -> Any:
    """``t`` cast to ``dtype`` if it is a floating-point tensor of another dtype."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with its floating-point tensors cast to ``dtype`` (a lone tensor, the
    common block output, without the pytree round trip)."""
    if isinstance(tree, torch.Tensor):
        return _cast(tree, dtype)
    return tree_map_only(torch.Tensor, lambda t: _cast(t, dtype), tree)


def _cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    if _plain(args, kwargs):  # the common block call: no pytree round trip
        return tuple(_cast(a, dtype) for a in args), kwargs
    return _cast_floats((args, kwargs), dtype)


def units_below(module: nn.Module) -> Iterator[Unit]:
    for m in module.modules():
        # vars, not getattr: a torch.compile wrapper forwards attribute reads to the module
        # it wraps, which would yield that module's unit twice.
        unit = vars(m).get("_hsdp_unit")
        if unit is not None:
            yield unit


_LEAVES = (torch.Tensor, int, float, bool, str, type(None))  # never pytree containers


def _plain(args: tuple, kwargs: dict) -> bool:
    """Tensors and scalars only, no keywords (the common block call): hooks can handle
    such a call without a pytree round trip, which costs tens of us per call."""
    return not kwargs and all(isinstance(a, _LEAVES) for a in args)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, runtime: Runtime, unit: Unit, *inputs: torch.Tensor):
        ctx.runtime, ctx.unit = runtime, unit
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.runtime._post_backward(ctx.unit)
        return (None, None, *grads)


class UnshardHandle:
    """``module.unshard(async_op=True)``'s result: ``wait()`` makes compute wait for the
    all-gather and shows the unsharded parameters on the module."""

    def __init__(self, runtime: Runtime, unit: Unit) -> None:
        self.runtime, self.unit = runtime, unit

    def wait(self) -> None:
        self.runtime._unshard(self.unit)


_RUNTIMES: weakref.WeakSet[Runtime] = weakref.WeakSet()


def _agree_on_model(root: Unit, units: list[Unit], comms: CommGroups) -> None:
    """Raise on every rank, naming the first difference, unless every rank sharded the
    same model the same way: otherwise the collectives would not match (a hang, an abort,
    or silently different "replicated" parameters)."""
    path = {id(m): n for n, m in root.module.named_modules()}
    lines = [f"{len(units)} units"] + [
        f"unit {path.get(id(u.module)) or '<root>'}: {line}"
        for u in units for line in u.description]
    agree_on_group("model", lines, comms.control, comms.timeout,
                   "Every rank must build the same model and call fully_shard on the same "
                   "modules with the same options.")


class Runtime:
    def __init__(self, root: Unit) -> None:
        self.root = root
        self.units = list(units_below(root.module))
        for u in self.units:
            if u.runtime is not None:
                raise RuntimeError(
                    f"hsdp: unit {u.label} already ran under another root; run the model "
                    f"through its outermost fully_shard module")
            if u.overlap_outer != root.overlap_outer:
                raise ValueError("hsdp: overlap_outer must be the same for every unit of a model")
        self.comms = comm_groups(root.mesh)
        _agree_on_model(root, self.units, self.comms)
        self.groups = [g for u in self.units for g in u.groups]  # same order on every rank
        self.gid = {g: i for i, g in enumerate(self.groups)}
        self._users: dict[ParamGroup, list[Unit]] = {g: [] for g in self.groups}
        self._owner = {g: u for u in self.units for g in u.groups}
        for u in self.units:
            for g in u.uses:
                if g not in self.gid:
                    raise RuntimeError(
                        f"hsdp: {u.label} shares a parameter with {g.label}, which is not part "
                        f"of this model; tie parameters only within one model")
                self._users[g].append(u)
        for u in self.units:
            u.runtime = self
        self.coll = root.collectives
        self.streams = root.streams or Streams.for_device(root.device)
        self.overlap = root.overlap_outer
        self._set_order(list(self.units))  # module order: a first guess until step 1 ends
        self._recording: list[Unit] | None = []
        self.phase = "idle"
        self.first_microbatch = True  # the next backward starts a new step's accumulation
        self.rs_first = True  # the next reduce-scatter overwrites the inner accumulation
        self.awaiting_last = False  # a non-last microbatch ran; grads are not final
        self.sync = True  # this backward communicates (else: local accumulation only)
        self.is_last = True  # this backward's gradients are final (outer reduction)
        self._pending_rs: list[tuple[ParamGroup, torch.Tensor, Event]] = []
        self._outer_events: list[Event] = []
        self._reduced: list[ParamGroup] = []  # this backward's reductions, in issue order
        self._in_grad_hooks = False  # running the users' post-accumulate-grad hooks
        self._params_written: Event | None = None
        self._holders: dict[ParamGroup, set[Unit]] = {g: set() for g in self.groups}
        self.log = StepLog()
        self._gave_up = False  # this step raised because another rank gave it up
        self.broken: str | None = None  # why hsdp's communicators cannot be used any more
        self._backward_expected = False  # the last root forward's output needs a backward
        self.param_ids = {id(p) for u in self.units for g in u.groups for p in g.sharded}
        self.shards_outer = any(g.shard_outer for g in self.groups)  # hfsdp
        for u in self.units:
            for g in u.groups:
                g.on_all_grads = self._reduce
        self._checked_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._adopted_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        _RUNTIMES.add(self)

    @property
    def trainable(self) -> list[ParamGroup]:
        """Groups with gradient state (trainable now or earlier), in group order."""
        return [g for g in self.groups if g.has_grads]

    # ------------------------------------------------------------------ order

    def _set_order(self, order: list[Unit]) -> None:
        """Forward order; backward runs the root first, then the others in reverse."""
        self.order = order
        self._next_fwd = dict(zip(order, order[1:]))
        bwd = order[:1] + order[1:][::-1]
        self._next_bwd = dict(zip(bwd, bwd[1:]))

    # ------------------------------------------------------------------ gather

    def _logged(self, kind: str, g: ParamGroup, stream: SideStream, event: Event) -> Event:
        self.log.add(kind, self.gid[g], stream.name, event)
        return event

    def _issue_unshard(self, unit: Unit) -> None:
        for g in unit.uses:
            if g.gathered_event is None:
                # ag waits: shards were last written on compute (optimizer) or, for hfsdp,
                # by the outer all-gather.
                after = [e for e in (self._params_written, g.params_ready) if e is not None]
                self._logged("AG", g, self.streams.ag, g.unshard(self.streams.ag, self.coll, after))

    def _prefetch(self, unit: Unit, direction: str) -> None:
        """Issue the all-gathers of the units that run after ``unit`` (its explicit
        prefetch list, else the next unit of the recorded order)."""
        nxt = unit.prefetch[direction]
        if nxt is None:
            order = self._next_fwd if direction == "forward" else self._next_bwd
            nxt = [order[unit]] if unit in order else []
        for u in nxt:
            self._issue_unshard(u)

    def _unshard(self, unit: Unit) -> None:
        self._issue_unshard(unit)
        for g in unit.uses:
            # compute waits: it reads the gathered parameters.
            self.streams.compute.wait(g.gathered_event)
            PENDING.pop(g, None)  # the wait covers the outer all-gather the gather read
            self._holders[g].add(unit)
        unit.swap(True)

    def unshard(self, unit: Unit) -> UnshardHandle:
        """Explicit ``module.unshard()``: gather ``unit`` now (shards as they are now)."""
        if self.phase == "backward":
            raise RuntimeError("hsdp: unshard() called during backward")
        if self.phase == "idle":
            self._refresh_outer_shards()
            # ag waits: the shards may have been written on compute since the last forward.
            self._params_written = self.streams.compute.record()
        self._issue_unshard(unit)
        return UnshardHandle(self, unit)

    def reshard(self, unit: Unit) -> None:
        """Explicit ``module.reshard()``: back to the sharded parameters, buffer freed."""
        if self.phase == "backward":
            raise RuntimeError("hsdp: reshard() called during backward")
        unit.swap(False)
        self._reshard(unit)

    def _reshard(self, unit: Unit) -> None:
        """Free the gathered groups ``unit`` uses, unless another running unit (a tie)
        still holds them."""
        free = []
        for g in unit.uses:
            self._holders[g].discard(unit)
            if not self._holders[g] and g.gathered_event is not None:
                free.append(g)
        self._free(free)

    def _free(self, groups: list[ParamGroup]) -> None:
        if groups:
            done = self.streams.compute.record()
            for g in groups:
                # ag waits: compute must be done reading the buffer before it is reused.
                g.reshard(self.streams.ag, [done])

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
        if self.first_microbatch:  # shards unchanged between microbatches of a step
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
                g.release_grads(self.streams.rs, self.streams.outer, [read])

    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict):
        if unit.input_dtype is not None:
            args, kwargs = _cast_inputs(args, kwargs, unit.input_dtype)
        if _in_backward():  # recomputation: gather again, keep it until unit's backward
            self.streams.compute.begin(f"RECOMPUTE:{unit.label}")
            self._unshard(unit)
            self._prefetch(unit, "backward")
            if unit.pending_bwd:  # non-reentrant: the forward's _PostBackward is still due
                return args, kwargs
            return self._attach_post_backward(unit, args, kwargs)
        if unit is not self.root and self.phase != "forward":
            raise RuntimeError(_outside_root(unit))
        self.streams.compute.begin(f"FWD:{unit.label}")
        if unit is self.root:
            self._begin_forward()
            self.phase = "forward"
        if self._recording is not None and unit not in self._recording:
            self._recording.append(unit)
        self._unshard(unit)
        self._prefetch(unit, "forward")  # AG_{i+1} before unit i's buffer is released
        return self._attach_post_backward(unit, args, kwargs)

    def _post_forward(self, unit: Unit, output: Any) -> Any:
        unit.swap(False)
        if unit.output_dtype is not None:
            output = _cast_floats(output, unit.output_dtype)
        if _in_backward():
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
            self.phase = "idle"
            self.streams.compute.poll = None  # the streams are shared: hold no model
        self.streams.compute.end(f"FWD:{unit.label}")
        return output

    def _attach_post_backward(self, unit: Unit, args: tuple, kwargs: dict):
        """Make ``_post_backward(unit)`` run once the backward of this call is done. A unit
        called several times is reduced after the last of its calls' backwards."""
        if not torch.is_grad_enabled():
            return args, kwargs
        plain = _plain(args, kwargs)
        flat, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            if not _in_backward():
                unit.unattached += 1  # only the finalize knows this call's backward is done
            return args, kwargs
        unit.pending_bwd += 1
        outs = _PostBackward.apply(self, unit, *(flat[i] for i in idx))
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
        self.phase = "backward"
        self.streams.compute.poll = self._poll
        self.log.microbatches += 1
        override = self.root.is_last_override
        self.sync = self.root.gradient_sync
        self.is_last = (True if override is None else override) and self.sync
        if self.first_microbatch:  # uncleared gradients are accumulated into, as in torch
            for u in self.units:
                for g in u.with_grads:
                    g.hide_grads()
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _pre_backward(self, unit: Unit) -> None:
        if self.phase != "backward":
            self._begin_backward()
        if unit.backward_started:
            return
        unit.backward_started = True
        self.streams.compute.begin(f"BWD:{unit.label}")
        self._unshard(unit)
        self._prefetch(unit, "backward")  # AG_{i-1} before RS_i is issued

    def _post_backward(self, unit: Unit, final: bool = False) -> None:
        """After the backward of ``unit``'s (last) call; ``final``: the finalize, for units
        whose _PostBackward never ran."""
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
        if self.phase != "backward":
            raise RuntimeError("hsdp: gradient reduction outside backward")
        # At most one unit's RS inputs alive (as FSDP2): the previous unit's are released
        # before this one's is allocated, which waits for their RS (one unit's backward ago).
        self._release_rs_inputs(keep=self._owner[g].groups)
        self.streams.compute.begin(f"COPY_IN:{g.label}")
        rs_in = g.copy_in()
        self.streams.compute.end(f"COPY_IN:{g.label}")
        if not self.sync:  # no communication: the gradients stay here until a synced one
            g.keep_local(rs_in)
            return
        if self.is_last:
            self._reduced.append(g)
        copied = self.streams.compute.record()
        outer_next = self.is_last and g.has_outer_reduction
        # rs waits: the reduce-scatter reads rs_in, written on compute by the copy-in.
        ev_rs = self._logged("RS", g, self.streams.rs, g.reduce_scatter(
            self.streams.rs, self.coll, rs_in, self.rs_first, [copied], outer_next))
        self._pending_rs.append((g, rs_in, ev_rs))
        if outer_next:
            stream = self.streams.outer if self.overlap else self.streams.rs
            # outer waits: it reduces the inner shard that RS_i has just accumulated.
            self._outer_events.append(
                self._logged("OUTER", g, stream, g.outer_reduce(stream, self.coll, [ev_rs])))

    def _release_rs_inputs(self, keep: Sequence[ParamGroup] = ()) -> None:
        """Drop the RS inputs of every group but ``keep``'s (normally: the previous unit's,
        when the next unit's copy-in needs the memory)."""
        kept = []
        for g, rs_in, ev in self._pending_rs:
            if g in keep:
                kept.append((g, rs_in, ev))
                continue
            # compute waits: rs_in was allocated on compute and is read by RS on rs; its
            # memory may only return to compute's pool once that RS has finished.
            self.streams.compute.wait(ev)
        self._pending_rs = kept

    def _finalize(self) -> None:
        """End of backward (autograd engine callback): leftovers, the step agreement on the
        last microbatch, then stream waits."""
        for unit in reversed(self.order):
            self._post_backward(unit, final=True)
        self._release_rs_inputs()
        if self.is_last:
            verdict = self._agree(failed="", on_slow=lambda: self._note("ended"))
            if not verdict.ok:
                msg = verdict.message(self.log.step)
                self._abandon()
                raise RuntimeError(msg)
            for ev in self._outer_events:
                # compute waits: the optimizer reads grads the outer reduction produced.
                self.streams.compute.wait(ev)
            self._outer_events.clear()
            used = iter(verdict.used)
            for g in self.trainable:
                g.expose_grads([next(used) for _ in g.used])
            self.log.next_step()
        self.awaiting_last = not self.is_last
        self.first_microbatch = self.is_last
        if self.sync:
            self.rs_first = self.is_last
        self._reset_units()
        self.phase = "idle"
        self.streams.compute.poll = None
        reduced, self._reduced = self._reduced, []
        if self.is_last:
            self._run_grad_hooks(reduced)

    def _run_grad_hooks(self, reduced: list[ParamGroup]) -> None:
        """The users' post-accumulate-grad hooks, as FSDP2 runs them: once a step's
        gradients are final (reduced and exposed), group by group in reduction order. An
        optimizer may step in them (optimizer-in-backward); hfsdp then refreshes the outer
        shards once, after the last hook."""
        self._in_grad_hooks = True
        try:
            for g in reduced:
                g.run_grad_hooks()
        finally:
            self._in_grad_hooks = False
        self._refresh_outer_shards()

    def _reset_units(self) -> None:
        for u in self.units:
            u.backward_started = u.backward_done = False
            u.pending_bwd = u.unattached = 0
        for g in self.trainable:
            g.reset_backward()

    # ------------------------------------------------------------------ failures

    def _agree(self, failed: str, on_slow: Callable[[], None] | None = None) -> Verdict:
        used = [u for g in self.trainable for u in g.used]
        try:
            return agree(self.log, failed, used, self.comms.control, self.comms.timeout,
                         on_slow)
        except RuntimeError as exc:
            self.broken = str(exc)
            raise

    def _note(self, kind: str) -> None:
        post_note(f"hsdp/{self.root.label}/{self.log.step}",
                  f"{kind} {dist.get_rank()} {self.log.forwards}")

    def _poll(self) -> None:
        """CPU, while a wait blocks: raise if another rank gave up this step, or ended it
        after fewer microbatches than this one runs (it will not join our collectives)."""
        note = read_note(f"hsdp/{self.root.label}/{self.log.step}")
        if note is None:
            return
        kind, rank, forwards = note.split()
        if kind == "failed":
            self._gave_up = True
            raise RuntimeError(
                f"hsdp: rank {rank} gave up step {self.log.step} (its forward or backward "
                f"raised), so this rank stops waiting for it. Handle this like that rank's "
                f"error: the next forward abandons the step on every rank and starts a new one.")
        if int(forwards) < self.log.forwards:
            self._gave_up = True
            raise RuntimeError(
                f"hsdp: the ranks disagree on the structure of step {self.log.step}: rank "
                f"{rank} ended it after {forwards} microbatch(es), this rank runs microbatch "
                f"{self.log.forwards}. Every rank must run the same number of microbatches "
                f"per step (is_last on the same one).")

    def settle(self) -> None:
        """If the last forward or backward raised (on this rank), abandon that step on
        every rank before anything else runs: the entry points (forward, optimizer step,
        state dict, clip, synchronize) call this; every rank reaches one of them."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        if self.phase == "idle" or _in_backward():
            return
        self._note("failed")
        self._agree(failed="peer" if self._gave_up else "origin")
        self._abandon()

    def _abandon(self) -> None:
        """Drop the current step consistently: complete the collectives that other ranks
        issued and this one did not, drain every stream, and reset to a clean state (no
        gradients; the next forward starts a new step)."""
        self.streams.compute.poll = None  # every rank is here now: waits will complete
        last: dict[str, Event] = {}
        for op in self.log.ops:
            last[COMM_OF[op.desc[0]]] = op.event
        keep_alive = []
        try:
            extra = missing(self.log, self.comms.control)
        except RuntimeError as exc:  # nothing can complete the pending collectives
            self.streams.failed.append(exc)
            self.broken = str(exc)
            raise
        for kind, gid, stream_name in extra:
            g, stream = self.groups[gid], getattr(self.streams, stream_name)
            comm = COMM_OF[kind]
            # stream waits: collectives of one communicator must keep their order.
            after = [last[comm]] if comm in last else []
            last[comm] = self._replay(kind, g, stream, after, keep_alive)
        self.streams.drain()
        self.streams.compute.record().synchronize()
        keep_alive.clear()
        for u in self.units:
            u.swap(False)
        for holders in self._holders.values():
            holders.clear()
        self._free([g for g in self.groups if g.gathered_event is not None])
        for g in self.trainable:
            g.abandon_step()
        self._release_cleared_grads()
        self._pending_rs.clear()
        self._outer_events.clear()
        self._reduced.clear()
        self._reset_units()
        if self._recording is not None:
            self._recording = []
        self.first_microbatch, self.awaiting_last, self.is_last = True, False, True
        self.rs_first = True
        self.phase = "idle"
        self._gave_up = False
        self.log.next_step()

    def _replay(self, kind: str, g: ParamGroup, stream: SideStream, after: list[Event],
                keep_alive: list) -> Event:
        """Issue a collective another rank issued in the abandoned step, on real buffers
        (their contents are discarded)."""
        if kind == "AG":
            return g.unshard(stream, self.coll, after)
        if kind == "OUTER":
            return g.outer_reduce(stream, self.coll, after)
        if kind == "OUTER_AG":
            return g.outer_all_gather(stream, self.coll, after)
        rs_in = torch.zeros(g.layout.total, dtype=g.reduce_dtype, device=g.main.device)
        keep_alive.append(rs_in)
        # rs waits: rs_in was written on compute.
        return g.reduce_scatter(stream, self.coll, rs_in, True,
                                [*after, self.streams.compute.record()])

    # ------------------------------------------------------------------ optimizer

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
        if _in_backward() and not self._in_grad_hooks:
            raise RuntimeError("hsdp: optimizer.step() called during backward")
        self.settle()
        if self.awaiting_last:
            raise RuntimeError(
                "hsdp: optimizer.step() called while the gradient reduction is still "
                "pending: the last backward ran inside hsdp.microbatch(model, is_last=False) "
                "or with model.set_requires_gradient_sync(False). Run the step's final "
                "microbatch with is_last=True (or outside any hsdp.microbatch context) and "
                "gradient sync on before optimizer.step().")
        self.streams.compute.begin(f"OPTIMIZER:{self.root.label}")

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.streams.compute.end(f"OPTIMIZER:{self.root.label}")
        key = (id(optimizer.state), len(optimizer.state))
        if self._adopted_state.get(optimizer) != key:  # new state (first steps, loads)
            adopt_state(optimizer.state)
            for g in self.trainable:
                g.pack_state(optimizer.state)
            self._adopted_state[optimizer] = key
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

    def _refresh_outer_shards(self) -> None:
        """hfsdp: outer all-gather of every main chunk the optimizer changed, issued at
        once so it overlaps whatever runs until the next forward needs it."""
        stale = [g for u in self.order for g in u.groups
                 if g.shard_outer and g.version() != g.synced_version]
        if stale:
            updated = self.streams.compute.record()
            for g in stale:
                # outer waits: it reads the main chunk updated on compute.
                ready = self._logged("OUTER_AG", g, self.streams.outer,
                                     g.outer_all_gather(self.streams.outer, self.coll, [updated]))
                # compute waits, before a write into the group's parameters: the all-gather
                # reads main and writes the inner shard that main is a window of.
                PENDING[g] = functools.partial(self.streams.compute.wait, ready)

    def synchronize(self) -> None:
        """Block until every stream is idle (state dict, teardown)."""
        self.settle()
        self.streams.drain()
        self.streams.compute.record().synchronize()


_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def _check_not_stale(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer built before fully_shard holds the replaced parameters: its steps
    would change nothing the model uses."""
    params = [p for pg in optimizer.param_groups for p in pg["params"]]
    if _CHECKED.get(optimizer) == len(params):
        return
    stale = sum(getattr(p, "_hsdp_moved_to", None) is not None for p in params)
    if stale:
        raise RuntimeError(
            f"hsdp: this optimizer holds {stale} parameter(s) that fully_shard has replaced by "
            f"their shards, so its step would not change the model. Build the optimizer after "
            f"fully_shard, from model.parameters().")
    _CHECKED[optimizer] = len(params)


def _optimizer_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _check_not_stale(optimizer)
    for rt in list(_RUNTIMES):
        if rt._owns(optimizer):
            rt._before_optimizer_step()
            rt._check_optimizer_state(optimizer)


def _optimizer_post_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for rt in list(_RUNTIMES):
        if rt._owns(optimizer):
            rt._after_optimizer_step(optimizer)


register_optimizer_step_pre_hook(_optimizer_pre_hook)
register_optimizer_step_post_hook(_optimizer_post_hook)
