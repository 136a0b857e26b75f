"""``init_mesh``: the (outer, inner) data-parallel mesh, with an optional "tp" dim, and
its communicators (``communicators.py``), after the ranks agreed on the arguments;
``expert_mesh``: the (outer, inner, "ep") mesh of a data-parallel mesh's experts.

With tensor parallelism the mesh is 3-D, ("outer", "inner", "tp"), tp fastest (torchtitan's
layout): torch's TP plans run on ``mesh["tp"]`` and hsdp's groups are the (outer, inner)
grids of one tp index each, so hsdp shards and reduces each parameter's TP-local tensor.
"""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hsdp.ft.errors import FaultToleranceError
from hsdp.ft.outer import ElasticOuter, FaultTolerance, make_manager
from hsdp.topology import hosts
from hsdp.topology.build_agreement import agree_in_store
from hsdp.topology.communicators import (
    COMMUNICATORS,
    NcclConfig,
    create_groups,
    default_timeout,
    host_group,
    mesh_groups,
    on_first_use,
    registered_groups,
)
from hsdp.topology.mesh_dims import (
    DIM_NAMES,
    EP_DIM_NAMES,
    TP_DIM_NAMES,
    as_hsdp_mesh,
    mesh_key,
)
from hsdp.topology.outer_mode import OuterMode, carrying, outer_sync_of


def init_mesh(outer: int | None = None, inner: int | None = None,
              device_type: str | None = None, *, tp: int = 1,
              nccl: dict[str, NcclConfig] | None = None, timeout: timedelta | None = None,
              allow_inner_across_hosts: bool = False,
              fault_tolerance: FaultTolerance | Any | None = None,
              outer_sync: OuterMode | Any | None = None) -> DeviceMesh:
    """A 2-D DeviceMesh with dims ("outer", "inner") plus hsdp's three communicators; with
    ``tp > 1`` (keyword only) a 3-D one, ("outer", "inner", "tp"), rank ``(o * inner + i) * tp + t``
    (tp fastest, as torchtitan): give ``mesh["tp"]`` to torch's ``parallelize_module``,
    then the whole mesh to ``hsdp.fully_shard``. With ``fault_tolerance`` (strategy hsdp,
    no tp), each replica group is its own torch world and the outer gradient all-reduce
    goes through torchft (docs/guide/fault_tolerance.md); with ``outer_sync``, each sync.

    Sizes left out come from the launch: outer = nodes, inner = ranks per node (torchrun's
    ``LOCAL_WORLD_SIZE``, SLURM's tasks per node, else the ranks' hosts) / tp; one given,
    the other is world / (tp * it). An inner group (with its tp groups) whose ranks run on
    more than one host is refused unless ``allow_inner_across_hosts=True``.

    ``nccl`` maps "inner_ag" / "inner_rs" / "outer" to an ``NcclConfig``; it only applies to
    the NCCL backend. ``timeout``: how long any of hsdp's collectives may wait for a peer
    before it fails (default: the default process group's timeout). Initializes the default
    process group from the environment (torchrun), with this timeout, when none exists yet.
    The ranks' arguments are compared first (every rank raises if they differ); the same
    arguments again return the same mesh (another ``outer_sync``: an equal one carrying it).

    ``fault_tolerance`` (an ``hsdp.FaultTolerance`` or a torchft ``Manager``; see
    ``ft/outer.py``): the outer axis becomes torchft replica groups. Each replica group is
    its own torch world of ``inner`` ranks (one torchrun per group) and ``outer`` is the
    number of groups launched; the returned mesh covers this group, (1, inner), and the
    outer gradient all-reduce runs over the live groups. Only ``strategy="hsdp"``.

    ``outer_sync=hsdp.DiLoCo(...)`` (``runtime/diloco.py``): the outer axis synchronizes
    every ``inner_steps`` optimizer steps (docs/guide/across_datacenters.md); only
    ``strategy="hsdp"``. With ``fault_tolerance`` each sync is one torchft quorum and
    commit, driven by hsdp inside ``optimizer.step()``; ``fully_shard`` reads it off the
    mesh. ``hsdp.Auto(...)``: as it chooses, once the mesh is built (``outer_auto.py``)."""
    nccl = _check_arguments(outer, inner, tp, nccl, timeout)
    _check_outer_sync(outer_sync, fault_tolerance)
    device_type = _check_device_type(device_type)
    _init_default_group(timeout)
    if dist.get_world_size() % tp:
        raise ValueError(f"init_mesh: tp={tp} does not divide the world's "
                         f"{dist.get_world_size()} ranks; choose a tp that does (the ranks "
                         f"per node or a divisor of it)")
    _agree_on_arguments(outer, inner, tp, device_type, nccl, timeout, outer_sync)
    if fault_tolerance is not None:
        if tp > 1:
            raise FaultToleranceError("init_mesh: fault_tolerance with tp > 1 is not "
                                      "supported; use tp=1 or no fault tolerance")
        return _init_replica_group(outer, inner, device_type, nccl, timeout, fault_tolerance,
                                   outer_sync)
    outer, inner = _sizes_on_hosts(outer, inner, tp, allow_inner_across_hosts)
    if dist.get_world_size() != outer * inner * tp:
        raise ValueError(
            f"init_mesh: outer*inner*tp = {outer}*{inner}*{tp} = {outer * inner * tp} but the "
            f"world has {dist.get_world_size()} ranks; choose sizes whose product is the "
            f"world size")
    return _mesh_of_world(outer, inner, tp, device_type, nccl, timeout or default_timeout(),
                          outer_sync)


