"""hsdp under CUDA graphs on one GPU (skipped without CUDA; docs/guide/cuda_graphs.md):
graph replay against eager, bit for bit, and the outer stream's overlap in a replay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HERE = Path(__file__).resolve().parent


def _child(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1] / "src"), NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    out = subprocess.run([sys.executable, str(HERE / "graph_child.py"), mode], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(mode, json.dumps(result, indent=1))
    return result


def test_graph_replay_equals_eager_for_10_steps():
    """hsdp and hfsdp, hsdp with a bf16 reduction (uncleared gradients added in place),
    1 and 3 microbatches, activation checkpointing; forward + backward
    in one graph or one graph per microbatch (torchtitan's), the optimizer step eager or
    captured: the same kernels as eager, so the same parameters and losses, bit for bit."""
    r = _child("parity")
    refusal = r.pop("refusal")
    assert "gradients are not set" in refusal and "set_to_none=False" in refusal, refusal
    assert len(r) == 18
    for key, v in r.items():
        assert v["bit_equal"] and v["max_loss_diff"] == 0.0, (key, v)
        assert v["steps_agreed"] >= 1, (key, v)  # the agreement ran outside the graph


def test_compressed_outer_reduction_and_gather_replay_equal_eager():
    """outer_reduce="int8" (hsdp and hfsdp) and outer_gather="int8" under CUDA graphs: the
    residual in fixed buffers, committed on the device, chained across backwards replayed
    per microbatch; the same parameters, losses and residuals as eager, bit for bit."""
    r = _child("compressed")
    assert len(r) == 12
    for key, v in r.items():
        assert v["bit_equal"] and v["residual_equal"] and v["max_loss_diff"] == 0.0, (key, v)
        assert v["residuals"] > 0 and v["finite"], (key, v)


def test_outer_stream_overlaps_in_a_replay():
    """Fake 2x2 mesh, emulated collectives, outer link at 10 GB/s: the replayed step with
    the outer reduction on its own stream is faster than the serialized one."""
    r = _child("overlap")
    for strategy in ("hsdp", "hfsdp"):
        overlap, serial = r[f"{strategy}/overlap"], r[f"{strategy}/serial"]
        assert overlap[2] < serial[1], r  # every overlapped replay beats every serial one
