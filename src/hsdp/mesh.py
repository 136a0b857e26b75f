"""The (outer, inner) data-parallel mesh, with an optional "tp" dim, and its communicators.

With tensor parallelism the mesh is 3-D, ("outer", "inner", "tp"), tp fastest (torchtitan's
layout): torch's TP plans run on ``mesh["tp"]`` and hsdp's groups are the (outer, inner)
grids of one tp index each, so hsdp shards and reduces each parameter's TP-local tensor.

``inner_ag`` and ``inner_rs`` are two communicators over the same inner ranks: NCCL runs the
operations of one communicator in host launch order, so an all-gather and a
reduce-scatter sharing one would serialize. ``outer`` is a third, so that the DP-outer
reduction never queues behind inner traffic. Host-side collectives (state dict, grad norm)
use two more groups per rank, ``host_inner`` / ``host_outer``, and never touch these three;
``control`` is a CPU (gloo) group over the whole world for hsdp's tiny bookkeeping
all-reduces (step agreement, recovery). Every group gets the same timeout: the default
group's, or ``init_mesh(..., timeout=...)``.

hsdp's groups are cached per world: ``init_mesh`` with the same arguments returns the same
mesh (new groups would hold threads and sockets until the world ends), and the caches are
dropped when the world is destroyed (``teardown.py``) or replaced by another.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hsdp import hosts
from hsdp.ft.errors import FaultToleranceError
from hsdp.ft.outer import ElasticOuter, FaultTolerance, make_manager
from hsdp.runtime.consensus import agree_in_store

DIM_NAMES = ("outer", "inner")
TP_DIM_NAMES = (*DIM_NAMES, "tp")
# torchtitan's names for the same two dims (replicate, shard), with and without context parallel
TORCHTITAN_DIM_NAMES = (("dp_replicate", "dp_shard"), ("dp_replicate", "dp_shard_cp"))
COMMUNICATORS = ("inner_ag", "inner_rs", "outer")


def axis_groups(outer: int, inner: int) -> dict[str, list[list[int]]]:
    """The ranks of each axis's groups on ``init_mesh``'s layout (rank ``o * inner +
    i``): ``"outer"``, one group per inner index; ``"inner"``, one per outer index."""
    return {"outer": [[o * inner + i for o in range(outer)] for i in range(inner)],
            "inner": [[o * inner + i for i in range(inner)] for o in range(outer)]}


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
    (over this rank's tp index: ``host_tp``, over its tp group, is None without TP)."""

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

    def piece_groups(self, shard_outer: bool,
                     tp_sharded: bool = False) -> tuple[dist.ProcessGroup, ...]:
        """The host groups over which a parameter's pieces are spread (see ``Piece``):
        inner, outer with ``shard_outer``, tp for a parameter TP shards."""
        return ((self.host_inner,) + ((self.host_outer,) if shard_outer else ())
                + ((self.host_tp,) if tp_sharded else ()))