def _mesh_of_world(outer: int, inner: int, tp: int, device_type: str,
                   nccl: dict[str, NcclConfig], timeout: timedelta,
                   outer_sync: OuterMode | Any | None) -> DeviceMesh:
    """The mesh over the whole world (over the communicators cached for the same
    arguments), carrying ``outer_sync`` (an ``hsdp.Auto``: the mode it chooses on the
    mesh, the same on every rank: ``outer_auto.py``)."""
    if _is_auto(outer_sync):
        mesh = _mesh_of_world(outer, inner, tp, device_type, nccl, timeout, None)
        chosen = outer_sync.outer_sync_for(mesh)
        return mesh if chosen is None else carrying(mesh, chosen)
    shape, names = ((outer, inner, tp), TP_DIM_NAMES) if tp > 1 else ((outer, inner), DIM_NAMES)
    cached = mesh_groups().get((device_type, tuple(range(outer * inner * tp)), shape))
    if cached is not None and (cached.nccl, cached.timeout) == (nccl, timeout):
        return carrying(cached.mesh, outer_sync)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    mesh_groups()[mesh_key(mesh)] = create_groups(mesh, nccl, timeout)
    return carrying(mesh, outer_sync)


def _is_auto(outer_sync: object) -> bool:
    """Whether ``outer_sync`` is an ``hsdp.Auto`` (``outer_auto.py``, above this layer)."""
    return callable(getattr(outer_sync, "outer_sync_for", None))


def _check_outer_sync(outer_sync: object, fault_tolerance: object) -> None:
    """Raise on a bad ``outer_sync`` or one ``fault_tolerance`` cannot serve (the mode's
    ``check_mesh``; an ``hsdp.Auto`` cannot serve fault tolerance)."""
    if _is_auto(outer_sync) and fault_tolerance is not None:
        raise FaultToleranceError(
            f"init_mesh: outer_sync={outer_sync!r} with fault_tolerance is not supported (the "
            f"torchft Manager is made for one outer schedule before the mesh exists); pass "
            f"outer_sync=hsdp.DiLoCo(...) or None")
    if outer_sync is None or _is_auto(outer_sync):
        return
    if not isinstance(outer_sync, OuterMode) or outer_sync.argument != "outer_sync":
        raise TypeError(f"init_mesh: outer_sync must be an hsdp.DiLoCo (an outer_sync "
                        f"mode), an hsdp.Auto (the mode chosen from a measurement: "
                        f"hsdp_tools.auto(model)) or None, got {outer_sync!r}")
    outer_sync.check_mesh(fault_tolerance)


def _check_arguments(outer: int | None, inner: int | None, tp: int,
                     nccl: dict[str, NcclConfig] | None,
                     timeout: timedelta | None) -> dict[str, NcclConfig]:
    """Raise on a bad argument of ``init_mesh`` (before anything is built); ``nccl`` as a
    dict."""
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
    return nccl


