"""One save at a time per checkpoint path, across jobs: the lock file ``.<name>.lock``.

Two jobs saving to one path (e.g. torchft replica groups, each its own world) would each
drop the other's staging directory or switch the link to it. So a save's rank 0 creates
``.<name>.lock`` next to ``path`` (``O_EXCL``: exactly one creator) before it claims a
staging directory, holds it until the link is switched, and removes it then. It holds the
holder's identity (host, pid, job id, save id, start time); while it is held, a thread
touches it every ``HEARTBEAT_S`` seconds. A second saver refuses with
``CheckpointBusyError`` naming the holder, unless the lock is stale: its holder's
process is gone (same host and pid namespace) or its heartbeat is older than
``STALE_S`` seconds; a stale lock is broken (removed) and the save goes on. Before it
switches the link, the holder checks that the lock is still its own.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from typing import Any

from hsdp.checkpoint.sync import CheckpointBusyError

HEARTBEAT_S = 10.0  # how often a holder touches its lock
STALE_S = 120.0  # a lock whose heartbeat is older than this is broken by the next save
_JOB_VARS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "REPLICA_GROUP_ID")


def lock_file(path: str) -> str:
    """The lock of checkpoint path ``path`` (absolute)."""
    parent, base = os.path.split(path)
    return os.path.join(parent, f".{base}.lock")


def _host() -> str:
    """This host, and its pid namespace where there is one (containers on one host)."""
    try:
        return f"{socket.gethostname()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return socket.gethostname()


def _read(lock: str) -> dict[str, Any] | None:
    """The holder a lock file names; {} while its creator is still writing it; None when
    there is no lock."""
    try:
        with open(lock) as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _stale(info: dict[str, Any], age: float) -> str | None:
    """Why the lock of ``info`` with heartbeat ``age`` seconds old is stale, or None."""
    pid = info.get("pid")
    if info.get("host") == _host() and isinstance(pid, int) and not _alive(pid):
        return f"its process {pid} on this host is gone"
    if age > STALE_S:
        return f"no heartbeat for {age:.0f} s (more than {STALE_S:g} s)"
    return None


def _describe(info: dict[str, Any], age: float) -> str:
    if not info:
        return "a save that is just starting"
    job = f", job {info['job']}" if info.get("job") else ""
    return (f"save {info.get('save_id')} of host {str(info.get('host')).split()[0]}, pid "
            f"{info.get('pid')}{job}, started {info.get('started')}, last heartbeat "
            f"{age:.0f} s ago")


class SaveLock:
    """A save's hold on its path's lock (rank 0's): ``acquire`` it, ``release`` it once
    the link is switched or the save failed."""

    def __init__(self, path: str, save_id: str) -> None:
        self.path, self.file, self.save_id = path, lock_file(path), save_id
        self.broke: str | None = None  # the stale lock this save broke, described
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                      name=f"hsdp save lock {path}")

    @classmethod
    def acquire(cls, path: str, save_id: str) -> SaveLock:
        """Take ``path``'s lock, breaking a stale one; ``CheckpointBusyError`` if another
        save holds it."""
        lock = cls(path, save_id)
        info = {"host": _host(), "pid": os.getpid(), "save_id": save_id,
                "job": next((f"{v}={os.environ[v]}" for v in _JOB_VARS if v in os.environ),
                            None),
                "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        while not lock._create(json.dumps(info)):
            lock._break_stale()
        lock._beat.start()
        return lock

    def _create(self, text: str) -> bool:
        try:
            fd = os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True

    def _break_stale(self) -> None:
        """Remove the lock there if it is stale, else raise ``CheckpointBusyError``."""
        info = _read(self.file)
        if info is None:  # released meanwhile
            return
        try:
            age = time.time() - os.stat(self.file).st_mtime
        except FileNotFoundError:
            return
        why = _stale(info, age)
        if why is None:
            raise CheckpointBusyError(
                f"hsdp.save: {self.path} is being saved by another job "
                f"({_describe(info, age)}); this save wrote nothing and the checkpoint "
                f"there is unchanged. Two saves to one path at once would drop each "
                f"other's files, so the second is refused: save to a path of its own, or "
                f"catch hsdp.CheckpointBusyError where another job saving is expected "
                f"(replica groups of a fault-tolerant run). A dead job's lock is broken "
                f"by the next save once its heartbeat is {STALE_S:g} s old (at once on "
                f"the same host); to break it now, remove {self.file}")
        if _read(self.file) == info:  # not replaced by a fresh lock meanwhile
            try:
                os.remove(self.file)
            except FileNotFoundError:
                return
            self.broke = f"{_describe(info, age)}: {why}"

    def held(self) -> str | None:
        """None while this save still holds the lock, else what is there now."""
        info = _read(self.file)
        if info is not None and info.get("save_id") == self.save_id:
            return None
        if info is None:
            return "the lock file is gone"
        try:
            age = time.time() - os.stat(self.file).st_mtime
        except FileNotFoundError:
            age = 0.0
        return f"it now names {_describe(info, age)}"

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if self.held() is not None:
                return
            try:
                os.utime(self.file)
            except FileNotFoundError:
                return

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this save's."""
        self._stop.set()
        if self._beat.is_alive():
            self._beat.join()
        if self.held() is None:
            os.remove(self.file)
