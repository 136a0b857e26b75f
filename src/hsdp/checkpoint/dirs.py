"""Which checkpoint files hsdp owns: the only ones it ever replaces or removes.

``save(path)`` writes into a fresh hidden sibling ``.<name>.<32 hex>`` holding a marker
file, then publishes it by atomically switching the symlink ``path`` to it (a relative
link to that bare name). hsdp owns exactly:

- a symlink whose target is such a bare sibling name (it switches it);
- a real directory (not a symlink) of that name holding the marker (it removes it once no
  symlink in the same directory points at it any more).

Anything else at ``path`` (a file, a directory, a symlink the user made) is refused before
anything is written, and nothing is followed through a symlink hsdp did not make. Plain
filesystem work, rank 0 only: the caller tells the other ranks.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid

MARKER = ".hsdp-checkpoint"  # in every directory hsdp created for a checkpoint


def _ours(base: str) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(base)}\.[0-9a-f]{{32}}")


def check_path(path: str) -> None:
    """Raise ``FileExistsError`` unless a save may publish at ``path`` (absolute): nothing
    there yet, or a symlink hsdp made."""
    if os.path.islink(path):
        target = os.readlink(path)
        if not _ours(os.path.basename(path)).fullmatch(target):
            raise FileExistsError(
                f"hsdp.save: {path} is a symlink hsdp did not make (-> {target}); hsdp never "
                f"replaces or writes through it. Save to a new path (e.g. a per-step name) and "
                f"point your link at it yourself, or remove the link")
    elif os.path.lexists(path):
        kind = "a directory" if os.path.isdir(path) else "a file"
        raise FileExistsError(
            f"hsdp.save: {path} is {kind} hsdp did not write (hsdp publishes checkpoints as "
            f"a symlink to a hidden directory); nothing was changed. Choose a new path, or "
            f"move it away")


def target(path: str) -> str | None:
    """What the link ``path`` points at (None: no link there)."""
    return os.readlink(path) if os.path.islink(path) else None


def claim(path: str) -> str:
    """Check ``path``, drop what interrupted saves to it left, and create a new, empty
    staging directory (with the marker) next to it; returns the staging directory. The
    caller holds ``path``'s lock (``save_lock.py``): no other save is writing to it."""
    check_path(path)
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    _drop_leftovers(parent, base)
    staging = os.path.join(parent, f".{base}.{uuid.uuid4().hex}")
    os.mkdir(staging)  # fails if anything is there: a new name, never reused
    with open(os.path.join(staging, MARKER), "x") as f:
        f.write(f"hsdp checkpoint for {base}\n")
    return staging


def publish(path: str, staging: str) -> None:
    """Point ``path`` at the finished ``staging`` (``os.replace`` of a symlink is atomic),
    then remove the previous target if hsdp owns it and nothing else in that directory
    points at it. ``path`` is checked again: it may have changed since ``claim``."""
    try:
        check_path(path)
    except FileExistsError as e:
        raise FileExistsError(f"{e}. The new checkpoint is complete at {staging}") from e
    parent = os.path.dirname(path)
    old = os.path.join(parent, os.readlink(path)) if os.path.islink(path) else None
    link = staging + ".link"
    os.symlink(os.path.basename(staging), link)
    os.replace(link, path)
    if old is not None and old != staging and _removable(old, parent):
        shutil.rmtree(old)


def _owned_dir(directory: str) -> bool:
    marker = os.path.join(directory, MARKER)
    return (os.path.isdir(directory) and not os.path.islink(directory)
            and os.path.isfile(marker) and not os.path.islink(marker))


def _removable(directory: str, parent: str) -> bool:
    """hsdp's own directory that no symlink in ``parent`` resolves to."""
    if not _owned_dir(directory):
        return False
    real = os.path.realpath(directory)
    with os.scandir(parent) as entries:
        return not any(e.is_symlink() and os.path.realpath(e.path) == real for e in entries)


def _drop_leftovers(parent: str, base: str) -> None:
    """Remove what saves to ``base`` that died before publishing left: hsdp's temporary
    links, then its unreferenced staging directories."""
    pattern = _ours(base)
    names = os.listdir(parent)
    for name in names:
        full = os.path.join(parent, name)
        if name.endswith(".link") and pattern.fullmatch(name[:-5]) and os.path.islink(full):
            os.unlink(full)
    for name in names:
        full = os.path.join(parent, name)
        if pattern.fullmatch(name) and _removable(full, parent):
            shutil.rmtree(full)
