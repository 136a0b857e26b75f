"""torchtitan's own trainer with hsdp and with its FSDP2, side by side (scripts/torchtitan_gpu.sh).

- ``python scripts/torchtitan_gpu.py assets DIR``: a synthetic tokenizer (word level, 2,000
  words) and text data set in torchtitan's ``c4_test`` layout under DIR, so that no
  download is needed (the GPU machine has no internet).
- As a torchtitan config module (``--module torchtitan_gpu --config NAME``, with this
  folder on ``PYTHONPATH``): ``{fsdp2,hsdp}_{debugmodel,1b}``, torchtitan's
  ``llama3_debugmodel`` trainer config with the ``debugmodel`` or ``1B`` Llama3 flavor
  (SDPA attention, unchunked loss), parallelized by torchtitan's FSDP2 or by hsdp.
- ``python scripts/torchtitan_gpu.py train ARGS``: torchtitan's ``torchtitan.train`` main
  on torch 2.11 (``_torch_compat``; run under ``torch.distributed.run``).
- ``python scripts/torchtitan_gpu.py summarize LOG``: the trainer's per-step log lines
  (loss, tokens/s, MFU, peak reserved memory) as JSON on stdout.
- ``python scripts/torchtitan_gpu.py bench --json PATH``: ``scripts/torchtitan_gpu.sh``
  with its runs under PATH's folder (``torchtitan_runs/``), their summaries merged into
  PATH (``bench suite``'s table "torchtitan's trainer on one H200").
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

WORDS = 2000


def make_assets(root: Path) -> None:
    """A word-level tokenizer (``tokenizer.json``, ``tokenizer_config.json``) and a JSON
    lines text set of random words (fixed seed) under ``root``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    vocab = {w: i for i, w in enumerate([bos, eos, "<unk>", *(f"w{i}" for i in range(WORDS))])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    (root / "tokenizer").mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "tokenizer" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": eos, "add_bos_token": True}))
    rng = random.Random(0)
    (root / "data").mkdir(exist_ok=True)
    with open(root / "data" / "train.jsonl", "w") as f:
        for _ in range(4000):
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(WORDS)}"
                                                 for _ in range(rng.randrange(200, 2000)))}))
            f.write("\n")


def _torch_compat() -> None:
    """Two names torchtitan 0.3.0 takes from a torch newer than the GPU machine's 2.11:
    ``torch.distributed.set_timeout`` (called after the first step; 2.11 and 2.13 have it
    as ``_set_pg_timeout``) and ``torch.distributed.fsdp.DataParallelMeshDims`` (imported
    at module level; used only by its ``full_dtensor`` / ``spmd_types`` backends, whose FSDP
    takes ``dp_mesh_dims``: the default ``partial_dtensor`` backend that both runs use
    passes none, so a stand-in that raises when built is enough)."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout
    if not hasattr(fsdp, "DataParallelMeshDims"):
        class DataParallelMeshDims:
            def __init__(self, *_: object, **__: object) -> None:
                raise NotImplementedError("DataParallelMeshDims needs a newer torch: use "
                                          "parallelism.spmd_backend partial_dtensor")
        fsdp.DataParallelMeshDims = DataParallelMeshDims


def _config(flavor: str, use_hsdp: bool):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    _torch_compat()

    def config():
        cfg = llama3_debugmodel()
        cfg.model_spec = model_registry(flavor)
        # SDPA: torchtitan 0.3.0's flex attention calls create_block_mask(
        # separate_full_blocks=...), which torch 2.11 does not have
        for layer in cfg.model_spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
        cfg.validator.enable = False
        cfg.loss = cfg.loss.loss_fn  # unchunked for both: hsdp's with_hsdp does it
        return cfg

    if use_hsdp:
        from hsdp.integrations.torchtitan import with_hsdp
        return with_hsdp(config)
    return config


def __getattr__(name: str):
    """``fsdp2_debugmodel``, ``hsdp_debugmodel``, ``fsdp2_1b``, ``hsdp_1b``."""
    backend, _, flavor = name.partition("_")
    if backend in ("fsdp2", "hsdp") and flavor in ("debugmodel", "1b"):
        return _config("1B" if flavor == "1b" else flavor, backend == "hsdp")
    raise AttributeError(name)


_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naninf]+).*?memory:\s*([\d.]+)GiB.*?"
                   r"tps:\s*([\d,]+).*?tflops:\s*([\d,.]+)\s+mfu:\s*([\d.]+%|N/A)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def summarize(log: Path) -> dict:
    """Per-step loss, tokens/s, TFLOPS, MFU and peak reserved memory from a trainer log."""
    steps = []
    for line in log.read_text(errors="replace").splitlines():
        m = _STEP.search(_ANSI.sub("", line))
        if m:
            step, loss, mem, tps, tflops, mfu = m.groups()
            steps.append({"step": int(step), "loss": float(loss),
                          "max_reserved_gib": float(mem), "tps": int(tps.replace(",", "")),
                          "tflops": float(tflops.replace(",", "")),
                          "mfu_pct": None if mfu == "N/A" else float(mfu.rstrip("%"))})
    return {"steps": steps}


def merge(runs: Path) -> dict:
    """The summaries ``torchtitan_gpu.sh`` wrote under ``runs`` (one per run), by run name,
    with the GPU the trainer logged and the torchtitan version."""
    from importlib.metadata import version

    gpus = {m.group(1) for log in runs.glob("*.log")
            for m in re.finditer(r"CUDA capacity: (.+?) with", log.read_text(errors="replace"))}
    return {"torchtitan": version("torchtitan"), "gpus": sorted(gpus),
            "runs": {p.stem: json.loads(p.read_text()) for p in sorted(runs.glob("*.json"))}}


def bench(out: Path) -> None:
    """Run ``torchtitan_gpu.sh`` beside ``out`` and merge its summaries into ``out``."""
    import os
    import subprocess

    runs = out.parent / "torchtitan_runs"
    script = Path(__file__).with_name("torchtitan_gpu.sh")
    subprocess.run(["bash", str(script)], check=True, env=os.environ | {"OUT": str(runs)})
    out.write_text(json.dumps(merge(runs)))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "train":  # torchtitan.train's main with _torch_compat applied first
        import runpy
        _torch_compat()
        sys.argv = [sys.argv[0], *sys.argv[2:]]
        runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
        sys.exit()
    arg = Path(sys.argv[-1])
    if cmd == "bench" and sys.argv[2:3] == ["--json"]:
        bench(arg)
    elif cmd == "assets":
        make_assets(arg)
    elif cmd == "summarize":
        print(json.dumps(summarize(arg)))
    else:
        raise SystemExit(f"unknown command {cmd!r}: assets DIR | summarize LOG | "
                         "bench --json PATH | train TORCHTITAN_ARGS...")
