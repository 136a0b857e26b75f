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

from hsdp.sharding.layout import boxes


class Chunks:
    """Elements ``[start, start + length)`` of the flattened tensor of ``shape`` as DCP
    sees them: row-major boxes (``layout.boxes``), each a chunk of the global tensor; what
    DCP's planners save from and load into (``local``: the piece, whose first ``length``
    elements are those; a placeholder where ``length`` is 0)."""

    def __init__(self, shape: tuple[int, ...], start: int, length: int) -> None:
        self.size = torch.Size(shape)
        self.boxes = boxes(tuple(shape), start, start + length)

    def chunk_list(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes))
                for b in self.boxes]

    def write_items(self, fqn: str, local: torch.Tensor) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(local)
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props,
                                                      size=self.size))
                for c in self.chunk_list()]

    def shard(self, index: MetadataIndex, local: torch.Tensor) -> torch.Tensor:
        for b in self.boxes:
            if torch.Size(b.offsets) == index.offset:
                return local.reshape(-1)[b.start:b.start + b.numel].view(b.sizes)
        raise ValueError(f"hsdp: no local chunk of {index.fqn} at offset {index.offset}")


def attach_chunks(local: torch.Tensor, shape: tuple[int, ...], start: int,
                  length: int) -> None:
    """Give ``local`` (elements ``[start, start + length)`` of the flattened tensor of
    ``shape``; more elements when it is a placeholder) DCP's chunk hooks, which a DTensor
    consults before its own placements."""
    chunks = Chunks(shape, start, length)
    ref = weakref.ref(local)  # no reference cycle through the tensor's own attributes
    local.__create_chunk_list__ = chunks.chunk_list
    local.__create_write_items__ = lambda fqn, _obj: chunks.write_items(fqn, ref())
    local.__get_tensor_shard__ = lambda index: chunks.shard(index, ref())
    local._hsdp_piece = (chunks.size, start, length)  # where it lies: loading checks it

