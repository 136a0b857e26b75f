"""Multi-rank jobs for checkpoint safety: paths hsdp does not own, corrupt files,
unfinished asynchronous saves, a stalled peer. 4 gloo ranks on a 2x2 mesh.

Rank 0 prepares (and restores) files; the other ranks see them after a barrier (one
machine). Every job returns, per rank, what it saw; the tests compare.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from checkpoint_jobs import K, Side, _build, _optimizer, _reference, _same, _steps
from parity_jobs import _rel_err

import hsdp
import hsdp.checkpoint.dcp
from hsdp.checkpoint.dirs import MARKER

SIDE = Side(2, 2)


def _outcome(fn, *args) -> str:
    """'ok', or the type and message of what ``fn(*args)`` raised (BaseExceptions included, so
    that a DCP CheckpointException shows up as such instead of ending the job)."""
    try:
        fn(*args)
        return "ok"
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    except BaseException as e:  # noqa: BLE001 - e.g. DCP's CheckpointException
        return f"BaseException {type(e).__name__}: {e}"


def _listing(root: str) -> dict[str, str]:
    """Every entry under ``root``: a link's target, a file's bytes, 'dir' (not following
    links)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full):
                out[rel] = "-> " + os.readlink(full)
            elif os.path.isdir(full):
                out[rel] = "dir"
            else:
                with open(full, "rb") as f:
                    out[rel] = f.read().hex()
    return out


def _loads_as(path: str, want: dict[str, torch.Tensor]) -> bool:
    """``path`` loads (on every rank: a load that raises is False) and holds ``want``."""
    fresh = _build(SIDE, 7)
    return (_outcome(hsdp.load, path, fresh, _optimizer(fresh, "sgd")) == "ok"
            and _same(hsdp.full_state_dict(fresh), want))


def _on_rank0(fn) -> None:
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def paths_job(rank: int, world: int, root: str) -> dict[str, object]:
    """Paths hsdp did not make are refused on every rank and left as they were; a user's
    staging-named symlinks are never written through; the old target of hsdp's own link is
    removed only when nothing else points at it; a unit that is not the root is refused."""
    out: dict[str, object] = {}
    model = _build(SIDE, 0)
    opt = _optimizer(model, "sgd")
    _steps(model, opt, range(K), rank, world)
    state = hsdp.full_state_dict(model)
    user = os.path.join(root, "user")

    def prepare() -> None:
        os.makedirs(os.path.join(user, "user_data"))
        with open(os.path.join(user, "user_data", "precious.txt"), "w") as f:
            f.write("mine")
        os.symlink("user_data", os.path.join(user, "latest"))
        with open(os.path.join(user, "notes.txt"), "w") as f:
            f.write("notes")

    _on_rank0(prepare)
    hsdp.save(os.path.join(user, "keep"), model, opt)
    _on_rank0(lambda: os.symlink("keep", os.path.join(user, "latest2")))
    before = _listing(user)
    for name in ("latest", "latest2", "notes.txt"):
        out[name] = _outcome(hsdp.save, os.path.join(user, name), model, opt)
    out["user_unchanged"] = _listing(user) == before
    out["keep_loads"] = _loads_as(os.path.join(user, "keep"), state)

    # Staging-like names the user made: a symlink to a directory of theirs, a symlink and a
    # directory (without hsdp's marker) named like hsdp's staging directories.
    staged = os.path.join(root, "staged")

    def prepare_staged() -> None:
        os.makedirs(os.path.join(staged, "victim"))
        os.makedirs(os.path.join(staged, ".ck." + "b" * 32))
        with open(os.path.join(staged, ".ck." + "b" * 32, "theirs.txt"), "w") as f:
            f.write("theirs")
        os.symlink("victim", os.path.join(staged, ".ck.partial"))
        os.symlink("victim", os.path.join(staged, ".ck." + "a" * 32))

    _on_rank0(prepare_staged)
    before = _listing(staged)
    dist.barrier()  # every rank has listed it before rank 0 creates anything there
    out["staged_save"] = _outcome(lambda: hsdp.save(os.path.join(staged, "ck"), model, opt))
    after = _listing(staged)
    out["staged_untouched"] = all(after.get(k) == v for k, v in before.items())
    out["victim_empty"] = os.listdir(os.path.join(staged, "victim")) == []
    out["staged_loads"] = _loads_as(os.path.join(staged, "ck"), state)

    # A rolling "latest" saved three times; a user's pin on the first version keeps it.
    roll = os.path.join(root, "roll")
    saved = []
    for i in range(3):
        hsdp.save(os.path.join(roll, "latest"), model, opt)
        saved.append(hsdp.full_state_dict(model))
        if i == 0:
            _on_rank0(lambda: os.symlink(os.readlink(os.path.join(roll, "latest")),
                                         os.path.join(roll, "pin")))
        _steps(model, opt, range(K + i, K + i + 1), rank, world)
    out["pin_loads_first"] = _loads_as(os.path.join(roll, "pin"), saved[0])
    out["latest_loads_last"] = _loads_as(os.path.join(roll, "latest"), saved[2])
    out["roll_dirs"] = sorted(n for n in os.listdir(roll) if n.startswith(".latest."))

    # A unit inside the sharded model is not a checkpoint of it.
    unit = os.path.join(root, "unit")
    out["unit_save"] = _outcome(hsdp.save, unit, model.blocks[0])
    out["unit_load"] = _outcome(hsdp.load, os.path.join(user, "keep"), model.blocks[0])
    out["unit_nothing_written"] = not os.path.lexists(unit) and not any(
        n.startswith(".unit") for n in os.listdir(root))
    return out


