"""hsdp_tools.advise inside a running job (4 gloo ranks, 2x2)."""

from __future__ import annotations

import hsdp
import hsdp_tools
from hsdp_tools.models import build_model, preset


def advise_job(rank: int, world: int) -> dict[str, object]:
    """Every rank calls advise on the model it trains: the report (rank 0's, agreed)."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    model = build_model(preset("gpt-1b", layers=2, seq=256, hidden=256, heads=4, ffn=1024,
                               vocab=1024))
    hsdp.fully_shard(model, mesh=mesh)
    return hsdp_tools.advise(model, mesh, sizes=[2**16, 2**18], show=rank == 0)
