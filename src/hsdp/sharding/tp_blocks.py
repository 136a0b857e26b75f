"""Tensor-parallel parameters: DTensors that torch's ``parallelize_module`` made on
``mesh["tp"]`` of hsdp's ("outer", "inner", "tp") mesh.

hsdp shards each parameter's TP-local tensor (its local tensor on ``mesh["tp"]``) over the
data-parallel dims: the flat layout, the buffers and hsdp's collectives never see TP, and
TP's own collectives stay torch's (on the compute stream, inside the modules' forward and
backward). A sharded parameter is a DTensor on the 3-D mesh whose last placement is its TP
placement; its elements lie in this rank's TP block (``TPBlock``: the chunk along the TP
Shard dim, as ``torch.chunk`` cuts it) at the flat range hsdp's piece gives. What hsdp
refuses: a DTensor on any other mesh, a placement it cannot flatten (``_StridedShard``,
``Partial``), a DTensor parameter on a mesh without a "tp" dim. TP parameters may be on
the meta device: ``hsdp.materialize`` initializes them whole and keeps each rank's block.

Expert parallelism is the same to hsdp: on an expert mesh ("outer", "inner", "ep") the
experts are DTensors on ``mesh["ep"]`` (``Shard(0)``: each ep rank holds its experts), and
everything here applies with "ep" for "tp".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

TP_DIM = 2  # the index of "tp" in hsdp's 3-D mesh


def placement_of(p: torch.Tensor) -> Placement:
    """The TP placement hsdp gives ``p``'s shards: a plain tensor is whole on every tp rank."""
    return p.placements[0] if isinstance(p, DTensor) else Replicate()


def local_of(p: torch.Tensor) -> torch.Tensor:
    """What hsdp shards of ``p``: its TP-local tensor (``p`` itself if plain)."""
    return p._local_tensor if isinstance(p, DTensor) else p


def check_params(params: Sequence[torch.Tensor], names: Sequence[str],
                 mesh: DeviceMesh) -> None:
    """Raise, before fully_shard changes anything, for a parameter hsdp cannot shard on
    ``mesh``. The same model on every rank gives the same verdict on every rank."""
    split = mesh.mesh_dim_names[TP_DIM] if mesh.ndim > TP_DIM else None  # "tp" | "ep"
    for p, name in zip(params, names):
        if split == "ep" and not (isinstance(p, DTensor) and type(p.placements[0]) is Shard):
            raise ValueError(
                f"hsdp.fully_shard: parameter {name} is not sharded over expert parallelism "
                f"(a DTensor on mesh['ep'] with a Shard placement) but its unit's mesh is an "
                f"expert mesh; its gradient would differ between ep ranks. Shard only the "
                f"experts on hsdp.expert_mesh(...); leave the rest to the enclosing unit")
        if not isinstance(p, DTensor):
            continue
        dims = p.device_mesh.mesh_dim_names
        if split is None:
            raise ValueError(
                f"hsdp.fully_shard: parameter {name} is a DTensor on mesh dims {dims} but "
                f"hsdp's mesh has no 'tp' dim (nor 'ep'); for tensor parallelism build the mesh "
                f"with hsdp.init_mesh(outer, inner, tp=tp) and give mesh['tp'] to "
                f"parallelize_module; for experts sharded over expert parallelism use "
                f"hsdp.expert_mesh(mesh, ep) and DTensors on its mesh['ep']")
        coord = mesh.get_coordinate()
        tp_ranks = mesh.mesh[coord[0], coord[1]].tolist()
        if dims != (split,) or p.device_mesh.mesh.tolist() != tp_ranks:
            raise ValueError(
                f"hsdp.fully_shard: parameter {name} is a DTensor on mesh dims {dims} with "
                f"ranks {p.device_mesh.mesh.tolist()}; hsdp shards such parameters on "
                f"mesh['{split}'] of its own mesh (ranks {tp_ranks} here) only: pass "
                f"mesh['{split}'] of the mesh given to fully_shard to parallelize_module (or "
                f"build the experts on it)")
        (pl,) = p.placements
        if not (type(pl) is Shard or pl.is_replicate()):
            raise ValueError(
                f"hsdp.fully_shard: parameter {name} has TP placement {pl}, which hsdp "
                f"cannot flatten into its shards; use Shard(dim) or Replicate() placements "
                f"(ColwiseParallel, RowwiseParallel, SequenceParallel)")


