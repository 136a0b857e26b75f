"""torch's own state-dict paths on hsdp models (4 ranks, 2x2 gloo): DCP checkpoints made by
``torch.distributed.checkpoint.state_dict.get_state_dict`` exchanged with FSDP2, saved
asynchronously by torch, full state dicts broadcast from rank 0, pickled and deep-copied
state dicts. Each is checked against one process trained on the same global batches with
SGD-momentum (parity_jobs' layout).
"""

from __future__ import annotations

import copy
import io
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from checkpoint_jobs import _mesh, _same, _steps
from parity_jobs import _batches, _fsdp2_state, _rel_err
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.fsdp import fully_shard as fsdp2_shard

import hsdp
from hsdp_tools.models import GPT, GPTConfig, lm_loss

K = 2  # steps before the state moves, then one more after it
FULL = StateDictOptions(full_state_dict=True)
FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _build(kind: str, seed: int) -> nn.Module:
    """``kind``: "ref" (one process), "hsdp" / "hfsdp" (hsdp strategies) or "fsdp2"
    (torch's fully_shard), on the 2x2 mesh."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig())
    if kind == "ref":
        return model
    mesh = _mesh(2, 2)
    for blk in model.blocks:
        if kind == "fsdp2":
            fsdp2_shard(blk, mesh=mesh)
        else:
            hsdp.fully_shard(blk, mesh=mesh, strategy=kind)
    if kind == "fsdp2":
        return fsdp2_shard(model, mesh=mesh)
    return hsdp.fully_shard(model, mesh=mesh, strategy=kind)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _full(model: nn.Module, kind: str) -> dict[str, torch.Tensor]:
    if kind == "ref":
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _fsdp2_state(model) if kind == "fsdp2" else hsdp.full_state_dict(model)


def _ref_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, world: int) -> None:
    tokens = _batches(step, 0, world, GPTConfig())
    lm_loss(model(tokens), tokens).backward()
    opt.step()
    opt.zero_grad()


def _load_and_step(dst: nn.Module, kind: str, path: str, name: str,
                   ref_at_k: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                   rank: int, world: int) -> dict[str, float]:
    """torch's ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` of the checkpoint at
    ``path`` into a fresh ``dst`` and its SGD, then one more step: each one's error against
    the one-process reference at step K and K + 1."""
    dst_opt = _sgd(dst)
    msd, osd = get_state_dict(dst, dst_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(dst, dst_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    out = {f"{name}/loaded": _rel_err(_full(dst, kind), ref_at_k)}
    _steps(dst, dst_opt, range(K, K + 1), rank, world)
    out[f"{name}/step"] = _rel_err(_full(dst, kind), want)
    return out


def _raises_everywhere(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return ""


def torch_sd_job(rank: int, world: int, root: str) -> dict[str, object]:
    out: dict[str, object] = {}
    ref, ref_opt = _build("ref", 0), None
    ref_opt = _sgd(ref)
    for step in range(K):
        _ref_step(ref, ref_opt, step, world)
    ref_at_k = _full(ref, "ref")
    ref_opt_full = copy.deepcopy(ref_opt.state_dict())
    ref_after = _build("ref", 0)  # K + 1 steps
    after_opt = _sgd(ref_after)
    for step in range(K + 1):
        _ref_step(ref_after, after_opt, step, world)
    want = _full(ref_after, "ref")

    # Item 3: torch's get_state_dict + dcp.save, loaded by another library / strategy with
    # torch's get_state_dict + dcp.load + set_state_dict; one more step matches one process.
    for src_kind, dst_kind in (("hsdp", "fsdp2"), ("fsdp2", "hsdp"), ("hfsdp", "hsdp"),
                               ("hsdp", "hfsdp")):
        name = f"dcp:{src_kind}->{dst_kind}"
        path = os.path.join(root, name.replace(":", "_").replace(">", ""))
        src = _build(src_kind, 0)
        opt = _sgd(src)
        _steps(src, opt, range(K), rank, world)
        msd, osd = get_state_dict(src, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        out.update(_load_and_step(_build(dst_kind, 1), dst_kind, path, name, ref_at_k, want,
                                  rank, world))
        if src_kind == "hsdp" and dst_kind == "fsdp2":  # the file converts to torch.save
            if rank == 0:
                dcp_to_torch_save(path, path + ".pt")
                saved = torch.load(path + ".pt", weights_only=False)
                momenta = {k: v["momentum_buffer"] for k, v in saved["optim"]["state"].items()}
                out["dcp_to_torch_save/model"] = _rel_err(saved["model"], ref_at_k)
                out["dcp_to_torch_save/momentum"] = _rel_err(momenta, {
                    n: ref_opt_full["state"][i]["momentum_buffer"]
                    for i, (n, _) in enumerate(ref.named_parameters())})
            dist.barrier()

    # Item 4: full state dicts (one process's, after K steps) broadcast from rank 0 (the
    # others pass {}) or given on every rank, then one more step.
    ref_osd = get_optimizer_state_dict(ref, ref_opt, options=FULL)
    for kind in ("hsdp", "hfsdp"):
        for name, opts in (("from_rank0", FROM_RANK0), ("full", FULL)):
            model = _build(kind, 1)
            opt = _sgd(model)
            mine = rank == 0 or opts is FULL
            # copies: torch writes into the dicts it is given
            set_model_state_dict(model, dict(ref_at_k) if mine else {}, options=opts)
            set_optimizer_state_dict(model, opt, copy.deepcopy(ref_osd) if mine else {},
                                     options=opts)
            out[f"{name}:{kind}/loaded"] = _rel_err(_full(model, kind), ref_at_k)
            _steps(model, opt, range(K, K + 1), rank, world)
            out[f"{name}:{kind}/step"] = _rel_err(_full(model, kind), want)
    model = _build("hsdp", 1)
    before = _full(model, "hsdp")
    bad_shape = dict(ref_at_k, **{"head.weight": torch.zeros(3, 3)})
    out["error/shape"] = _raises_everywhere(lambda: set_model_state_dict(
        model, bad_shape if rank == 0 else {}, options=FROM_RANK0))
    extra = dict(ref_at_k, extra=torch.zeros(2))
    out["error/extra"] = _raises_everywhere(lambda: set_model_state_dict(
        model, extra if rank == 0 else {}, options=FROM_RANK0))
    out["error/unchanged"] = _same(_full(model, "hsdp"), before)

    # Item 5: pickled and deep-copied state dicts load back; one more step matches.
    for kind in ("hsdp", "hfsdp"):
        model = _build(kind, 0)
        opt = _sgd(model)
        _steps(model, opt, range(K), rank, world)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
        snap = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
        for name, state in (("torch.save", None), ("deepcopy", snap)):
            if state is None:
                buf.seek(0)
                state = torch.load(buf)
            dst = _build(kind, 1)
            dst_opt = _sgd(dst)
            dst.load_state_dict(state["model"])
            dst_opt.load_state_dict(state["optim"])
            out[f"{name}:{kind}/loaded"] = _rel_err(_full(dst, kind), ref_at_k)
            _steps(dst, dst_opt, range(K, K + 1), rank, world)
            out[f"{name}:{kind}/step"] = _rel_err(_full(dst, kind), want)
        _steps(model, opt, range(K, K + 1), rank, world)  # the snapshot is a copy
        out[f"deepcopy:{kind}/independent"] = _rel_err(
            {k: v.full_tensor() for k, v in snap["model"].items()}, ref_at_k)
    return out


def _ref_full(world: int, steps: int) -> dict[str, torch.Tensor]:
    """One process after ``steps`` steps."""
    ref = _build("ref", 0)
    opt = _sgd(ref)
    for step in range(steps):
        _ref_step(ref, opt, step, world)
    return _full(ref, "ref")


def async_save_job(rank: int, world: int, root: str) -> dict[str, float]:
    """torch's asynchronous DCP save (``dcp.async_save``) of torch's ``get_state_dict``
    on hsdp models, written by a thread (the default) or by torch's checkpoint process
    (``AsyncCheckpointerType.PROCESS`` with a ``DefaultStager``: torchtitan's
    ``async_with_pinned_mem`` less the pinned memory and non-blocking copies, which need
    CUDA). The run takes a step while the save is written; a model resumed from it equals
    one process at the save, and one step later the run that went on."""
    out: dict[str, float] = {}
    ref_at_k, want = _ref_full(world, K), _ref_full(world, K + 1)
    for kind in ("hsdp", "hfsdp"):
        for executor in ("thread", "process"):
            name = f"async:{kind}:{executor}"
            path = os.path.join(root, name.replace(":", "_"))
            model = _build(kind, 0)
            opt = _sgd(model)
            _steps(model, opt, range(K), rank, world)
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            if executor == "thread":
                saved = dcp.async_save(state, checkpoint_id=path)
            else:
                stager = DefaultStager(StagingOptions(False, True, True, False))
                response = dcp.async_save(state, checkpoint_id=path, async_stager=stager,
                                          async_checkpointer_type=AsyncCheckpointerType.PROCESS)
                response.staging_completion.result()  # torchtitan waits before its next step
                saved = response.upload_completion
            _steps(model, opt, range(K, K + 1), rank, world)  # while the save is written
            saved.result()
            if executor == "process":
                stager.close()
            out[f"{name}/went on"] = _rel_err(_full(model, kind), want)
            out.update(_load_and_step(_build(kind, 1), kind, path, name, ref_at_k, want,
                                      rank, world))
    return out
