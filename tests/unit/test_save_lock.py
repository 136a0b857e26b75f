"""The lock that keeps two jobs from saving to one checkpoint path at once: a live
holder refuses the second saver naming it, a dead or silent one is broken, the holder
keeps it fresh and notices when it lost it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import hsdp
from hsdp.checkpoint import save_lock
from hsdp.checkpoint.save_lock import SaveLock, lock_file


def _foreign_lock(path: str, host: str, pid: int, age_s: float) -> str:
    lock = lock_file(path)
    with open(lock, "w") as f:
        json.dump({"host": host, "pid": pid, "save_id": "hsdp-other", "job": None,
                   "started": "then"}, f)
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_held_lock_refuses_a_second_saver_naming_the_holder(tmp_path) -> None:
    path = str(tmp_path / "ck")
    first = SaveLock.acquire(path, "hsdp-first")
    with pytest.raises(hsdp.CheckpointBusyError) as e:
        SaveLock.acquire(path, "hsdp-second")
    msg = str(e.value)
    assert "being saved by another job" in msg and "hsdp-first" in msg, msg
    assert f"pid {os.getpid()}" in msg and lock_file(path) in msg, msg
    assert isinstance(e.value, hsdp.CheckpointError)
    assert first.held() is None
    first.release()
    assert not os.path.exists(lock_file(path))
    SaveLock.acquire(path, "hsdp-third").release()


def test_the_lock_of_a_dead_process_on_this_host_is_broken(tmp_path) -> None:
    path = str(tmp_path / "ck")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _foreign_lock(path, save_lock._host(), gone.pid, 0.0)
    lock = SaveLock.acquire(path, "hsdp-mine")
    assert lock.broke is not None and f"{gone.pid} on this host is gone" in lock.broke
    assert lock.held() is None
    lock.release()


def test_another_hosts_lock_is_broken_only_once_its_heartbeat_is_stale(tmp_path) -> None:
    path = str(tmp_path / "ck")
    _foreign_lock(path, "elsewhere", 1, save_lock.STALE_S / 2)
    with pytest.raises(hsdp.CheckpointBusyError, match="host elsewhere, pid 1"):
        SaveLock.acquire(path, "hsdp-mine")
    _foreign_lock(path, "elsewhere", 1, save_lock.STALE_S + 5)
    lock = SaveLock.acquire(path, "hsdp-mine")
    assert "no heartbeat" in lock.broke, lock.broke
    lock.release()


def test_the_holder_keeps_its_lock_fresh_and_notices_losing_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(save_lock, "HEARTBEAT_S", 0.05)
    path = str(tmp_path / "ck")
    lock = SaveLock.acquire(path, "hsdp-mine")
    then = time.time() - 1000
    os.utime(lock_file(path), (then, then))
    deadline = time.monotonic() + 30
    while os.stat(lock_file(path)).st_mtime < then + 500:
        assert time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.01)
    os.remove(lock_file(path))  # broken by another save
    _foreign_lock(path, "elsewhere", 1, 0.0)
    assert "it now names save hsdp-other" in lock.held()
    lock.release()
    assert os.path.exists(lock_file(path))  # the other save's lock is left alone
