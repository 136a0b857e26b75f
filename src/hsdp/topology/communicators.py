"""hsdp's communicators: per mesh, ``inner_ag``, ``inner_rs`` and ``outer`` (NCCL on
CUDA) plus the host groups, cached per world.

``inner_ag`` and ``inner_rs`` are two communicators over the same inner ranks: NCCL runs the
operations of one communicator in host launch order, so an all-gather and a
reduce-scatter sharing one would serialize. ``outer`` is a third, so that the DP-outer
reduction never queues behind inner traffic. Host-side collectives (state dict, grad norm)
use two more groups per rank, ``host_inner`` / ``host_outer``, and never touch these three;
``control`` is a CPU (gloo) group over the whole world for hsdp's tiny bookkeeping
all-reduces (step agreement, recovery). Every group gets the same timeout: the default
group's, or ``init_mesh(..., timeout=...)``.

The groups are cached per world: ``init_mesh`` with the same arguments returns the same
mesh (new groups would hold threads and sockets until the world ends), and the caches are
dropped when the world is destroyed (``streams/teardown.py``) or replaced by another.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hsdp.ft.outer import ElasticOuter
from hsdp.topology import liveness
from hsdp.topology.mesh_dims import check_mesh, mesh_key

COMMUNICATORS = ("inner_ag", "inner_rs", "outer")


@dataclass(frozen=True)
class NcclConfig:
    """Per-communicator NCCL settings, to budget SMs between concurrent collectives."""

    max_ctas: int | None = None
    min_ctas: int | None = None
    cga_cluster_size: int | None = None

    def __post_init__(self) -> None:
        for k, v in vars(self).items():
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"NcclConfig.{k} must be a non-negative int, got {v!r}")

    def is_default(self) -> bool:
        return all(v is None for v in vars(self).values())


@dataclass(frozen=True)
class CommGroups:
    """This rank's view of the mesh: sizes, coordinates and the three communicators
    (over this rank's tp index: ``host_tp``, over its tp group, is None without TP). On an
    expert mesh ("outer", "inner", "ep") the third dim is expert parallelism: ``tp_size``
    and ``host_tp`` are its size and group."""

    outer_size: int
    inner_size: int
    outer_rank: int
    inner_rank: int
    inner_ag: dist.ProcessGroup
    inner_rs: dist.ProcessGroup
    outer: dist.ProcessGroup
    host_inner: dist.ProcessGroup
    host_outer: dist.ProcessGroup
    control: dist.ProcessGroup
    timeout: timedelta
    mesh: DeviceMesh
    nccl: dict[str, NcclConfig]
    tp_size: int = 1
    host_tp: dist.ProcessGroup | None = None
    elastic: ElasticOuter | None = None  # fault tolerance: the replica groups (torchft)

    @property
    def grad_outer(self) -> dist.ProcessGroup | ElasticOuter:
        """The outer gradient all-reduce's communicator: torchft's managed group with
        fault tolerance, else ``outer``."""
        return self.outer if self.elastic is None else self.elastic

    @property
    def world(self) -> int:
        """The data-parallel ranks (outer x inner) of one tp index."""
        return self.outer_size * self.inner_size

    @property
    def ep_size(self) -> int:
        """The expert-parallel size of an expert mesh ("outer", "inner", "ep"), else 1."""
        return self.tp_size if self.mesh.mesh_dim_names[-1] == "ep" else 1

    @property
    def mean_ranks(self) -> int:
        """How many data-parallel ranks a gradient is the mean over: outer x inner, times
        ep on an expert mesh (each ep rank feeds its tokens to every rank's experts)."""
        return self.world * self.ep_size

    def piece_groups(self, shard_outer: bool,
                     tp_sharded: bool = False) -> tuple[dist.ProcessGroup, ...]:
        """The host groups over which a parameter's pieces are spread (see ``Piece``):
        inner, outer with ``shard_outer``, tp for a parameter TP shards."""
        return ((self.host_inner,) + ((self.host_outer,) if shard_outer else ())
                + ((self.host_tp,) if tp_sharded else ()))


def comm_groups(mesh: DeviceMesh) -> CommGroups:
    """hsdp's communicators for ``mesh``, created on first use (a collective call)."""
    check_mesh(mesh)
    key = mesh_key(mesh)
    if key not in mesh_groups():
        _GROUPS[key] = create_groups(mesh, {}, default_timeout())
    return _GROUPS[key]


def registered_groups(mesh: DeviceMesh) -> CommGroups | None:
    """hsdp's communicators for ``mesh`` if this process made them (no collective)."""
    return _GROUPS.get(mesh_key(mesh)) if dist.is_initialized() else None


def default_timeout() -> timedelta:
    """The default process group's timeout (``init_process_group(timeout=...)``)."""
    pg = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return dist.default_pg_timeout


# hsdp's groups of one world: the default group they were made in (held, so that no later
# group can be mistaken for it), the comm groups per mesh and the host groups per purpose.
# Process-wide: process groups belong to the world (one per process) and are collective to make.
_WORLD: list[dist.ProcessGroup] = []
_GROUPS: dict[tuple, CommGroups] = {}
_HOST_GROUPS: dict[str, dist.ProcessGroup] = {}
_ON_FIRST_USE: list[Callable[[], None]] = []


def on_first_use(fn: Callable[[], None]) -> None:
    """Run ``fn`` whenever hsdp starts making groups in a world (the teardown wrapper of
    ``streams/teardown.py`` is installed then; ``fn`` must be idempotent)."""
    _ON_FIRST_USE.append(fn)


def mesh_groups() -> dict[tuple, CommGroups]:
    """``_GROUPS``, emptied first if it belongs to another world than the current one."""
    world = dist.distributed_c10d._get_default_group()
    if not _WORLD or _WORLD[0] is not world:
        forget_world()
        _WORLD.append(world)
        for fn in _ON_FIRST_USE:
            fn()
    return _GROUPS


def forget_world() -> None:
    """Drop every group hsdp made in the current world, which is being destroyed (torch
    frees a group, its threads and sockets, once nothing holds it)."""
    _WORLD.clear()
    _GROUPS.clear()
    _HOST_GROUPS.clear()


def longest_timeout() -> timedelta:
    """The longest timeout of hsdp's groups in this world (teardown waits that long)."""
    return max([g.timeout for g in mesh_groups().values()], default=default_timeout())


def create_groups(mesh: DeviceMesh, nccl: dict[str, NcclConfig],
                   timeout: timedelta) -> CommGroups:
    check_mesh(mesh)
    grid = mesh.mesh if mesh.ndim == 3 else mesh.mesh.unsqueeze(-1)  # grid[o][i][t]
    tp = grid.shape[2]
    # Per tp index, the (outer, inner) grid of its ranks: the inner groups (rows) and the
    # outer groups (columns) of every tp index in turn; and the tp groups.
    ranks = [row for t in range(tp) for row in grid[:, :, t].tolist()]
    by_inner = [col for t in range(tp) for col in grid[:, :, t].t().tolist()]
    by_tp = grid.reshape(-1, tp).tolist()
    outer, inner = grid.shape[0], grid.shape[1]
    me = dist.get_rank()
    backend = dist.get_backend()
    uses_nccl = mesh.device_type == "cuda" and "nccl" in str(backend)
    if not uses_nccl and any(not c.is_default() for c in nccl.values()):
        warnings.warn(f"hsdp: NCCL settings {sorted(nccl)} have no effect on backend "
                      f"{backend!r}", stacklevel=3)
    # A mesh over part of the world (one pipeline stage's ranks): only its ranks make its
    # groups, each only those it belongs to (the other stages make theirs meanwhile).
    local = mesh.mesh.numel() != dist.get_world_size()
    mine: dict[str, dist.ProcessGroup] = {}
    # Same creation order on every rank.
    for name in (*COMMUNICATORS, "host_inner", "host_outer", *(("host_tp",) if tp > 1 else ())):
        members = {"outer": by_inner, "host_outer": by_inner, "host_tp": by_tp}.get(name, ranks)
        for group_ranks in members:
            if local and me not in group_ranks:
                continue
            pg = new_communicator(group_ranks, mesh.device_type, nccl.get(name), timeout,
                                  local=local)
            if me in group_ranks:
                mine[name] = pg
    # Bookkeeping values live on the host: a gloo group, whatever the data backend.
    control = dist.new_group(sorted(grid.flatten().tolist()) if local else None,
                             timeout=timeout, backend=None if backend == "fake" else "gloo",
                             use_local_synchronization=local)
    liveness.start()  # so that a rank that dies is named in the survivors' errors
    # Shard index = rank inside the group (new_group orders members by global rank).
    return CommGroups(outer, inner, dist.get_rank(mine["outer"]), dist.get_rank(mine["inner_ag"]),
                      mine["inner_ag"], mine["inner_rs"], mine["outer"], mine["host_inner"],
                      mine["host_outer"], control, timeout, mesh, nccl, tp_size=tp,
                      host_tp=mine.get("host_tp"))


def new_communicator(ranks: list[int], device_type: str, cfg: NcclConfig | None = None,
                     timeout: timedelta | None = None, local: bool = False) -> dist.ProcessGroup:
    """A process group over ``ranks`` with ``cfg``'s settings where they apply (NCCL on
    CUDA) and ``timeout`` (default: the default group's). Every rank of the world must call
    it, in the same order; with ``local``, only the members of ``ranks``."""
    timeout = timeout or default_timeout()
    uses_nccl = device_type == "cuda" and "nccl" in str(dist.get_backend())
    opts = _nccl_options(cfg, timeout) if uses_nccl else None
    return (dist.new_group(ranks, timeout=timeout, backend="nccl", pg_options=opts,
                           use_local_synchronization=local) if opts
            else dist.new_group(ranks, timeout=timeout, use_local_synchronization=local))


def _nccl_options(cfg: NcclConfig | None, timeout: timedelta):
    if cfg is None or cfg.is_default():
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    for k, v in vars(cfg).items():
        if v is not None:
            setattr(opts.config, k, v)
    return opts


def host_group(purpose: str = "host") -> dist.ProcessGroup:
    """A gloo group over every rank for host-side coordination (objects, barriers,
    checkpoint planning), one per ``purpose``, created on first use (a collective call):
    never a CUDA collective on the default group. A background user (an asynchronous
    checkpoint) needs a group of its own: two threads must not share one."""
    mesh_groups()  # drops the host groups of a world that has gone
    if purpose not in _HOST_GROUPS:
        fake = dist.get_backend() == "fake"  # torch's fake world: one process, no gloo
        _HOST_GROUPS[purpose] = dist.new_group(backend=None if fake else "gloo",
                                               timeout=default_timeout())
    return _HOST_GROUPS[purpose]
