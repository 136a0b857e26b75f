"""Checksums of a checkpoint's files, and what binds them to one checkpoint: a truncated,
corrupted, edited or foreign file is found before anything is loaded.

DCP stores each item as a byte range of a ``.distcp`` file and checks nothing: a flipped
byte inside a tensor loads as a wrong value. Each rank records the CRC-32 of the ranges it
wrote (``.hsdp-checksums.<rank>.json`` in the checkpoint directory, written before DCP
writes the metadata that completes the checkpoint); ``verify`` checks a file's ranges
(length, then CRC) before DCP reads them.

Checksums of ranges alone let a shard of another save of the same model load when its
checksum file comes with it, and a ``.metadata`` edited to swap two ranges of one length
load swapped tensors. So every save has an id (``save_id``), written into DCP's metadata
(``storage_meta.save_id``) and into each rank's checksum record; once DCP has written the
metadata, ``seal`` writes ``.hsdp-seal.json``: the id, the number of ranks and the SHA-256
of ``.metadata``. ``open_checkpoint`` checks all of it (and reads and unpickles
``.metadata`` once: DCP's reader is handed the result).

A checkpoint is hsdp's by its content, not by a file one could delete: its metadata's save
id is an hsdp one (``hsdp-`` and 32 hex digits; DCP's own are dashed UUIDs), or any of
hsdp's files (seal, checksums, directory marker) is there. Such a checkpoint must have a
seal and checksums that match; one without is refused.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import pickle
import re
import uuid
import zlib
from collections.abc import Iterable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from hsdp.checkpoint.dirs import MARKER

_SUMS = ".hsdp-checksums"
SEAL = ".hsdp-seal.json"
METADATA = ".metadata"  # DCP's file name for it
_BLOCK = 16 << 20
_HSDP_ID = re.compile(r"(hsdp-)?[0-9a-f]{32}")  # without the prefix: an older hsdp's


def new_save_id() -> str:
    """The id of a new save, which marks its metadata as hsdp's."""
    return f"hsdp-{uuid.uuid4().hex}"


def _key(info: Any) -> str:
    """A DCP ``_StorageInfo`` (relative_path, offset, length) as a JSON key."""
    return f"{info.relative_path}:{info.offset}:{info.length}"


