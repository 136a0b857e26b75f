"""Demo: train a small model on local ranks with hsdp's schedules and torch FSDP2 side by side.

This is ``bench step`` with demo-sized defaults: on CPU, 4 gloo ranks on a 2x2 mesh and a
small Llama-style model (well under two minutes on two cores); with GPUs, every local GPU on a
2 x N/2 mesh and bench step's GPU model. Any ``bench step`` option can be given.
"""

from __future__ import annotations

import argparse

from hsdp_tools.bench import step
from hsdp_tools.bench.step_config import MODEL_DEFAULTS
from hsdp_tools.bench.step_config import add_arguments as add_step_arguments

DEMO_MODEL = {
    "cuda": MODEL_DEFAULTS["cuda"],
    "cpu": {"arch": "llama", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 192,
            "vocab": 512, "seq": 64, "mbs": 2},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_step_arguments(p, DEMO_MODEL)
    p.set_defaults(steps=5, warmup=2, record_steps=1, trace_steps=1, out_dir="out/demo")


def run(args: argparse.Namespace) -> int:
    return step.run(args)