@dataclass(frozen=True)
class TPBlock:
    """This rank's TP block of a parameter of ``shape``: elements ``[offset, offset +
    size)`` along ``dim``."""

    shape: tuple[int, ...]
    dim: int
    offset: int
    size: int

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.shape[:self.dim] + (self.size,) + self.shape[self.dim + 1:]

    def shift(self, offsets: Sequence[int]) -> tuple[int, ...]:
        """Offsets inside the block -> offsets inside the parameter."""
        return tuple(o + (self.offset if d == self.dim else 0) for d, o in enumerate(offsets))

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a whole parameter (a view)."""
        return full.narrow(self.dim, self.offset, self.size)

    def whole(self, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The whole parameter from each tp rank's block ``local`` (a collective on
        ``group``, the tp group: every element is held by one rank, so a sum gathers)."""
        full = torch.zeros(self.shape, dtype=local.dtype, device=local.device)
        self.local_of(full).copy_(local.view(self.local_shape))
        dist.all_reduce(full, group=group)
        return full


@functools.lru_cache(maxsize=4096)
def _block(shape: tuple[int, ...], dim: int, n: int, rank: int) -> TPBlock:
    """``torch.chunk``'s cut (as DTensor's Shard): chunks of ceil(size / n), the last ones
    shorter or empty."""
    chunk = -(-shape[dim] // n)
    lo = min(rank * chunk, shape[dim])
    return TPBlock(shape, dim, lo, min(shape[dim], lo + chunk) - lo)


def block_of(dspec: DTensorSpec) -> TPBlock | None:
    """This rank's TP block of a parameter sharded by hsdp on a 3-D mesh (``dspec``: its
    shards' spec); None when its tp ranks hold it whole (no TP, a tp (or ep) dim of one
    rank, or Replicate)."""
    if dspec.mesh.ndim <= TP_DIM or dspec.mesh.size(TP_DIM) == 1:
        return None
    pl = dspec.placements[TP_DIM]
    if not pl.is_shard():
        return None
    rank = dspec.mesh.get_coordinate()[TP_DIM]
    return _block(tuple(dspec.shape), pl.dim, dspec.mesh.size(TP_DIM), rank)


def meta_like(shape: tuple[int, ...], dtype: torch.dtype,
              tp_spec: DTensorSpec | None) -> torch.Tensor:
    """A meta parameter value of TP-local ``shape``: a DTensor with ``tp_spec``'s mesh,
    placements and global shape where the parameter is a TP one (``tp_spec`` not None)."""
    local = torch.empty(shape, dtype=dtype, device="meta")
    if tp_spec is None:
        return local
    return DTensor.from_local(local, tp_spec.mesh, tp_spec.placements, run_check=False,
                              shape=tp_spec.shape, stride=tp_spec.stride)


def unsharded_spec(p: DTensor, dtype: torch.dtype) -> DTensorSpec:
    """The spec of ``p``'s gathered parameter, in the compute dtype ``dtype``."""
    return DTensorSpec(p.device_mesh, tuple(p.placements),
                       tensor_meta=TensorMeta(p.shape, p.stride(), dtype))


def grad_local(grad: torch.Tensor, dspec: DTensorSpec | None) -> torch.Tensor:
    """The TP-local gradient of a gathered parameter whose spec is ``dspec`` (None: a plain
    parameter): autograd may leave it ``Partial`` (a replicated weight used on sequence
    shards), which the TP all-reduce makes whole first, as FSDP2 does."""
    if dspec is None:
        return grad
    if grad.placements != dspec.placements:
        grad = grad.redistribute(placements=dspec.placements)
    local = grad._local_tensor
    wait = getattr(local, "wait", None)  # a functional collective's result
    return wait() if callable(wait) else local