def init_mesh(outer: int | None = None, inner: int | None = None,
              device_type: str | None = None, *, tp: int = 1,
              nccl: dict[str, NcclConfig] | None = None, timeout: timedelta | None = None,
              allow_inner_across_hosts: bool = False,
              fault_tolerance: FaultTolerance | Any | None = None) -> DeviceMesh:
    """A 2-D DeviceMesh with dims ("outer", "inner") plus hsdp's three communicators; with
    ``tp > 1`` (keyword only) a 3-D one, ("outer", "inner", "tp"), rank ``(o * inner + i) * tp + t``
    (tp fastest, as torchtitan): give ``mesh["tp"]`` to torch's ``parallelize_module``,
    then the whole mesh to ``hsdp.fully_shard``. With ``fault_tolerance`` (strategy hsdp,
    no tp), each replica group is its own torch world and the outer gradient all-reduce
    goes through torchft (docs/guide/fault_tolerance.md).

    Sizes left out come from the launch: outer = nodes, inner = ranks per node (torchrun's
    ``LOCAL_WORLD_SIZE``, SLURM's tasks per node, else the ranks' hosts) / tp; one given,
    the other is world / (tp * it). An inner group (with its tp groups) whose ranks run on
    more than one host is refused unless ``allow_inner_across_hosts=True``.

    ``nccl`` maps "inner_ag" / "inner_rs" / "outer" to an ``NcclConfig``; it only applies to
    the NCCL backend. ``timeout``: how long any of hsdp's collectives may wait for a peer
    before it fails (default: the default process group's timeout). Initializes the default
    process group from the environment (torchrun), with this timeout, when none exists yet.
    The ranks' arguments are compared first (every rank raises if they differ); the same
    arguments again return the same mesh.

    ``fault_tolerance`` (an ``hsdp.FaultTolerance`` or a torchft ``Manager``; see
    ``ft/outer.py``): the outer axis becomes torchft replica groups. Each replica group is
    its own torch world of ``inner`` ranks (one torchrun per group) and ``outer`` is the
    number of groups launched; the returned mesh covers this group, (1, inner), and the
    outer gradient all-reduce runs over the live groups. Only ``strategy="hsdp"``.
    """
    if not all(n is None or isinstance(n, int) and not isinstance(n, bool) and n >= 1
               for n in (outer, inner)):
        raise ValueError(f"init_mesh: outer and inner must be positive ints, "
                         f"got outer={outer!r} inner={inner!r}")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"init_mesh: tp must be a positive int (1: no tensor parallelism), "
                         f"got tp={tp!r}")
    nccl = dict(nccl or {})
    unknown = set(nccl) - set(COMMUNICATORS)
    if unknown:
        raise ValueError(f"init_mesh: unknown communicator(s) {sorted(unknown)} in nccl=; "
                         f"expected keys among {COMMUNICATORS}")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"init_mesh: timeout must be a datetime.timedelta, got {timeout!r}")
    device_type = _check_device_type(device_type)
    _init_default_group(timeout)
    if dist.get_world_size() % tp:
        raise ValueError(f"init_mesh: tp={tp} does not divide the world's "
                         f"{dist.get_world_size()} ranks; choose a tp that does (the ranks "
                         f"per node or a divisor of it)")
    _agree_on_arguments(outer, inner, tp, device_type, nccl, timeout)
    if fault_tolerance is not None:
        if tp > 1:
            raise FaultToleranceError("init_mesh: fault_tolerance with tp > 1 is not "
                                      "supported; use tp=1 or no fault tolerance")
        return _init_replica_group(outer, inner, device_type, nccl, timeout, fault_tolerance)
    outer, inner = _sizes_on_hosts(outer, inner, tp, allow_inner_across_hosts)
    if dist.get_world_size() != outer * inner * tp:
        raise ValueError(
            f"init_mesh: outer*inner*tp = {outer}*{inner}*{tp} = {outer * inner * tp} but the "
            f"world has {dist.get_world_size()} ranks; choose sizes whose product is the "
            f"world size")
    timeout = timeout or default_timeout()
    shape, names = ((outer, inner, tp), TP_DIM_NAMES) if tp > 1 else ((outer, inner), DIM_NAMES)
    cached = _groups().get((device_type, tuple(range(outer * inner * tp)), shape))
    if cached is not None and (cached.nccl, cached.timeout) == (nccl, timeout):
        return cached.mesh
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    _GROUPS[_key(mesh)] = _create_groups(mesh, nccl, timeout)
    return mesh


def _init_replica_group(outer: int | None, inner: int | None, device_type: str,
                        nccl: dict[str, NcclConfig], timeout: timedelta | None,
                        fault_tolerance: FaultTolerance | Any) -> DeviceMesh:
    """init_mesh with fault tolerance: this replica group's (1, inner) mesh, whose outer
    gradient all-reduce goes through torchft."""
    world = dist.get_world_size()
    inner = world if inner is None else inner
    if inner != world:
        raise FaultToleranceError(
            f"init_mesh(fault_tolerance=...): inner={inner} but this replica group's world "
            f"has {world} ranks; each replica group is its own torch world of inner ranks "
            f"(one torchrun per group, REPLICA_GROUP_ID set per group)")
    minimum = getattr(fault_tolerance, "min_replicas", 1)
    if outer is not None and outer < minimum:
        raise FaultToleranceError(f"init_mesh: outer={outer} replica groups cannot reach "
                                  f"FaultTolerance.min_replicas={minimum}")
    timeout = timeout or default_timeout()
    key = (device_type, tuple(range(inner)), (1, inner))
    cached = _groups().get(key)
    if cached is not None and cached.elastic is not None:
        return cached.mesh
    mesh = init_device_mesh(device_type, (1, inner), mesh_dim_names=DIM_NAMES)
    manager = make_manager(fault_tolerance, device_type)
    _GROUPS[_key(mesh)] = replace(_create_groups(mesh, nccl, timeout),
                                  elastic=ElasticOuter(manager))
    return mesh


