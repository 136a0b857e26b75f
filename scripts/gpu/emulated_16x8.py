"""The set-up the GPU host scripts share (``ab_host.py``, ``prof_host.py``,
``host_breakdown.py``): ``bench step``'s emulated 16x8 configuration at a given sequence
length (bf16 reduction) on GPU 0, torch's fake process group, and one step's batches."""
import argparse

import torch

from hsdp.bench import step as S
from hsdp.bench.emulate import fake_mesh
from hsdp.bench.trainee import synthetic_batches


def setup(seq: str):
    """``(cfg, device, mesh, batches)`` for ``bench step --emulate --mesh 16x8 --seq
    <seq> --reduce-dtype bf16``."""
    p = argparse.ArgumentParser()
    S.add_arguments(p)
    cfg = S.resolve(p.parse_args(["--emulate", "--mesh", "16x8", "--seq", seq,
                                  "--reduce-dtype", "bf16"]), True, None)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    mesh = fake_mesh(16, 8, "cuda")
    return cfg, dev, mesh, synthetic_batches(cfg.model.vocab, cfg.mbs, cfg.model.seq, 1, dev)
