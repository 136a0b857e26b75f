"""examples/train_llama.py under torchrun on 4 gloo ranks (2x2): its loss log matches a
single-process run of the same model, data, init and optimizer; a run resumed from its
checkpoint continues with the same losses. A transformers model takes the same path
(skipped without transformers)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_llama.py"
STEPS = 5
ARGS = ["--mesh", "2x2", "--steps", str(STEPS), "--batch", "8", "--microbatches", "2",
        "--dtype", "fp32", "--compile-backend", "aot_eager", "--clip", "0.1"]


def _example():
    spec = importlib.util.spec_from_file_location("train_llama", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_llama"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _torchrun(args: list[str], log: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-port", str(free_port()), str(SCRIPT), *args, "--log-file", str(log)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


def _reference(ex, args: list[str]) -> list[dict]:
    """The same training in one process, no hsdp: whole global batch per step."""
    a = ex.parse_args(args)
    cfg = ex.config(a)
    model = ex.Llama(cfg)
    torch.manual_seed(a.seed)
    for m in model.modules():
        ex.init_weights(m)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, ex.lr_lambda(a.warmup, a.steps,
                                                                a.min_lr_ratio))
    out = []
    for step in range(a.steps):
        tokens = ex.batch(step, a.batch, cfg)
        loss = ex.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append({"step": step, "loss": loss.item(), "grad_norm": norm.item()})
    return out


@pytest.mark.full
def test_example_matches_reference_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = _torchrun([*ARGS, "--ckpt", str(ckpt), "--save-every", "3"], tmp_path / "a.jsonl")
    ref = _reference(_example(), ARGS)
    assert [r["step"] for r in run] == list(range(STEPS))
    for mine, want in zip(run, ref):
        assert mine["loss"] == pytest.approx(want["loss"], rel=1e-4), (run, ref)
        assert mine["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (run, ref)
    assert run[-1]["loss"] < run[0]["loss"]
    resumed = _torchrun([*ARGS, "--ckpt", str(ckpt), "--resume"], tmp_path / "b.jsonl")
    assert [r["step"] for r in resumed] == [3, 4]
    for mine, want in zip(resumed, run[3:]):
        assert mine["loss"] == pytest.approx(want["loss"], rel=1e-6), (resumed, run)


def test_transformers_llama_meta_init_and_training():
    pytest.importorskip("transformers")
    from dist_utils import run_ranks
    from drop_in_jobs import transformers_job

    res = run_ranks(transformers_job, 4)
    assert all(r == res[0] for r in res), res
    assert res[0]["init"] == 0.0 and res[0]["ref"] < 1e-5 and res[0]["loss_moved"], res[0]