def _sizes_on_hosts(outer: int | None, inner: int | None, tp: int,
                    allow_across: bool) -> tuple[int, int]:
    """init_mesh's sizes, defaults filled in from the launch (as without TP, over groups of
    ``tp`` consecutive ranks); checks every inner group with its tp groups (``inner * tp``
    consecutive ranks) is on one host (a gather of the ranks' hosts; none in torch's
    one-process fake world)."""
    world = dist.get_world_size()
    if dist.get_backend() == "fake":
        return hosts.default_sizes(outer, inner, world // tp, [("", "")])
    on = hosts.all_hosts(host_group())
    per_node = hosts.launcher_ranks_per_node()  # with TP: inner = per_node / tp
    if tp > 1 and outer is None and inner is None and per_node is not None:
        if per_node % tp:
            raise ValueError(f"init_mesh: tp={tp} does not divide the {per_node} ranks per "
                             f"node; tensor parallelism runs inside a node: choose tp among "
                             f"its divisors")
        inner = per_node // tp
    outer, inner = hosts.default_sizes(outer, inner, world // tp, on[::tp])
    if not allow_across and outer * inner * tp == world:
        hosts.check_inner_on_one_host(outer, inner * tp, on)
    return outer, inner


def _agree_on_arguments(outer: int, inner: int, tp: int, device_type: str,
                        nccl: dict[str, NcclConfig], timeout: timedelta | None) -> None:
    """Raise on every rank, within the timeout, if the ranks called init_mesh with
    different arguments: their groups would not match and ``new_group`` would hang."""
    settings = ", ".join(f"{k}={v}" for k, v in sorted(nccl.items()))
    agree_in_store("init_mesh", f"init_mesh(outer={outer}, inner={inner}, tp={tp}, device_type="
                   f"{device_type!r}, nccl={{{settings}}}, timeout={timeout})",
                   timeout or default_timeout(),
                   "Call init_mesh with the same arguments on every rank.")


def _check_device_type(device_type: str | None) -> str:
    if device_type is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"init_mesh: device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"init_mesh: device_type='cuda' but CUDA is not available (torch "
            f"{torch.__version__}, {torch.cuda.device_count()} GPUs visible); use "
            f"device_type='cpu' (gloo) or a CUDA build of torch on a GPU machine")
    return device_type


def _init_default_group(timeout: timedelta | None) -> None:
    """Initialize the default process group from torchrun's environment if needed."""
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_mesh: no default process group and no torchrun environment (missing "
            f"{', '.join(missing)}); launch with torchrun or call "
            f"torch.distributed.init_process_group() first")
    dist.init_process_group(**({} if timeout is None else {"timeout": timeout}))


def comm_groups(mesh: DeviceMesh) -> CommGroups:
    """hsdp's communicators for ``mesh``, created on first use (a collective call)."""
    check_mesh(mesh)
    key = _key(mesh)
    if key not in _groups():
        _GROUPS[key] = _create_groups(mesh, {}, default_timeout())
    return _GROUPS[key]


def registered_groups(mesh: DeviceMesh) -> CommGroups | None:
    """hsdp's communicators for ``mesh`` if this process made them (no collective)."""
    return _GROUPS.get(_key(mesh)) if dist.is_initialized() else None


def default_timeout() -> timedelta:
    """The default process group's timeout (``init_process_group(timeout=...)``)."""
    pg = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return dist.default_pg_timeout


def as_hsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """hsdp's ("outer", "inner") mesh for a mesh as FSDP2 takes it: a 2-D mesh with
    torchtitan's dim names (replicate, shard) -> the same ranks as (outer, inner); a 1-D
    mesh (FSDP2: shard over all of it) -> outer=1, inner=its size. Others are returned
    as they are (``check_mesh`` judges them). Collective the first time per mesh."""
    names = tuple(mesh.mesh_dim_names or ()) if isinstance(mesh, DeviceMesh) else DIM_NAMES
    if names in (DIM_NAMES, TP_DIM_NAMES) or not (mesh.ndim == 1 or names in TORCHTITAN_DIM_NAMES):
        return mesh
    key = _key(mesh)
    if key not in _RENAMED:
        shape = (1, mesh.mesh.numel()) if mesh.ndim == 1 else tuple(mesh.mesh.shape)
        _RENAMED[key] = DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape),
                                   mesh_dim_names=DIM_NAMES)
    return _RENAMED[key]