def _crc(path: str, offset: int, length: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            block = f.read(min(left, _BLOCK))
            if not block:
                break
            crc = zlib.crc32(block, crc)
            left -= len(block)
    return crc


def record(directory: str, rank: int, infos: Iterable[Any], save_id: str) -> None:
    """Write the checksums of the ranges this rank wrote (DCP ``_StorageInfo``s) with the
    id of the save."""
    sums = {_key(i): _crc(os.path.join(directory, i.relative_path), i.offset, i.length)
            for i in infos}
    with open(os.path.join(directory, f"{_SUMS}.{rank}.json"), "x") as f:
        json.dump({"save_id": save_id, "sums": sums}, f)


def seal(directory: str, save_id: str, ranks: int) -> None:
    """Bind the ``.metadata`` DCP has just written to this save (DCP's coordinator)."""
    with open(os.path.join(directory, METADATA), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(directory, SEAL), "x") as f:
        json.dump({"save_id": save_id, "ranks": ranks, "metadata_sha256": digest}, f)


@dataclasses.dataclass
class Opened:
    """A checkpoint's metadata and checksums, checked to belong together."""

    metadata: Metadata
    sums: dict[str, int]
    required: bool  # hsdp wrote it: every range must have a checksum


def open_checkpoint(directory: str) -> Opened:
    """Read ``.metadata`` (unpickled here, once) and, for a checkpoint hsdp wrote, its seal
    and every rank's checksums; ``ValueError`` unless they all belong to one save (a plain
    DCP checkpoint has none of them: only its lengths are checked). ``FileNotFoundError``
    when there is no ``.metadata``."""
    with open(os.path.join(directory, METADATA), "rb") as f:
        raw = f.read()
    seal_file = os.path.join(directory, SEAL)
    sealed = _read_json(seal_file) if os.path.lexists(seal_file) else None
    if sealed is not None:  # checked before anything is unpickled
        sealed = _seal_fields(sealed)
        if hashlib.sha256(raw).hexdigest() != sealed["metadata_sha256"]:
            raise ValueError(f"{METADATA} does not match the checksum in {SEAL} (edited, or "
                             f"from another checkpoint)")
    metadata = pickle.loads(raw)  # noqa: S301 - DCP's format (see checkpoints.md)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    save_id = metadata.storage_meta.save_id
    if sealed is None:
        evidence = _hsdp_evidence(directory, save_id)
        if evidence is None:
            return Opened(metadata, {}, False)
        raise ValueError(f"hsdp.save wrote this checkpoint ({evidence}) but its seal {SEAL} "
                         f"is missing: its files cannot be checked to belong together "
                         f"(removed, or an incomplete copy); copy the whole directory again")
    if save_id != sealed["save_id"]:
        raise ValueError(f"{METADATA} is from save {save_id}, {SEAL} from save "
                         f"{sealed['save_id']}")
    return Opened(metadata, _load_sums(directory, save_id, sealed["ranks"]), True)


def _seal_fields(sealed: Any) -> dict[str, Any]:
    """The seal, with its fields checked."""
    if (not isinstance(sealed, dict) or not isinstance(sealed.get("save_id"), str)
            or not isinstance(sealed.get("ranks"), int)
            or not isinstance(sealed.get("metadata_sha256"), str)):
        raise ValueError(f"{SEAL} is not an hsdp seal (altered?): {sealed!r:.200}")
    return sealed


def _hsdp_evidence(directory: str, save_id: Any) -> str | None:
    """What says hsdp wrote the checkpoint in ``directory`` (None: nothing)."""
    if isinstance(save_id, str) and _HSDP_ID.fullmatch(save_id):
        return f"the save id {save_id} in its {METADATA}"
    sums = glob.glob(os.path.join(glob.escape(directory), f"{_SUMS}.*.json"))
    for name in [os.path.join(directory, MARKER)] + sorted(sums):
        if os.path.lexists(name):
            return f"it holds {os.path.basename(name)}"
    return None


def _read_json(name: str) -> dict[str, Any]:
    try:
        with open(name) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{name} is missing or unreadable ({e})") from e


def _load_sums(directory: str, save_id: str, ranks: int) -> dict[str, int]:
    """The checksums of the ``ranks`` ranks that wrote save ``save_id``."""
    names = {os.path.join(directory, f"{_SUMS}.{r}.json") for r in range(ranks)}
    stray = set(glob.glob(os.path.join(glob.escape(directory), f"{_SUMS}.*.json"))) - names
    if stray:
        raise ValueError(f"{min(stray)} is not from this checkpoint ({ranks} ranks saved it)")
    sums: dict[str, int] = {}
    for name in sorted(names):
        rec = _read_json(name)
        if not isinstance(rec, dict) or rec.get("save_id") != save_id:
            raise ValueError(f"{name} is from another checkpoint (save "
                             f"{rec.get('save_id') if isinstance(rec, dict) else None}, this "
                             f"one is {save_id})")
        sums.update(rec["sums"])
    return sums


def verify(path: str, infos: Iterable[Any], sums: dict[str, int], required: bool) -> None:
    """Raise ``ValueError`` (saying what is wrong; the caller names the file) unless every
    range of file ``path`` is there and matches its checksum; ``required``: a range without
    a checksum is an error too."""
    size = os.path.getsize(path)
    for info in infos:
        end = info.offset + info.length
        if end > size:
            raise ValueError(f"truncated: {size} bytes, the checkpoint's metadata needs "
                             f"{end}")
        want = sums.get(_key(info))
        if want is None:
            if required:
                raise ValueError(f"no recorded checksum for bytes [{info.offset}, {end})")
            continue
        if _crc(path, info.offset, info.length) != want:
            raise ValueError(f"corrupt: bytes [{info.offset}, {end}) do not match their "
                             f"checksum")
