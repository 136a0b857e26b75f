"""One save's claim on its path: the path's lock (``save_lock.py``) and a staging
directory (``dirs.py``) taken by rank 0 at the start, the link switched to the staging
directory at the end, and a failure's error saying truly what is at the path now."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from hsdp.checkpoint import dirs, integrity
from hsdp.checkpoint.save_lock import STALE_S, SaveLock
from hsdp.checkpoint.sync import CheckpointError, Meeting

log = logging.getLogger(__name__)


class Claim:
    """``path`` claimed for one save: ``begin`` (a collective) takes the lock and a staging
    directory on rank 0 and tells every rank; ``publish`` switches the link (rank 0) and
    gives the lock back; ``release`` gives it back without publishing."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.staging = self.save_id = ""
        self.before: str | None = None  # what the link pointed at when the save began
        self._lock: SaveLock | None = None  # rank 0's

    def begin(self, meeting: Meeting, group: dist.ProcessGroup) -> None:
        self.staging, self.save_id, self.before = meeting.agree(group, "start", self._take)

    def _take(self) -> tuple[str, str, str | None]:
        save_id = integrity.new_save_id()
        dirs.check_path(self.path)  # a path hsdp may not write is refused before the lock
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._lock = SaveLock.acquire(self.path, save_id)
        if self._lock.broke is not None:
            log.warning("hsdp.save: broke the stale lock of %s (%s)", self.path,
                        self._lock.broke)
        try:
            return dirs.claim(self.path), save_id, dirs.target(self.path)
        except BaseException:
            self.release()
            raise

    def publish(self) -> None:
        """Rank 0: point ``path`` at the staging directory, once it is complete and the lock
        still this save's; the lock is given back either way."""
        if self._lock is None:
            return
        try:
            holder = self._lock.held()
            if holder is not None:
                raise CheckpointError(
                    f"hsdp.save: the lock on {self.path} was broken while this save wrote "
                    f"({holder}): this process had not touched it for over "
                    f"{STALE_S:g} s (was it stopped?). This save is not published; "
                    f"{self.path} is left to the other save")
            if not os.path.isfile(os.path.join(self.staging, integrity.SEAL)):
                raise CheckpointError(
                    f"hsdp.save: {self.staging} is incomplete or was removed before it "
                    f"was published (no {integrity.SEAL}); {self.path} is unchanged")
            dirs.publish(self.path, self.staging)
        finally:
            self.release()

    def release(self) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.release()

    def failed(self, error: BaseException | str) -> CheckpointError:
        """The error of a save that failed: ``path`` is said unchanged only if it is."""
        now = dirs.target(self.path)
        if now == self.before:
            state = "the checkpoint previously at that path (if any) is unchanged"
        else:
            state = (f"{self.path} was switched meanwhile by another save (to {now}; "
                     f"{self.before or 'nothing'} before this save)")
        return CheckpointError(f"hsdp.save: writing {self.path} failed; {state}. {error}")