def check_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"hsdp needs a DeviceMesh (see hsdp.init_mesh), got {type(mesh)}")
    names = tuple(mesh.mesh_dim_names or ())
    if names not in (DIM_NAMES, TP_DIM_NAMES):
        raise ValueError(f"hsdp needs a 2-D DeviceMesh with mesh_dim_names={DIM_NAMES} or "
                         f"{TORCHTITAN_DIM_NAMES[0]}, a 3-D one with {TP_DIM_NAMES}, or a "
                         f"1-D mesh (plain FSDP), got {names or None}; build it with "
                         f"hsdp.init_mesh(outer, inner) or hsdp.init_mesh(outer, inner, tp=tp)")
    if mesh.mesh.numel() != dist.get_world_size():
        raise ValueError(f"the mesh has {mesh.mesh.numel()} ranks but the world has "
                         f"{dist.get_world_size()}; hsdp's mesh must cover every rank")


# hsdp's groups of one world: the default group they were made in (held, so that no later
# group can be mistaken for it), the comm groups per mesh and the host groups per purpose.
_WORLD: list[dist.ProcessGroup] = []
_GROUPS: dict[tuple, CommGroups] = {}
_RENAMED: dict[tuple, DeviceMesh] = {}  # as_hsdp_mesh's meshes, by the user's mesh
_HOST_GROUPS: dict[str, dist.ProcessGroup] = {}
_ON_FIRST_USE: list[Callable[[], None]] = []


def on_first_use(fn: Callable[[], None]) -> None:
    """Run ``fn`` whenever hsdp starts making groups in a world (the teardown wrapper of
    ``runtime/teardown.py`` is installed then; ``fn`` must be idempotent)."""
    _ON_FIRST_USE.append(fn)


def _groups() -> dict[tuple, CommGroups]:
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
    return max([g.timeout for g in _groups().values()], default=default_timeout())


def _key(mesh: DeviceMesh) -> tuple:
    return mesh.device_type, tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape)


def _create_groups(mesh: DeviceMesh, nccl: dict[str, NcclConfig],
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
    mine: dict[str, dist.ProcessGroup] = {}
    # Same creation order on every rank.
    for name in (*COMMUNICATORS, "host_inner", "host_outer", *(("host_tp",) if tp > 1 else ())):
        members = {"outer": by_inner, "host_outer": by_inner, "host_tp": by_tp}.get(name, ranks)
        for group_ranks in members:
            pg = new_communicator(group_ranks, mesh.device_type, nccl.get(name), timeout)
            if me in group_ranks:
                mine[name] = pg
    # Bookkeeping values live on the host: a gloo group, whatever the data backend.
    control = dist.new_group(timeout=timeout,
                             backend=None if backend == "fake" else "gloo")
    # Shard index = rank inside the group (new_group orders members by global rank).
    return CommGroups(outer, inner, dist.get_rank(mine["outer"]), dist.get_rank(mine["inner_ag"]),
                      mine["inner_ag"], mine["inner_rs"], mine["outer"], mine["host_inner"],
                      mine["host_outer"], control, timeout, mesh, nccl, tp_size=tp,
                      host_tp=mine.get("host_tp"))


def new_communicator(ranks: list[int], device_type: str, cfg: NcclConfig | None = None,
                     timeout: timedelta | None = None) -> dist.ProcessGroup:
    """A process group over ``ranks`` with ``cfg``'s settings where they apply (NCCL on
    CUDA) and ``timeout`` (default: the default group's). Every rank of the world must call
    it, in the same order."""
    timeout = timeout or default_timeout()
    uses_nccl = device_type == "cuda" and "nccl" in str(dist.get_backend())
    opts = _nccl_options(cfg, timeout) if uses_nccl else None
    return (dist.new_group(ranks, timeout=timeout, backend="nccl", pg_options=opts) if opts
            else dist.new_group(ranks, timeout=timeout))


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
    _groups()  # drops the host groups of a world that has gone
    if purpose not in _HOST_GROUPS:
        fake = dist.get_backend() == "fake"  # torch's fake world: one process, no gloo
        _HOST_GROUPS[purpose] = dist.new_group(backend=None if fake else "gloo",
                                               timeout=default_timeout())
    return _HOST_GROUPS[purpose]