def _write(file: str, data: bytes | None) -> None:
    """Write ``data`` to ``file``, or remove it (None)."""
    if data is None:
        os.remove(file)
        return
    with open(file, "wb") as f:
        f.write(data)


def _momenta(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [opt.state[p]["momentum_buffer"].full_tensor().clone()
            for pg in opt.param_groups for p in pg["params"]]


def corrupt_job(rank: int, world: int, root: str) -> dict[str, object]:
    """A missing, truncated or bit-flipped data file: the load raises an Exception naming
    the file on every rank and leaves model and optimizer as they were; restored, the
    checkpoint resumes training to the single-process reference."""
    out: dict[str, object] = {}
    model = _build(SIDE, 0)
    opt = _optimizer(model, "sgd")
    _steps(model, opt, range(K), rank, world)
    path = os.path.join(root, "good")
    hsdp.save(path, model, opt)
    fresh = _build(SIDE, 1)
    fresh_opt = _optimizer(fresh, "sgd")
    _steps(fresh, fresh_opt, range(1), rank, world)  # momentum to be kept
    snapshot, momenta = hsdp.full_state_dict(fresh), _momenta(fresh_opt)
    data = os.path.realpath(path)

    def truncate(raw: bytes) -> bytes | None:
        return raw[:len(raw) // 2]

    def flip(raw: bytes) -> bytes | None:
        b = bytearray(raw)
        b[len(b) // 2] ^= 0x10
        return bytes(b)

    # hsdp's replicas over outer are written once: ranks 0 and 1 write every piece.
    for what, name, change in (("truncated", "__0_0.distcp", truncate),
                               ("flipped", "__1_0.distcp", flip),
                               ("missing", "__0_0.distcp", lambda raw: None)):
        file = os.path.join(data, name)
        with open(file, "rb") as f:
            raw = f.read()
        assert raw, f"{file} is empty: damaging it would test nothing"
        dist.barrier()  # every rank has read it before rank 0 changes it
        _on_rank0(partial(_write, file, change(raw)))
        out[what] = _outcome(hsdp.load, path, fresh, fresh_opt)
        out[f"{what}_unchanged"] = (_same(hsdp.full_state_dict(fresh), snapshot) and all(
            torch.equal(a, b) for a, b in zip(_momenta(fresh_opt), momenta)))
        _on_rank0(partial(_write, file, raw))
    hsdp.load(path, fresh, fresh_opt)
    _steps(fresh, fresh_opt, range(K, 2 * K), rank, world)
    out["ref"] = _rel_err(hsdp.full_state_dict(fresh), _reference("sgd", world))
    return out


def _slow_writes(seconds: float) -> None:
    """Each rank's data write takes ``seconds`` longer (a slow file system)."""
    original = hsdp.checkpoint.dcp.CheckpointWriter.write_data

    def slow(self, plan, planner):
        time.sleep(seconds)
        return original(self, plan, planner)

    hsdp.checkpoint.dcp.CheckpointWriter.write_data = slow


def async_job(rank: int, world: int, root: str) -> dict[str, object]:
    """Asynchronous saves nobody waits for: ``synchronize`` publishes one, raises on every
    rank for one that failed; the last is still in flight when the job returns (the
    harness then calls ``destroy_process_group``); the test reads it in one process."""
    out: dict[str, object] = {}
    model = _build(SIDE, 0)
    opt = _optimizer(model, "sgd")
    _steps(model, opt, range(K), rank, world)
    original = hsdp.checkpoint.dcp.CheckpointWriter.write_data
    _slow_writes(2.0)
    out["at_a"] = hsdp.full_state_dict(model)
    hsdp.save(os.path.join(root, "a"), model, opt, async_save=True)
    hsdp.synchronize(model)
    out["a_published"] = os.path.isfile(os.path.join(root, "a", ".metadata"))

    def failing(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError("disk full (injected)")
        return original(self, plan, planner)

    hsdp.checkpoint.dcp.CheckpointWriter.write_data = failing
    hsdp.save(os.path.join(root, "f"), model, opt, async_save=True)
    out["failed"] = _outcome(lambda: hsdp.synchronize(model))
    out["f_absent"] = not os.path.lexists(os.path.join(root, "f"))

    hsdp.checkpoint.dcp.CheckpointWriter.write_data = original
    _slow_writes(2.0)
    _steps(model, opt, range(K, K + 1), rank, world)
    out["at_b"] = hsdp.full_state_dict(model)
    hsdp.save(os.path.join(root, "b"), model, opt, async_save=True)
    return out


STALL_PG_TIMEOUT_S = 10.0


def stall_job(rank: int, world: int, root: str) -> dict[str, object]:
    """Rank 3 does not come to a save: the others raise hsdp's error naming it within a
    few timeouts (the host groups' timeout is the default group's)."""
    model = _build(SIDE, 0)
    opt = _optimizer(model, "sgd")
    hsdp.save(os.path.join(root, "first"), model, opt)  # every group exists from here on
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, object] = {}
    if rank == 3:
        store.wait([f"stall-done{r}" for r in range(3)], timedelta(seconds=120))
        return out
    t0 = time.monotonic()
    out["error"] = _outcome(lambda: hsdp.save(os.path.join(root, "second"), model, opt))
    out["seconds"] = time.monotonic() - t0
    store.set(f"stall-done{rank}", "1")
    return out


def unmarked_job(rank: int, world: int, root: str) -> dict[str, object]:
    """A checkpoint hsdp wrote is hsdp's by its content: without the directory marker a
    flipped byte, a shard of another save, an edited ``.metadata`` are refused as with
    it, and without its seal (or with an altered one) it is refused too. Each case: the
    load raises on every rank and changes nothing."""
    import shutil

    from ckpt_invariance_jobs import _copy, _swap_two_ranges

    out: dict[str, object] = {}
    model = _build(SIDE, 0)
    opt = _optimizer(model, "sgd")
    _steps(model, opt, range(K), rank, world)
    hsdp.save(os.path.join(root, "a"), model, opt)
    saved = hsdp.full_state_dict(model)
    _steps(model, opt, range(K, K + 1), rank, world)
    hsdp.save(os.path.join(root, "b"), model, opt)
    a, b = (os.path.realpath(os.path.join(root, n)) for n in ("a", "b"))
    fresh = _build(SIDE, 1)
    fresh_opt = _optimizer(fresh, "sgd")
    _steps(fresh, fresh_opt, range(1), rank, world)
    snapshot, momenta = hsdp.full_state_dict(fresh), _momenta(fresh_opt)
    backup = os.path.join(root, "a-backup")
    _on_rank0(lambda: shutil.copytree(a, backup))

    def flip() -> None:
        with open(os.path.join(a, "__1_0.distcp"), "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))

    def remove(*names: str) -> Callable[[], None]:
        return lambda: [os.remove(os.path.join(a, n)) for n in names]

    def edit_seal() -> None:
        with open(os.path.join(a, ".hsdp-seal.json"), "w") as f:
            f.write('{"save_id": "x"}')

    sums = [f".hsdp-checksums.{r}.json" for r in range(world)]
    cases = {"flipped": flip,
             "foreign_shard": lambda: [_copy(os.path.join(b, n), os.path.join(a, n))
                                       for n in ("__1_0.distcp", ".hsdp-checksums.1.json")],
             "swapped": lambda: _swap_two_ranges(os.path.join(a, ".metadata")),
             "no_seal": remove(".hsdp-seal.json"),
             "no_seal_no_sums": remove(".hsdp-seal.json", *sums),
             "altered_seal": edit_seal}
    for case, damage in cases.items():
        _on_rank0(lambda damage=damage: (os.remove(os.path.join(a, MARKER)), damage()))
        out[case] = _outcome(hsdp.load, os.path.join(root, "a"), fresh, fresh_opt)
        out[f"{case}_unchanged"] = (_same(hsdp.full_state_dict(fresh), snapshot) and all(
            torch.equal(x, y) for x, y in zip(_momenta(fresh_opt), momenta)))
        _on_rank0(lambda: (shutil.rmtree(a), shutil.copytree(backup, a)))
    _on_rank0(remove(MARKER))
    out["unmarked_loads"] = _outcome(hsdp.load, os.path.join(root, "a"), fresh, fresh_opt)
    out["unmarked_equal"] = _same(hsdp.full_state_dict(fresh), saved)
    return out
