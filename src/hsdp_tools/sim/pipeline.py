"""A pipeline-parallel step (1F1B) priced from one stage's simulated step: where a stage's
outer reduction hides in the pipeline's drain and what the overlapped outer reduction
buys over the serialized one.

The engine runs one stage (its layers, its (outer, inner) mesh, tp, the step's
microbatches one after another) for both schedules. From its timeline: ``slot``, one
microbatch's forward and backward on the stage (the overlapped run's compute up to the
end of its last backward, over the microbatches); ``bwd``, the backward's share of it;
``delay``, how much later the serialized run's last backward ends (its outer reduction
holds the reduce-scatters, and they the backward); ``after``, the stage's time from its
last backward to idle streams (outer tail, optimizer, hfsdp's outer all-gather).

1F1B with ``pp`` equal stages and free point-to-point sends: the last microbatch's
backward runs down the stages, last stage first, so stage ``s`` (0 the first) ends its
backward ``s * (bwd + delay)`` before stage 0 and has that long (its drain) to finish
its outer reduction. The step is ``(M + pp - 1) * slot`` (the bubble included), plus
``pp * delay`` (each stage's last backward on the drain's chain), plus stage 0's
``after``: stage 0 has no drain. ``hides`` counts the stages whose outer tail fits their
drain.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from hsdp_tools.models import preset
from hsdp_tools.report.table import print_table
from hsdp_tools.sim.costs import CostModel
from hsdp_tools.sim.engine import Setup, SimResult, simulate
from hsdp_tools.sim.fabric import Fabric, Link

_BACKWARD = ("BWD:", "COPY_IN:", "RECOMPUTE:")
_STAGE_WORK = ("FWD:", *_BACKWARD)


@dataclass(frozen=True)
class StageTimes:
    """One stage's step, in ms (module doc)."""

    slot: float
    bwd: float
    delay: float
    after: float
    tail: float  # outer_tail_ms: the outer reduction past the last backward


def _work_end(r: SimResult) -> float:
    return max(iv.end_us for iv in r.intervals
               if iv.stream == "compute" and iv.label.startswith(_STAGE_WORK)) / 1e3


def _busy(r: SimResult, prefixes: tuple[str, ...]) -> float:
    return sum(iv.end_us - iv.start_us for iv in r.intervals
               if iv.stream == "compute" and iv.label.startswith(prefixes)) / 1e3


def stage_times(overlapped: SimResult, serialized: SimResult, microbatches: int,
                serial: bool) -> StageTimes:
    """The stage's times under one schedule (``serial``: the serialized one)."""
    run = serialized if serial else overlapped
    end = _work_end(overlapped)
    work = _busy(overlapped, _STAGE_WORK)
    return StageTimes(slot=end / microbatches,
                      bwd=end / microbatches * _busy(overlapped, _BACKWARD) / work,
                      delay=_work_end(run) - end,
                      after=run.t_step_ms - _work_end(run),
                      tail=run.metrics["outer_tail_ms"])


def pipeline_step(t: StageTimes, pp: int, microbatches: int) -> dict:
    """The 1F1B step of ``pp`` stages like ``t`` (module doc), ms."""
    drain = t.bwd + t.delay
    return {"step_ms": (microbatches + pp - 1) * t.slot + pp * t.delay + t.after,
            "bubble_ms": (pp - 1) * t.slot, "first_stage_after_ms": t.after,
            "outer_tail_ms": t.tail,
            "hides": sum(t.tail <= s * drain for s in range(pp))}


def simulate_pipeline(stage: Setup, costs: CostModel, pp: int) -> dict:
    """Both schedules' 1F1B steps for ``pp`` stages like ``stage``, and what the overlap
    buys (ms, % of the serialized step)."""
    runs = [simulate(dataclasses.replace(stage, overlap_outer=o), costs) for o in (True, False)]
    out = {name: pipeline_step(stage_times(*runs, stage.microbatches, serial), pp,
                               stage.microbatches)
           for name, serial in (("overlap", False), ("serial", True))}
    saving = out["serial"]["step_ms"] - out["overlap"]["step_ms"]
    out["saving_ms"], out["saving_pct"] = saving, 100 * saving / out["serial"]["step_ms"]
    return out


# Llama 3 405B (126 layers), the engine's Llama (embedding and head in every stage).
LLAMA_405B = dict(vocab=128256, hidden=16384, heads=128, kv_heads=8, ffn=53248, seq=8192)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m hsdp_tools.sim.pipeline",
                                description=__doc__)
    p.add_argument("--nodes", default="16,32,64,128", help="nodes of 8 GPUs, comma-separated")
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--tp", type=int, default=8, help="tp ranks (one node's GPUs with 8)")
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--strategy", default="hfsdp")
    p.add_argument("--outer-gbps", type=float, default=47.0)
    p.add_argument("--tp-gbps", type=float, default=370.0)
    p.add_argument("--tflops", type=float, default=600.0)
    p.add_argument("--json", type=Path, help="write each setup's result here")
    a = p.parse_args(argv)
    layers = math.ceil(126 / a.pp)
    costs = CostModel(Fabric(Link(370.0, 20.0), Link(a.outer_gbps, 20.0)), a.tflops)
    rows, results = [], {}
    for nodes in (int(n) for n in a.nodes.split(",")):
        dp = nodes * 8 // (a.pp * a.tp)
        stage = Setup(preset("llama-70b", layers=layers, **LLAMA_405B), dp, 1, a.strategy,
                      microbatches=a.microbatches, tp=a.tp, tp_gbps=a.tp_gbps)
        r = results[nodes] = simulate_pipeline(stage, costs, a.pp)
        o, s = r["overlap"], r["serial"]
        rows.append([str(nodes), str(dp), f"{o['step_ms']:.0f}", f"{s['step_ms']:.0f}",
                     f"{r['saving_ms']:.0f} ({r['saving_pct']:.1f}%)", f"{o['bubble_ms']:.0f}",
                     f"{o['outer_tail_ms']:.0f} / {s['outer_tail_ms']:.0f}",
                     f"{o['hides']} / {s['hides']}"])
    print_table(f"sim: Llama 3 405B, pp {a.pp} x tp {a.tp} ({layers} layers a stage), "
                f"{a.strategy} over dp (outer), {a.microbatches} microbatches, 1F1B",
                ["nodes", "dp", "overlap ms", "serial ms", "overlap buys", "bubble ms",
                 "outer tail ms (o / s)", "stages hiding it (o / s)"], rows)
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)},
                                      "nodes": results}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
