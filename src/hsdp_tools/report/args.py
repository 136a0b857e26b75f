"""Command-line argument types shared by ``bench`` and ``sim``."""

from __future__ import annotations

import argparse
import re

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_mesh(text: str) -> tuple[int, int]:
    """``"2x4"`` -> (outer, inner)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"bad mesh {text!r}: expected OUTERxINNER, e.g. 2x4")
    return int(m.group(1)), int(m.group(2))