def _init_replica_group(outer: int | None, inner: int | None, device_type: str,
                        nccl: dict[str, NcclConfig], timeout: timedelta | None,
                        fault_tolerance: FaultTolerance | Any,
                        outer_sync: OuterMode | None) -> DeviceMesh:
    """init_mesh with fault tolerance: this replica group's (1, inner) mesh, whose outer
    gradient all-reduce (with ``outer_sync``: each sync's) goes through torchft."""
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
    cached = mesh_groups().get(key)
    if cached is not None and cached.elastic is not None:
        if outer_sync_of(cached.mesh) != outer_sync:
            raise FaultToleranceError(
                f"init_mesh: this replica group's fault-tolerant mesh was made with "
                f"outer_sync={outer_sync_of(cached.mesh)}; its torchft Manager cannot serve "
                f"outer_sync={outer_sync} too: one outer schedule per job")
        return cached.mesh
    mesh = carrying(init_device_mesh(device_type, (1, inner), mesh_dim_names=DIM_NAMES),
                    outer_sync)
    manager = make_manager(fault_tolerance, device_type,
                           sync_quorum=outer_sync is not None and outer_sync.sync_quorum)
    mesh_groups()[mesh_key(mesh)] = replace(create_groups(mesh, nccl, timeout),
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
                        nccl: dict[str, NcclConfig], timeout: timedelta | None,
                        outer_sync: OuterMode | None = None) -> None:
    """Raise on every rank, within the timeout, if the ranks called init_mesh with
    different arguments: their groups would not match and ``new_group`` would hang."""
    settings = ", ".join(f"{k}={v}" for k, v in sorted(nccl.items()))
    agree_in_store("init_mesh", f"init_mesh(outer={outer}, inner={inner}, tp={tp}, device_type="
                   f"{device_type!r}, nccl={{{settings}}}, timeout={timeout}, "
                   f"outer_sync={outer_sync})",
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


# Process-wide: a mesh is collective to make: the same call returns the same mesh.
_EXPERT_MESHES: dict[tuple, DeviceMesh] = {}  # expert_mesh's of this world, by mesh and ep
on_first_use(_EXPERT_MESHES.clear)  # a new world: their groups went with the old one


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The expert mesh of the data-parallel ``mesh`` (hsdp's ("outer", "inner") or one
    ``as_hsdp_mesh`` takes) for expert parallelism of degree ``ep``: ("outer", "inner",
    "ep") of shape ``(outer, inner // ep, ep)``, the ranks of ``mesh`` in their order (ep
    fastest, torchtitan's layout). Build the experts as DTensors on its ``["ep"]`` dim
    (``Shard(0)``: each ep rank holds ``1/ep`` of them) and ``fully_shard`` the experts'
    module on it, inside the block's unit on ``mesh``: each expert is then sharded over
    the ``inner // ep`` ranks holding the same experts and replicated over outer. Every
    rank must call it with the same mesh and ``ep`` (compared first: every rank raises if
    they differ; collective the first time per mesh)."""
    _agree_on_expert_mesh(mesh, ep)
    mesh = as_hsdp_mesh(mesh)
    names = tuple(mesh.mesh_dim_names or ())
    groups = registered_groups(mesh) if names == DIM_NAMES else None
    if groups is not None and (groups.elastic is not None or outer_sync_of(mesh) is not None):
        raise ValueError("hsdp.expert_mesh: expert parallelism with fault_tolerance or "
                         "outer_sync=DiLoCo(...) is not supported: the expert units' outer "
                         "reduction would bypass the replica groups / the outer schedule")
    if names != DIM_NAMES:
        raise ValueError(f"hsdp.expert_mesh: expected a data-parallel (outer, inner) mesh, "
                         f"got dims {names}; expert parallelism with tensor parallelism is "
                         f"not supported")
    outer, inner = mesh.mesh.shape
    if not isinstance(ep, int) or ep < 1 or inner % ep:
        raise ValueError(f"hsdp.expert_mesh: ep={ep!r} must be a positive divisor of the "
                         f"inner size {inner} (the experts are split inside an inner group)")
    key = (*mesh_key(mesh), EP_DIM_NAMES, ep)
    mesh_groups()  # forgets the last world's expert meshes if this is another
    if key not in _EXPERT_MESHES:
        _EXPERT_MESHES[key] = DeviceMesh(mesh.device_type,
                                         mesh.mesh.reshape(outer, inner // ep, ep),
                                         mesh_dim_names=EP_DIM_NAMES)
    return _EXPERT_MESHES[key]


def _agree_on_expert_mesh(mesh: DeviceMesh, ep: int) -> None:
    """Raise on every rank, within the mesh's timeout, if the ranks called expert_mesh
    with different meshes or ``ep``: their expert groups would not match and building
    them would hang."""
    if isinstance(mesh, DeviceMesh):
        groups = registered_groups(mesh)
        timeout = groups.timeout if groups is not None else default_timeout()
        what = f"dims {mesh.mesh_dim_names}, shape {tuple(mesh.mesh.shape)}"
    else:
        timeout, what = default_timeout(), type(mesh).__name__
    agree_in_store("expert_mesh", f"expert_mesh(mesh of {what}, ep={ep!r})", timeout,
                   "Call hsdp.expert_mesh with the same mesh and ep on every rank.")
