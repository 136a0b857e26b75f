"""Multi-rank jobs: saving never changes training. 4 gloo ranks on a 2x2 mesh.

A GPT with one more parameter (``late``) that the forward uses only from step ``LATE`` on:
before that it has no gradient, so no optimizer state. A run that saves (and calls
``get_state_dict``, and fails a load) after every step must equal, bit for bit, the run
that does not; a run resumed from a checkpoint taken while ``late`` had no state must
equal it too.
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from checkpoint_jobs import _mesh
from parity_jobs import ROWS_PER_RANK, _batches

import hsdp
from hsdp_tools.models import GPT, GPTConfig, lm_loss

STEPS, LATE = 4, 2
OPTIMIZERS = {
    "sgd": partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    "adamw-foreach": partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True),
}


class LateGPT(nn.Module):
    """GPT whose logits get ``late`` added once ``use_late`` is set."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(cfg)
        self.late = nn.Parameter(0.01 * torch.randn(cfg.vocab))
        self.use_late = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(tokens)
        return logits + self.late if self.use_late else logits


def build(seed: int, cfg: GPTConfig | None = None) -> LateGPT:
    torch.manual_seed(seed)
    model = LateGPT(cfg or GPTConfig())
    mesh = _mesh(2, 2)
    for blk in model.gpt.blocks:
        hsdp.fully_shard(blk, mesh=mesh)
    return hsdp.fully_shard(model, mesh=mesh)


def train(model: LateGPT, opt: torch.optim.Optimizer, steps: range, rank: int, world: int,
          after_step=None) -> None:
    for step in steps:
        model.use_late = step >= LATE
        tokens = _batches(step, 0, world, GPTConfig())[rank * ROWS_PER_RANK:
                                                        (rank + 1) * ROWS_PER_RANK]
        lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(step)


def optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    """Every state entry, whole (``full_tensor`` of the sharded ones), by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, object] = {}
    for pg in opt.param_groups:
        for p in pg["params"]:
            for k, v in opt.state.get(p, {}).items():
                whole = v.full_tensor() if hasattr(v, "full_tensor") else v
                out[f"{names[id(p)]}.{k}"] = whole.clone() if torch.is_tensor(whole) else whole
    return out


def _equal(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    return hsdp.full_state_dict(model), optimizer_state(model, opt)


def invisible_saves_job(rank: int, world: int, root: str) -> dict[str, object]:
    """Per optimizer: whether the run with saves, get_state_dict and a failed load after
    every step ends (and stands after step 1, ``late`` still without state) equal to the run
    without; whether a run resumed from the step-1 checkpoint ends equal to it too."""
    out: dict[str, object] = {}
    other = build(9, GPTConfig(hidden=48, heads=4))  # a checkpoint that does not fit
    hsdp.save(os.path.join(root, "other"), other)
    for kind, make in OPTIMIZERS.items():
        plain = build(0)
        plain_opt = make(plain.parameters())
        train(plain, plain_opt, range(LATE), rank, world)
        at_1 = _snapshot(plain, plain_opt)
        train(plain, plain_opt, range(LATE, STEPS), rank, world)
        want = _snapshot(plain, plain_opt)

        saving = build(0)
        saving_opt = make(saving.parameters())
        seen: dict[int, tuple] = {}

        def save_every_step(step: int, m=saving, o=saving_opt, k=kind, seen=seen) -> None:
            hsdp.save(os.path.join(root, f"{k}-{step}"), m, o)
            hsdp.get_state_dict(m, o)
            try:
                hsdp.load(os.path.join(root, "other"), m, o)
            except (KeyError, ValueError):
                pass
            if step == LATE - 1:
                seen[step] = _snapshot(m, o)

        train(saving, saving_opt, range(STEPS), rank, world, save_every_step)
        resumed = build(1)
        resumed_opt = make(resumed.parameters())
        hsdp.load(os.path.join(root, f"{kind}-{LATE - 1}"), resumed, resumed_opt)
        train(resumed, resumed_opt, range(LATE, STEPS), rank, world)
        got = _snapshot(saving, saving_opt)
        out[kind] = {
            "late_without_state": not any(k.startswith("late.") for k in at_1[1]),
            "equal_at_1": all(_equal(a, b) for a, b in zip(seen[LATE - 1], at_1)),
            "equal": all(_equal(a, b) for a, b in zip(got, want)),
            "resumed_equal": all(_equal(a, b) for a, b in
                                 zip(_snapshot(resumed, resumed_opt), want)),
            "late_trained": not torch.equal(want[0]["late"], at_1[0]["late"]),
        }
        dist.barrier()
    return out


def _outcome(fn, *args) -> str:
    try:
        fn(*args)
        return "ok"
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"


def _two_groups(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only: two parameter groups."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                              {"params": [p for p in params if p.dim() < 2],
                               "weight_decay": 0.0}], lr=1e-2)


def _gpt(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    model = GPT(GPTConfig()).to(dtype)
    mesh = _mesh(2, 2)
    for blk in model.blocks:
        hsdp.fully_shard(blk, mesh=mesh)
    return hsdp.fully_shard(model, mesh=mesh)


def _gpt_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int,
               world: int) -> None:
    for step in steps:
        tokens = _batches(step, 0, world, GPTConfig())[rank * ROWS_PER_RANK:
                                                        (rank + 1) * ROWS_PER_RANK]
        lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()


def all_or_nothing_job(rank: int, world: int, root: str) -> dict[str, object]:
    """Loads that must fail: the error (every rank) and whether model and optimizer are as
    they were; then that a good load still works after them."""
    from unittest import mock

    import hsdp.checkpoint.load_targets as targets

    out: dict[str, object] = {}
    src = _gpt(0)
    two = _two_groups(src)
    _gpt_steps(src, two, range(2), rank, world)
    hsdp.save(os.path.join(root, "two_groups"), src, two)
    one = torch.optim.AdamW(src.parameters(), lr=1e-2)
    _gpt_steps(src, one, range(2, 3), rank, world)
    hsdp.save(os.path.join(root, "one_group"), src, one)
    saved = _snapshot(src, one)

    dst = _gpt(1)
    dst_opt = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    _gpt_steps(dst, dst_opt, range(1), rank, world)  # state to be kept
    before = _snapshot(dst, dst_opt)

    def unchanged() -> bool:
        return all(_equal(a, b) for a, b in zip(_snapshot(dst, dst_opt), before))

    out["groups"] = _outcome(hsdp.load, os.path.join(root, "two_groups"), dst, dst_opt)
    out["groups_unchanged"] = unchanged()
    sgd = torch.optim.SGD(dst.parameters(), lr=0.1, momentum=0.9)
    out["class"] = _outcome(hsdp.load, os.path.join(root, "one_group"), dst, sgd)
    out["class_unchanged"] = unchanged() and not sgd.state
    half = _gpt(1, torch.bfloat16)
    half_before = hsdp.full_state_dict(half)
    out["dtype"] = _outcome(hsdp.load, os.path.join(root, "one_group"), half)
    out["dtype_unchanged"] = _equal(hsdp.full_state_dict(half), half_before)

    def fails_on_rank_2(*args, **kwargs):
        if dist.get_rank() == 2:
            raise ValueError("injected on rank 2")
        return check_model(*args, **kwargs)

    check_model = targets.check_model
    with mock.patch("hsdp.checkpoint.dcp.check_model", fails_on_rank_2):
        out["one_rank"] = _outcome(hsdp.load, os.path.join(root, "one_group"), dst, dst_opt)
    out["one_rank_unchanged"] = unchanged()
    hsdp.load(os.path.join(root, "one_group"), dst, dst_opt)
    out["good_load"] = all(_equal(a, b) for a, b in zip(_snapshot(dst, dst_opt), saved))

    # An optimizer whose initial state hsdp does not build: get_state_dict refuses a fresh
    # one; hsdp.save writes it without state, and hsdp.load restores exactly that.
    rms = torch.optim.RMSprop(src.parameters(), lr=1e-3)
    out["rms_get_state_dict"] = _outcome(hsdp.get_state_dict, src, rms)
    hsdp.save(os.path.join(root, "rms_fresh"), src, rms)
    _gpt_steps(src, rms, range(1), rank, world)
    hsdp.save(os.path.join(root, "rms"), src, rms)
    rms_saved = _snapshot(src, rms)
    hsdp.load(os.path.join(root, "rms_fresh"), src, rms)
    out["rms_fresh_loads_without_state"] = not rms.state
    other = torch.optim.RMSprop(dst.parameters(), lr=1e-3)
    hsdp.load(os.path.join(root, "rms"), dst, other)
    out["rms_round_trip"] = all(_equal(a, b) for a, b in zip(_snapshot(dst, other), rms_saved))
    return out


def _on_rank0(fn, *args) -> None:
    if dist.get_rank() == 0:
        fn(*args)
    dist.barrier()


def _copy(src: str, dst: str) -> None:
    """Copy ``src`` over ``dst`` (nothing if there is no ``src``)."""
    if not os.path.exists(src):
        return
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as f:
        f.write(data)


def _swap_two_ranges(metadata_file: str) -> None:
    """Edit a DCP ``.metadata``: two items of one file and one length trade byte ranges."""
    import pickle

    with open(metadata_file, "rb") as f:
        md = pickle.load(f)
    by_size: dict[tuple, list] = {}
    for index, info in md.storage_data.items():
        by_size.setdefault((info.relative_path, info.length), []).append(index)
    a, b = next(v for v in by_size.values() if len(v) >= 2)[:2]
    ia, ib = md.storage_data[a], md.storage_data[b]
    md.storage_data[a], md.storage_data[b] = (dataclasses.replace(ia, offset=ib.offset),
                                              dataclasses.replace(ib, offset=ia.offset))
    with open(metadata_file, "wb") as f:
        pickle.dump(md, f)


def binding_job(rank: int, world: int, root: str) -> dict[str, object]:
    """Files of two saves of the same model mixed, or an edited ``.metadata``: the load
    raises on every rank and changes nothing; ``.metadata`` is unpickled once per load."""
    import pickle
    import shutil
    from unittest import mock

    from torch.distributed.checkpoint.metadata import Metadata

    out: dict[str, object] = {}
    model = _gpt(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _gpt_steps(model, opt, range(1), rank, world)
    hsdp.save(os.path.join(root, "a"), model, opt)
    want = _snapshot(model, opt)
    _gpt_steps(model, opt, range(1, 2), rank, world)
    hsdp.save(os.path.join(root, "b"), model, opt)
    a, b = (os.path.realpath(os.path.join(root, n)) for n in ("a", "b"))
    dst = _gpt(1)
    dst_opt = torch.optim.SGD(dst.parameters(), lr=0.1, momentum=0.9)
    _gpt_steps(dst, dst_opt, range(1), rank, world)
    before = _snapshot(dst, dst_opt)
    backup = os.path.join(root, "a-backup")
    _on_rank0(shutil.copytree, a, backup)

    def restore() -> None:
        shutil.rmtree(a)
        shutil.copytree(backup, a)

    mixes = {"foreign_shard": ["__1_0.distcp", ".hsdp-checksums.1.json"],
             "foreign_metadata": [".metadata", ".hsdp-seal.json"]}
    for case, names in mixes.items():
        _on_rank0(lambda names=names: [_copy(os.path.join(b, n), os.path.join(a, n))
                                       for n in names])
        out[case] = _outcome(hsdp.load, os.path.join(root, "a"), dst, dst_opt)
        out[f"{case}_unchanged"] = all(_equal(x, y) for x, y in
                                       zip(_snapshot(dst, dst_opt), before))
        _on_rank0(restore)
    _on_rank0(_swap_two_ranges, os.path.join(a, ".metadata"))
    out["swapped"] = _outcome(hsdp.load, os.path.join(root, "a"), dst, dst_opt)
    out["swapped_unchanged"] = all(_equal(x, y) for x, y in
                                   zip(_snapshot(dst, dst_opt), before))
    _on_rank0(restore)

    unpickled = []
    for name in ("load", "loads"):
        original = getattr(pickle, name)

        def counting(*args, original=original, **kwargs):
            obj = original(*args, **kwargs)
            if isinstance(obj, Metadata):
                unpickled.append(obj)
            return obj

        mock.patch.object(pickle, name, counting).start()
    try:
        hsdp.load(os.path.join(root, "a"), dst, dst_opt)
    finally:
        mock.patch.stopall()
    out["metadata_unpickled"] = len(unpickled)
    out["good_load"] = all(_equal(x, y) for x, y in zip(_snapshot(dst, dst_opt), want))
    return out
