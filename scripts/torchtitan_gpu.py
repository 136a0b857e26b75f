"""torchtitan's own trainer with hsdp and with its FSDP2, side by side (scripts/torchtitan_gpu.sh).

- ``python scripts/torchtitan_gpu.py assets DIR``: a synthetic tokenizer (word level, 2,000
  words) and text data set in torchtitan's ``c4_test`` layout under DIR, so that no
  download is needed (the GPU machine has no internet).
- As a torchtitan config module (``--module torchtitan_gpu --config NAME``, with this
  folder on ``PYTHONPATH``): ``{fsdp2,hsdp}_{debugmodel,1b}``, torchtitan's
  ``llama3_debugmodel`` trainer config with the ``debugmodel`` or ``1B`` Llama3 flavor
  (flex attention, unchunked loss), parallelized by torchtitan's FSDP2 or by hsdp.
- ``python scripts/torchtitan_gpu.py summarize LOG``: the trainer's per-step log lines
  (loss, tokens/s, MFU, peak reserved memory) as JSON on stdout.
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
    """torchtitan 0.3.0's trainer calls ``torch.distributed.set_timeout`` after its first
    step, a name newer than torch 2.11 and 2.13 (which have ``_set_pg_timeout``)."""
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout


def _config(flavor: str, use_hsdp: bool):
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    _torch_compat()

    def config():
        cfg = llama3_debugmodel()
        cfg.model_spec = model_registry(flavor)
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


if __name__ == "__main__":
    cmd, arg = sys.argv[1], Path(sys.argv[2])
    if cmd == "assets":
        make_assets(arg)
    elif cmd == "summarize":
        print(json.dumps(summarize(arg)))
    else:
        raise SystemExit(f"unknown command {cmd!r}: assets DIR | summarize LOG")
