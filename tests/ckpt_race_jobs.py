"""Two jobs saving to one checkpoint path at once (``test_checkpoint_race.py``): job "a"
and job "b" are two separate gloo worlds of 2 ranks (as two torchrun jobs, or two torchft
replica groups, are). Hooks place b's save deterministically inside a's: between a's write
and its publish, during a's write, and after a's lock went stale (a stopped process)
between its write and its publish or while it wrote; then the same with torch DCP's
``dcp.save``. The jobs meet through flag files in the shared directory; each returns, per
rank, what it saw.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from checkpoint_jobs import K, Side, _build, _optimizer, _same, _steps
from ckpt_safety_jobs import _outcome

import hsdp
import hsdp.checkpoint.dcp

try:  # absent before saves took a lock: the job still runs, the test then fails
    import hsdp.checkpoint.save_lock as save_lock
except ImportError:
    save_lock = None

SIDE = Side(1, 2)
CASES = ("publish", "write", "stale", "stale_write")
WAIT_S = 300.0


class Flags:
    """Flag files in ``directory`` through which the two jobs meet."""

    def __init__(self, directory: str) -> None:
        self.dir = directory

    def raise_(self, name: str) -> None:
        """Rank 0 raises flag ``name`` once every rank of its job is here."""
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(self.dir, name), "w"):
                pass

    def wait(self, name: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(os.path.join(self.dir, name)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"flag {name} not raised in {WAIT_S} s")
            time.sleep(0.02)


def _patched(owner: object, name: str, before: Callable[[], None] = lambda: None,
             after: Callable[[], None] = lambda: None):
    """``owner.name`` replaced by a wrapper that calls ``before()`` first and ``after()``
    last; returns a function that undoes it."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        before()
        result = original(*args, **kwargs)
        after()
        return result

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, original)


def _loads_as(path: str, states: dict[str, dict]) -> str:
    """Which of ``states`` the checkpoint ``path`` holds ('none' for neither), or what
    loading it raised."""
    fresh = _build(SIDE, 7)
    got = _outcome(hsdp.load, path, fresh, _optimizer(fresh, "sgd"))
    if got != "ok":
        return got
    full = hsdp.full_state_dict(fresh)
    return next((k for k, v in states.items() if _same(full, v)), "none")


def _dcp_loads_as(path: str, states: dict[str, dict]) -> str:
    """Which of ``states`` the DCP checkpoint ``path`` holds ('none' for neither), or what
    loading it raised."""
    fresh = _build(SIDE, 7)
    sd = {"model": fresh.state_dict()}
    got = _outcome(lambda: dcp.load(sd, checkpoint_id=path))
    if got != "ok":
        return got
    fresh.load_state_dict(sd["model"])
    full = hsdp.full_state_dict(fresh)
    return next((k for k, v in states.items() if _same(full, v)), "none")


def race_job(rank: int, world: int, root: str, role: str) -> dict[str, object]:
    flags = Flags(root)
    model = _build(SIDE, 0 if role == "a" else 1)
    opt = _optimizer(model, "sgd")
    _steps(model, opt, range(K), rank, world)
    mine = hsdp.full_state_dict(model)
    torch.save(mine, os.path.join(root, f"state_{role}_{rank}.pt"))
    flags.raise_(f"{role}_built")
    flags.wait(f"{'b' if role == 'a' else 'a'}_built")
    states = {r: torch.load(os.path.join(root, f"state_{r}_{rank}.pt")) for r in "ab"}
    run = _job_a if role == "a" else _job_b
    out = run(flags, root, model, opt)
    for case in CASES:
        out[f"{case}_loads"] = _loads_as(os.path.join(root, case), states)
        out[f"{case}_target"] = os.path.realpath(os.path.join(root, case))
    out["dcp_loads"] = _dcp_loads_as(os.path.join(root, "dcp"), states)
    out["lock_left"] = sorted(n for n in os.listdir(root) if n.endswith(".lock"))
    return out


def _job_a(flags: Flags, root: str, model, opt) -> dict[str, object]:
    out: dict[str, object] = {}
    writer = hsdp.checkpoint.dcp.CheckpointWriter

    # b saves between a's write and a's publish: rank 0 has sealed the checkpoint (the
    # end of DCP's finish), the others wait for it to publish
    def between() -> None:
        open(os.path.join(root, "a_written"), "w").close()
        flags.wait("b_tried_publish")

    undo = _patched(writer, "finish", after=between)
    out["publish"] = _outcome(hsdp.save, os.path.join(root, "publish"), model, opt)
    undo()
    flags.raise_("a_done_publish")

    # b claims while a's ranks write
    def writing() -> None:
        if dist.get_rank() == 0:
            open(os.path.join(root, "a_writing"), "w").close()
        flags.wait("b_tried_write")

    undo = _patched(writer, "write_data", writing)
    out["write"] = _outcome(hsdp.save, os.path.join(root, "write"), model, opt)
    undo()
    flags.raise_("a_done_write")

    # a stops touching its lock (as a stopped process); b breaks it between a's write and
    # a's publish
    if save_lock is not None:
        save_lock.HEARTBEAT_S = 3600.0

    def stopped() -> None:
        open(os.path.join(root, "a_written_stale"), "w").close()
        flags.wait("b_tried_stale")

    undo = _patched(writer, "finish", after=stopped)
    out["stale"] = _outcome(hsdp.save, os.path.join(root, "stale"), model, opt)
    undo()
    flags.raise_("a_done_stale")

    # a stops touching its lock while its ranks write; b breaks it, removes a's unfinished
    # files and publishes its own: a's write fails and says the path was switched
    def stopped_writing() -> None:
        if dist.get_rank() == 0:
            open(os.path.join(root, "a_writing_stale_write"), "w").close()
        flags.wait("b_tried_stale_write")

    undo = _patched(writer, "write_data", stopped_writing)
    out["stale_write"] = _outcome(hsdp.save, os.path.join(root, "stale_write"), model, opt)
    undo()
    flags.raise_("a_done_stale_write")

    # torch DCP: b's dcp.save between a's data and a's metadata
    def finishing() -> None:
        open(os.path.join(root, "a_written_dcp"), "w").close()
        flags.wait("b_tried_dcp")

    undo = _patched(dcp.FileSystemWriter, "finish", finishing)  # the coordinator's
    out["dcp"] = _outcome(lambda: dcp.save({"model": model.state_dict()},
                                           checkpoint_id=os.path.join(root, "dcp")))
    undo()
    flags.raise_("a_done_dcp")
    return out


def _job_b(flags: Flags, root: str, model, opt) -> dict[str, object]:
    out: dict[str, object] = {}
    for case in CASES:
        flags.wait({"publish": "a_written", "write": "a_writing", "stale": "a_written_stale",
                    "stale_write": "a_writing_stale_write"}[case])
        if case.startswith("stale") and dist.get_rank() == 0 and save_lock is not None:
            lock = save_lock.lock_file(os.path.join(root, case))
            then = time.time() - 2 * save_lock.STALE_S  # a's last heartbeat, long ago
            os.utime(lock, (then, then))
        out[case] = _outcome(hsdp.save, os.path.join(root, case), model, opt)
        flags.raise_(f"b_tried_{case}")
        flags.wait(f"a_done_{case}")
    flags.wait("a_written_dcp")
    out["dcp"] = _outcome(lambda: dcp.save({"model": model.state_dict()},
                                           checkpoint_id=os.path.join(root, "dcp")))
    flags.raise_("b_tried_dcp")
    flags.wait("a_done_dcp")
    return out
