"""DCP's view of a flat piece: the row-major boxes of the global tensor it covers."""

from __future__ import annotations

import weakref

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from hsdp.sharding.layout import boxes
from hsdp.sharding.tp_blocks import TPBlock, block_of


class Chunks:
    """Elements ``[start, start + length)`` of the flattened tensor of ``shape`` (of its
    TP ``block`` where TP shards it) as DCP sees them: row-major boxes (``layout.boxes``),
    each a chunk of the global tensor; what DCP's planners save from and load into
    (``local``: the piece, whose first ``length`` elements are those; a placeholder where
    ``length`` is 0)."""

    def __init__(self, shape: tuple[int, ...], start: int, length: int,
                 block: TPBlock | None = None, writes: bool = True) -> None:
        self.size = torch.Size(shape)
        self.writes = writes
        flat = tuple(shape) if block is None else block.local_shape
        self.boxes = boxes(flat, start, start + length)
        self.offsets = [torch.Size(b.offsets if block is None else block.shift(b.offsets))
                        for b in self.boxes]

    def chunk_list(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(o, torch.Size(b.sizes))
                for o, b in zip(self.offsets, self.boxes)]

    def write_items(self, fqn: str, local: torch.Tensor) -> list[WriteItem]:
        if not self.writes:
            return []
        props = TensorProperties.create_from_tensor(local)
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props,
                                                      size=self.size))
                for c in self.chunk_list()]

    def shard(self, index: MetadataIndex, local: torch.Tensor) -> torch.Tensor:
        for o, b in zip(self.offsets, self.boxes):
            if o == index.offset:
                return local.reshape(-1)[b.start:b.start + b.numel].view(b.sizes)
        raise ValueError(f"hsdp: no local chunk of {index.fqn} at offset {index.offset}")


_WRITES = "_hsdp_writes"  # on a DTensorSpec: False where another replica's pieces are saved


def save_from_other_replica(dspec: DTensorSpec) -> None:
    """DCP saves none of the pieces laid out by ``dspec`` from this rank: another outer
    replica's stand for them (DiLoCo: outer rank 0's, chosen so, not by DCP's dedup,
    which picks a writer per chunk and would mix replicas that differ between syncs).
    Loading reads into them as before."""
    setattr(dspec, _WRITES, False)


def writes(dspec: DTensorSpec) -> bool:
    """Whether DCP saves this rank's pieces laid out by ``dspec``."""
    return getattr(dspec, _WRITES, True)


def attach_chunks(local: torch.Tensor, dspec: DTensorSpec, start: int, length: int) -> None:
    """Give ``local`` (elements ``[start, start + length)`` of the flattened tensor, or TP
    block, of the shards whose spec is ``dspec``; more elements when it is a placeholder)
    DCP's chunk hooks, which a DTensor consults before its own placements."""
    chunks = Chunks(tuple(dspec.shape), start, length, block_of(dspec), writes(dspec))
    ref = weakref.ref(local)  # no reference cycle through the tensor's own attributes
    local.__create_chunk_list__ = chunks.chunk_list
    local.__create_write_items__ = lambda fqn, _obj: chunks.write_items(fqn, ref())
    local.__get_tensor_shard__ = lambda index: chunks.shard(index, ref())
    local._hsdp_piece = (chunks.size, start, length)  # where it lies: loading checks it

