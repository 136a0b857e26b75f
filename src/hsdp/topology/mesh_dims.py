"""The mesh's dims: hsdp's names ("outer", "inner"[, "tp" | "ep"]), the meshes FSDP2 and
torchtitan users bring (1-D, or torchtitan's (replicate, shard) names, and its expert mesh
(replicate, efsdp, ep)) taken as hsdp's, and the check every mesh passes.

The third dim splits parameters into blocks that hsdp's collectives never see: "tp"
(tensor parallelism, the same data on every tp rank) or "ep" (expert parallelism: each
ep rank holds other experts and sees other data, so an expert's gradient is a mean over
``outer * inner * ep`` data-parallel ranks)."""

from __future__ import annotations

import weakref

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

DIM_NAMES = ("outer", "inner")
TP_DIM_NAMES = (*DIM_NAMES, "tp")
EP_DIM_NAMES = (*DIM_NAMES, "ep")
MESH_DIM_NAMES = (DIM_NAMES, TP_DIM_NAMES, EP_DIM_NAMES)
# torchtitan's names for the same two dims (replicate, shard), with and without context parallel
TORCHTITAN_DIM_NAMES = (("dp_replicate", "dp_shard"), ("dp_replicate", "dp_shard_cp"))
# torchtitan's expert mesh: (replicate, expert shard, expert parallel), with and without
# the replicate dim
TORCHTITAN_EP_DIM_NAMES = (("dp_replicate", "efsdp", "ep"), ("efsdp", "ep"))


# Process-wide: a mesh is collective to make: the same mesh maps to the same one.
_RENAMED: dict[tuple, DeviceMesh] = {}  # as_hsdp_mesh's meshes, by the user's mesh


def axis_groups(outer: int, inner: int) -> dict[str, list[list[int]]]:
    """The ranks of each axis's groups on ``init_mesh``'s layout (rank ``o * inner +
    i``): ``"outer"``, one group per inner index; ``"inner"``, one per outer index."""
    return {"outer": [[o * inner + i for o in range(outer)] for i in range(inner)],
            "inner": [[o * inner + i for i in range(inner)] for o in range(outer)]}


# Process-wide: a cache of what each mesh object is (weak; reading its ranks is slow).
_KEYS: weakref.WeakKeyDictionary[DeviceMesh, tuple] = weakref.WeakKeyDictionary()


def mesh_key(mesh: DeviceMesh) -> tuple:
    """A mesh's identity: device type, ranks and shape; read once per mesh (reading a
    DeviceMesh's ranks takes about a millisecond on torch 2.13, and ``Piece._hsdp_groups``
    asks)."""
    key = _KEYS.get(mesh)
    if key is None:
        key = _KEYS[mesh] = (mesh.device_type, tuple(mesh.mesh.flatten().tolist()),
                             tuple(mesh.mesh.shape))
    return key


def as_hsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """hsdp's ("outer", "inner"[, "ep"]) mesh for a mesh as FSDP2 takes it: a 2-D mesh with
    torchtitan's dim names (replicate, shard) -> the same ranks as (outer, inner); a 1-D
    mesh (FSDP2: shard over all of it) -> outer=1, inner=its size; torchtitan's expert mesh
    ("dp_replicate", "efsdp", "ep") -> (outer, inner, "ep") (without "dp_replicate": outer=1).
    Others are returned as they are (``check_mesh`` judges them). Collective the first time
    per mesh."""
    names = tuple(mesh.mesh_dim_names or ()) if isinstance(mesh, DeviceMesh) else DIM_NAMES
    if names in TORCHTITAN_EP_DIM_NAMES:
        shape, names = (1,) * (3 - mesh.ndim) + tuple(mesh.mesh.shape), EP_DIM_NAMES
    elif names in TORCHTITAN_DIM_NAMES or mesh.ndim == 1:
        shape = (1, mesh.mesh.numel()) if mesh.ndim == 1 else tuple(mesh.mesh.shape)
        names = DIM_NAMES
    else:
        return mesh
    key = (*mesh_key(mesh), names)
    if key not in _RENAMED:
        _RENAMED[key] = DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape),
                                   mesh_dim_names=names)
    return _RENAMED[key]


def check_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"hsdp needs a DeviceMesh (see hsdp.init_mesh), got {type(mesh)}")
    names = tuple(mesh.mesh_dim_names or ())
    if names not in MESH_DIM_NAMES:
        raise ValueError(f"hsdp needs a 2-D DeviceMesh with mesh_dim_names={DIM_NAMES} or "
                         f"{TORCHTITAN_DIM_NAMES[0]}, a 3-D one with {TP_DIM_NAMES} or "
                         f"{EP_DIM_NAMES} (or {TORCHTITAN_EP_DIM_NAMES[0]}), or a "
                         f"1-D mesh (plain FSDP), got {names or None}; build it with "
                         f"hsdp.init_mesh(outer, inner) or hsdp.init_mesh(outer, inner, tp=tp)")
    if dist.get_rank() not in mesh.mesh.flatten().tolist():
        raise ValueError(f"rank {dist.get_rank()} is not in the mesh (ranks "
                         f"{mesh.mesh.flatten().tolist()}); give each rank the mesh of its "
                         f"own data-parallel ranks (with pipeline parallelism: its stage's)")

