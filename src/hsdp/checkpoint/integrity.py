"""Checksums of a checkpoint's data files: a truncated or corrupted file is found before
anything is loaded.

DCP stores each item as a byte range of a ``.distcp`` file and checks nothing: a flipped
byte inside a tensor loads as a wrong value. Each rank records the CRC-32 of the ranges it
wrote (``.hsdp-checksums.<rank>.json`` in the checkpoint directory, written before DCP
writes the metadata that completes the checkpoint); ``verify`` checks a file's ranges
(length, then CRC) before DCP reads them.
"""

from __future__ import annotations

import glob
import json
import os
import zlib
from collections.abc import Iterable
from typing import Any

_SUMS = ".hsdp-checksums"
_BLOCK = 16 << 20


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


def record(directory: str, rank: int, infos: Iterable[Any]) -> None:
    """Write the checksums of the ranges this rank wrote (DCP ``_StorageInfo``s)."""
    sums = {_key(i): _crc(os.path.join(directory, i.relative_path), i.offset, i.length)
            for i in infos}
    with open(os.path.join(directory, f"{_SUMS}.{rank}.json"), "x") as f:
        json.dump(sums, f)


def load_sums(directory: str) -> dict[str, int]:
    """Every rank's recorded checksums (empty for a checkpoint that has none)."""
    sums: dict[str, int] = {}
    for name in sorted(glob.glob(os.path.join(glob.escape(directory), f"{_SUMS}.*.json"))):
        try:
            with open(name) as f:
                sums.update(json.load(f))
        except (OSError, ValueError) as e:
            raise ValueError(f"{name} is unreadable ({e})") from e
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
