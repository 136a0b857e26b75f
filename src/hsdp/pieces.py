"""This rank's piece of a parameter as a DTensor over hsdp's 2-D mesh ("uneven DTensor").

Each sharded parameter (and its gradient and optimizer state) is a DTensor whose global
shape is the original parameter's and whose local tensor is the zero-copy 1-D view of this
rank's contiguous range of the flattened parameter inside the flat buffer. Placements:
``(Replicate(), Shard(0))`` on ("outer", "inner") when replicated over outer (hsdp),
``(Shard(0), Shard(0))`` when sharded over both (hfsdp). Why a DTensor: torch's
``clip_grad_norm_``, the optimizers and DCP then see sharded tensors (norms reduce over
the shard dims, elementwise optimizer math runs on the local views). Why "uneven": the
piece is a flat range, not ``torch.chunk`` rows, so the local tensor does not have the
shape DTensor's placements would imply. Elementwise ops and reductions do not care; DCP
gets the true layout from the chunk hooks attached to the local tensor (a flat range of an
N-D tensor is a union of row-major boxes, see ``layout.boxes``), so its default planners
save and reshard it. Anything that would redistribute such a tensor (``full_tensor()``,
``redistribute``) would misread the pieces.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from hsdp.layout import Box, boxes


def placements(shard_outer: bool) -> tuple:
    return (Shard(0) if shard_outer else Replicate(), Shard(0))


def spec(mesh: DeviceMesh, shard_outer: bool, shape: tuple[int, ...],
         dtype: torch.dtype) -> DTensorSpec:
    stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh, placements(shard_outer),
                       tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))


def as_dtensor(local: torch.Tensor, dspec: DTensorSpec) -> DTensor:
    """A DTensor over the 1-D ``local`` piece itself (no copy, no autograd; writes into
    its local tensor bump ``local``'s own version counter)."""
    return DTensor(local, dspec, requires_grad=False)


def placeholder_if_empty(view: torch.Tensor) -> torch.Tensor:
    """``view``, or for an empty piece a one-element zero placeholder: torch's inf-norm
    (``clip_grad_norm_``) raises on an empty local tensor, which would fail on some ranks
    only. Zero gradients keep the placeholder at zero under every torch optimizer."""
    return view if view.numel() else torch.zeros(1, dtype=view.dtype, device=view.device)


def attach_chunks(local: torch.Tensor, shape: tuple[int, ...], start: int,
                  length: int) -> None:
    """Give ``local`` (elements ``[start, start + length)`` of the flattened tensor of
    ``shape``; more elements when it is a placeholder) DCP's chunk hooks, which a DTensor
    consults before its own placements."""
    bxs = boxes(shape, start, start + length)
    chunks = [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in bxs]
    ref = weakref.ref(local)  # no reference cycle through the tensor's own attributes
    size = torch.Size(shape)

    def write_items(fqn: str, obj: torch.Tensor) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(ref())
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props, size=size))
                for c in chunks]

    def tensor_shard(index: MetadataIndex) -> torch.Tensor:
        box = _find(bxs, index)
        return ref()[box.start:box.start + box.numel].view(box.sizes)

    local.__create_chunk_list__ = lambda: list(chunks)
    local.__create_write_items__ = write_items
    local.__get_tensor_shard__ = tensor_shard
    local._hsdp_piece = (size, start, length)  # where it lies: state-dict loading checks it


def _find(bxs: list[Box], index: MetadataIndex) -> Box:
    for b in bxs:
        if torch.Size(b.offsets) == index.offset:
            return b
    raise ValueError(f"hsdp: no local chunk of {index.fqn} at offset {index.offset}")


def checkpoint_view(local: torch.Tensor, dspec: DTensorSpec, start: int,
                    length: int) -> DTensor:
    """A DTensor over ``local`` that carries the chunk hooks (what state dicts hold: DCP
    writes from and loads into it in place)."""
    local = local.view(-1)  # a fresh alias: the hooks are attributes of the tensor object
    attach_chunks(local, tuple(dspec.shape), start, length)
    return as_dtensor(local, dspec)


def same_layout(state: torch.Tensor, param: DTensor) -> bool:
    """Whether ``state`` (optimizer state of ``param``) is laid out like ``param``'s piece:
    a DTensor on the same mesh with the same placements, shape and local size."""
    return (isinstance(state, DTensor) and state.shape == param.shape
            and state.placements == param.placements
            and state.device_mesh == param.device_mesh
            and state._local_tensor.numel() == param._local_tensor.numel())
