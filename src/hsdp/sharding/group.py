"""One unit's parameter group: flat buffers, sharded / unsharded views, its collectives.

A group holds the parameters of one unit that share a dtype and requires_grad. Its
buffers (``GroupBuffers``, ``group_buffers.py``; built by ``group_build.py``, one
``GroupParam`` per parameter, ``group_param.py``) are the only holder of its tensors; it
hands them to its parts: its all-gathers (``gather``: ``GroupGather``,
``group_gather.py``), its gradient state and reductions (``grads``: ``GradientState``,
``group_grads.py``) and its state I/O (``state``: ``GroupIO``, ``group_io.py``). They do
HOW; ``runtime/schedule.py`` and ``runtime/gather.py`` decide WHEN, on which stream and
after which events, through the group's methods (code outside the group never reaches
into its parts).

Buffers (S = inner shard, C = optimizer chunk, N = whole group; see ``layout.py``):
- ``main``       [C] original dtype: what the optimizer updates. ``model.parameters()``
                 yields one DTensor per original parameter whose local tensor is a 1-D
                 view of it (possibly empty); see ``pieces.py``.
- ``ag_src``     [S] param dtype: the inner shard fed to the inner all-gather.
                 hsdp: ``main`` itself (cast while copying into the gathered buffer).
                 hfsdp: ``inner_shard``, refreshed by the outer all-gather of ``main``.
- ``gathered``   [N] param dtype, transient: allocated by the all-gather, freed by
                 ``reshard``; unsharded parameters are views into it.
A group of torchao float8 weights (``float8.py``) gathers float8 bytes: ``gathered`` and
hfsdp's ``inner_shard`` are float8, cast from ``main`` with the weights' global scales.
Gradient buffers (``grads``, made with the first trainable parameter):
- ``accum``      [S] original dtype: the inner reduce-scatter accumulates microbatches here;
                 hsdp's outer all-reduce runs on it in place, so it is also hsdp's grad.
- ``grad_buf``   [C]: hfsdp's outer reduce-scatter output (hsdp: ``accum``).
The group's outer modes (``outer``; ``topology/outer_mode.py``) attach their state to it:
the compressed outer reduction's codec (``compressed``: an fp32 error-feedback residual of
about S elements), hfsdp's compressed outer all-gather (``compressed_gather``: the inner
shard then holds dequantized weights and is never ``main``'s storage, even where the
dtypes match), DiLoCo's anchor (``anchor``: fp32 anchor and momentum of C elements; no
outer reduction per step).
``accum`` and ``grad_buf`` exist from the step's first reduce-scatter until the user has
cleared the gradients (``zero_grad``) and the next step starts: allocated by the stream
that first writes them, freed by ``release_grads``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from hsdp.sharding.anchor import Anchor
from hsdp.sharding.comm import Collectives
from hsdp.sharding.compressed import CompressedOuter
from hsdp.sharding.compressed_gather import CompressedGather
from hsdp.sharding.float8_weights import Float8Weights
from hsdp.sharding.group_build import GroupBuild
from hsdp.sharding.group_gather import GroupGather
from hsdp.sharding.group_grads import GradientState
from hsdp.sharding.group_io import GroupIO
from hsdp.sharding.group_param import Slot
from hsdp.sharding.policy import MixedPrecision, Strategy
from hsdp.sharding.write_guard import direct
from hsdp.streams.contract import Event, SideStream
from hsdp.streams.op_table import OpKind
from hsdp.topology.communicators import CommGroups
from hsdp.topology.outer_mode import OuterMode


def owner(p: torch.Tensor) -> tuple[ParamGroup, int] | None:
    """(group, index in the group) of a sharded parameter hsdp manages, else None."""
    group = getattr(p, "_hsdp_group", None)
    return None if group is None else (group, p._hsdp_index)


class ParamGroup:
    """The parameters of one unit that share a dtype and requires_grad, flattened: its
    buffers (``buffers``, one ``GroupParam`` per parameter) and its parts ``gather``,
    ``grads`` (None until a parameter is trainable) and ``state``. Code outside the
    group calls its methods, never its parts."""

    def __init__(self, label: str, params: list[nn.Parameter], slots: list[list[Slot]],
                 comms: CommGroups, device: torch.device, strategy: Strategy,
                 mp: MixedPrecision, outer: Sequence[OuterMode] = ()) -> None:
        self.mp = mp
        self.strategy = strategy
        self.requires_grad = params[0].requires_grad
        self.param_dtype, reduce_dtype = mp.resolve(params[0].dtype)
        # The flat buffer is sharded over outer too: hfsdp's trainable groups.
        build = GroupBuild(self, label, params, slots, comms, device,
                           strategy.shards_outer and self.requires_grad,
                           (params[0].dtype, self.param_dtype, reduce_dtype))
        self.buffers = build.flat()
        # The outer modes' state (None: the exact reduction / gather, no DiLoCo).
        self.outer = tuple(outer)
        self.compressed: CompressedOuter | None = None
        self.compressed_gather: CompressedGather | None = None
        self.anchor: Anchor | None = None
        for mode in self.outer:
            mode.attach(self)
        self.buffers = build.finish(
            own_main=self.compressed_gather is not None,
            replica0=self.anchor is not None and not self.shard_outer and comms.outer_rank > 0)
        self.gather = GroupGather(self.buffers, self.compressed_gather)
        if self.float8 is not None and not self.main.is_meta:
            self.float8.scaled_at(self.gather.synced_version)  # scales of the weights as they are
        self.state = GroupIO(self.buffers)
        # None: gradients are means over the DP ranks; f: sums divided by f (FSDP2's
        # set_gradient_divide_factor; 1.0 gives plain sums).
        self.divide_factor: float | None = None
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None  # set_all_reduce_hook
        self.on_all_grads: Callable[[ParamGroup], None] | None = None
        self.grads: GradientState | None = None  # made for the first trainable parameter
        if self.requires_grad:
            self._make_grads()

    # Read-only views of the buffers' fields that code outside the group reads.
    label = property(lambda self: self.buffers.label, doc="The group's name in logs.")
    comms = property(lambda self: self.buffers.comms, doc="Its process groups.")
    layout = property(lambda self: self.buffers.layout, doc="Its flat layout.")
    main = property(lambda self: self.buffers.main, doc="[C]: what the optimizer updates.")
    params = property(lambda self: self.buffers.params, doc="Its parameters, in order.")
    orig_dtype = property(lambda self: self.buffers.orig_dtype, doc="Parameters' dtype.")
    reduce_dtype = property(lambda self: self.buffers.reduce_dtype, doc="Reductions' dtype.")
    shard_outer = property(lambda self: self.buffers.shard_outer,
                           doc="Its flat buffer is sharded over outer too (hfsdp, trainable).")

    @property
    def float8(self) -> Float8Weights | None:
        """Its torchao float8 weights (None: other weights)."""
        return self.buffers.float8

    @property
    def has_grads(self) -> bool:
        """Gradient state (buffers, hooks) made: trainable now or earlier."""
        return self.grads is not None

    def _make_grads(self) -> None:
        me = weakref.ref(self)  # see GroupBuild._params
        self.grads = GradientState(self.buffers, self.compressed,
                                   sum(q.requires_grad for q in self.params),
                                   lambda: me()._all_grads_in(),
                                   all(m.reduces_every_step for m in self.outer))
        self.grads.set_all_reduce_hook(self.all_reduce_hook)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None) -> None:
        """FSDP2's ``set_all_reduce_hook`` for this group: its gradient state runs ``hook``
        on the outer all-reduce's result (kept here for gradient state made later)."""
        self.all_reduce_hook = hook
        if self.grads is not None:
            self.grads.set_all_reduce_hook(hook)

    def _all_grads_in(self) -> None:
        if self.on_all_grads is not None:
            self.on_all_grads(self)

    def sync_requires_grad(self) -> None:
        """Follow ``requires_grad_`` changes made on the sharded parameters since
        fully_shard (FSDP2 does the same at each unshard): a frozen parameter gets no
        gradient, no reduction and no update; a group with none trainable is not reduced."""
        with direct():
            now = [q.sharded.requires_grad for q in self.params]
        if now == [q.requires_grad for q in self.params]:
            return
        if any(now) and not self.has_grads:
            if self.strategy.shards_outer:
                raise RuntimeError(
                    f"hsdp: {self.params[now.index(True)].name} was frozen when fully_shard "
                    f"ran; with strategy='hfsdp' its shards cannot become trainable later "
                    f"(they are not sharded over outer). Set requires_grad before fully_shard.")
            self._make_grads()
        for q, flag in zip(self.params, now):
            q.follow(flag)
        if self.grads is not None:
            self.grads.set_trainable(sum(now))
        self.requires_grad = any(now)

    def _grad_on_shard(self, p: nn.Parameter) -> None:
        """Autograd reached a sharded parameter: it was used outside its unit's forward
        (e.g. through ``to_local()`` in a loss term), where its gradient would be lost."""
        raise RuntimeError(
            f"hsdp: a gradient reached the sharded {self.params[p._hsdp_index].name} (group "
            f"{self.label}) directly: it was used outside the forward of the unit that owns "
            f"it, where hsdp would lose that gradient. Use it inside that unit's forward, or "
            f"fully_shard the module that uses it together with it (their common parent).")

    @property
    def divisor(self) -> float | None:
        """What the gradient sums are divided by: the divide factor (None: the collectives
        average). On an expert mesh the mean is over outer x inner x ep ranks, which no
        collective's average gives: an explicit division by that count."""
        if self.divide_factor is None and self.comms.ep_size > 1:
            return float(self.comms.mean_ranks)
        return self.divide_factor

    def reduce_scatter(self, stream: SideStream, coll: Collectives, rs_in: torch.Tensor,
                       first: bool, after: Sequence[Event], outer_next: bool = False) -> Event:
        """The gradient state's inner reduce-scatter, divided by this group's divisor."""
        return self.grads.reduce_scatter(stream, coll, rs_in, first, after, self.divisor,
                                         outer_next)

    def reduce_outer(self, stream: SideStream, coll: Collectives,
                     after: Sequence[Event]) -> Event:
        """The gradient state's outer reduction, divided by this group's divisor."""
        return self.grads.reduce_outer(stream, coll, after, self.divisor)

    @property
    def outer_reduction(self) -> OpKind | None:
        """Its outer reduction's op kind, None where it has none (``GradientState``)."""
        return self.grads.outer_reduction if self.grads.has_outer_reduction else None

    @property
    def awaits_reduction(self) -> bool:
        """Trainable and not reduce-scattered yet in this backward."""
        return self.requires_grad and not self.grads.reduced

    @property
    def used(self) -> list[bool]:
        """Which of its parameters got a gradient on this rank in this step."""
        return self.grads.used

    @property
    def grads_live(self) -> bool:
        """Its gradient buffers are allocated (or about to be)."""
        return self.grads is not None and self.grads.grads_live

    def grads_exposed(self) -> bool:
        """Some sharded parameter has a ``.grad``."""
        return self.grads is not None and self.grads.grads_exposed()

    def copy_in(self) -> torch.Tensor:
        """On compute: the reduce-scatter input (``GradientState.copy_in``)."""
        return self.grads.copy_in()

    def keep_local(self, flat: torch.Tensor) -> None:
        """A microbatch without gradient sync keeps ``copy_in``'s result here."""
        self.grads.keep_local(flat)

    def hide_grads(self, capturing: bool, single: bool) -> None:
        """Before a step's first backward (``GradientState.hide_grads``)."""
        self.grads.hide_grads(capturing, single)

    def expose_grads(self, used: Sequence[bool]) -> None:
        """Hand the reduced gradients to the optimizer (``GradientState.expose_grads``)."""
        self.grads.expose_grads(used)

    def expose_used(self, used: Sequence[bool]) -> None:
        """Set the ``.grad`` of each parameter some rank used, the others' to None."""
        self.grads.expose_used(used)

    def release_grads(self, accum_stream: SideStream, grad_buf_stream: SideStream,
                      after: Sequence[Event]) -> None:
        """Free its gradient buffers (``GradientState.release_grads``)."""
        self.grads.release_grads(accum_stream, grad_buf_stream, after)

    def reset_backward(self) -> None:
        """Its per-backward flags, for the next backward."""
        self.grads.reset_backward()

    def abandon_step(self) -> None:
        """Forget what a failed step left (``GradientState.abandon_step``)."""
        self.grads.abandon_step()

    def applied(self) -> None:
        """An optimizer stepped (``GradientState.applied``)."""
        self.grads.applied()

    def run_grad_hooks(self) -> None:
        """The users' post-accumulate-grad hooks of its sharded parameters."""
        self.grads.run_grad_hooks()

    def load_flat(self, flat: torch.Tensor) -> None:
        """Take this rank's shards (and float8 scales) from ``flat``, the whole group in the
        original dtype (``GroupIO.load_flat``); the inner shard is then up to date."""
        self.state.load_flat(flat)
        self.gather.mark_synced()

    def use_unsharded(self) -> None:
        """Show the unsharded parameters on the modules."""
        if self.float8 is not None:
            self.float8.show([q.unsharded for q in self.params], self.param_dtype)
        self._show(True)

    def use_sharded(self) -> None:
        """Show the sharded parameters on the modules."""
        self._show(False)

    def _show(self, unsharded: bool) -> None:
        for q in self.params:
            for module, name in q.slots:
                module._parameters[name] = q.unsharded if unsharded else q.sharded

    # ------------------------------------------------------------ its gathers (gather)

    gathered_event = property(lambda self: self.gather.gathered_event,
                              doc="Its inner all-gather's event (None: not gathered).")
    params_ready = property(lambda self: self.gather.params_ready,
                            doc="hfsdp: its last outer all-gather's event.")
    outer_gather_kind = property(lambda self: self.gather.outer_kind,
                                 doc="Its outer all-gather's op kind (hfsdp).")

    @property
    def inner_shard_stale(self) -> bool:
        """hfsdp: ``main`` changed since the inner shard was gathered from it."""
        return self.shard_outer and self.buffers.version() != self.gather.synced_version

    def unshard(self, stream: SideStream, coll: Collectives, after: Sequence[Event]) -> Event:
        """Its inner all-gather (``GroupGather.unshard``)."""
        return self.gather.unshard(stream, coll, after)

    def reshard(self, stream: SideStream, after: Sequence[Event]) -> Event:
        """Free its gathered buffer (``GroupGather.reshard``)."""
        return self.gather.reshard(stream, after)

    def outer_all_gather(self, stream: SideStream, coll: Collectives,
                         after: Sequence[Event]) -> Event:
        """hfsdp's outer all-gather (``GroupGather.outer_all_gather``)."""
        return self.gather.outer_all_gather(stream, coll, after)

    def mark_written(self) -> None:
        """hfsdp: the optimizer wrote ``main``; the next refresh re-gathers it."""
        self.gather.mark_written()

    def rescaled(self) -> None:
        """Its float8 scales were just computed from the current values: the inner shard
        (hfsdp) is gathered again with them."""
        self.float8.scaled_at(self.buffers.version())
        if self.shard_outer:
            self.gather.mark_written()

    def full_flat(self, coll: Collectives) -> torch.Tensor:
        """The whole flat buffer in the original dtype (``GroupGather.full_flat``)."""
        return self.gather.full_flat(coll)

    def whole(self, flat: torch.Tensor, idx: int) -> torch.Tensor:
        """Parameter ``idx`` whole from ``full_flat``'s result (``GroupBuffers.whole``)."""
        return self.buffers.whole(flat, idx)

    def pack_state(self, state: dict) -> None:
        """Its optimizer state into one flat buffer per key (``GroupIO.pack_state``)."""
        self.state.pack_state(state)
