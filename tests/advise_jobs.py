"""hsdp_tools.advise and hsdp_tools.auto inside a running job (4 gloo ranks, 2x2)."""

from __future__ import annotations

from outer_reduce_jobs import auto_log, outer_reduce_of

import hsdp
import hsdp_tools
from hsdp.topology.outer_mode import outer_sync_of
from hsdp_tools.models import build_model, preset
from hsdp_tools.sim.fabric import Link

CFG = preset("gpt-1b", layers=2, seq=256, hidden=256, heads=4, ffn=1024, vocab=1024)
# outer links priced instead of measured: one that DiLoCo should win, one exact should
# (on a model whose compute hides a fast link: llama-8b's width, 2 layers)
LINKS = {"slow": 0.001, "fast": 1000.0}
PRICED = preset("llama-8b", layers=2)


def advise_job(rank: int, world: int) -> dict[str, object]:
    """Every rank calls advise on the model it trains: the report (rank 0's, agreed);
    then hsdp_tools.auto at init_mesh / fully_shard on a slow and a fast outer link: the
    mesh's outer sync, the units' outer_reduce and the line logged."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    model = build_model(CFG)
    hsdp.fully_shard(model, mesh=mesh)
    out: dict[str, object] = {"report": hsdp_tools.advise(model, mesh, sizes=[2**16, 2**18],
                                                          show=rank == 0)}
    with auto_log() as notes:
        for name, gbps in LINKS.items():
            auto = hsdp_tools.auto(PRICED, links={"inner": Link(100.0, 5.0),
                                                  "outer": Link(gbps, 20.0)})
            mesh = hsdp.init_mesh(2, world // 2, "cpu", outer_sync=auto)
            model = build_model(CFG)
            for block in model.blocks:
                hsdp.fully_shard(block, mesh=mesh, outer_reduce=auto)
            hsdp.fully_shard(model, mesh=mesh, outer_reduce=auto)
            out[name] = {"outer_sync": str(outer_sync_of(mesh)),
                         "outer_reduce": outer_reduce_of(model._hsdp_unit.groups[0]),
                         "logged": list(notes)}
            notes.clear()
    return out
