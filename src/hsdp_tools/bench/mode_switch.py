"""Convergence of a run that switches the outer axis's mode across resumes.

``world_job`` (inside a spawned gloo world, 4x2 on 8 ranks) trains, per seed, the exact
run of ``convergence.py`` and ``switched``: the same steps cut into equal phases, one per
mode of ``PHASES`` (exact -> int8 + error feedback -> DiLoCo H=10 -> exact), each phase a
new model in its mode resumed by ``hsdp.load`` from the checkpoint the previous phase's
``hsdp.save`` wrote (docs/guide/checkpoints.md says what each switch keeps). ``verdict``:
whether the switched runs end within the exact runs' spread over seeds
(``scripts/mode_switch_convergence.py``, docs/results/cpu/mode_switch_convergence_8.json).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import hsdp
from hsdp_tools.bench.convergence import RUNS, build, final_losses, train, train_steps

PHASES = ["exact", "int8+EF", "DiLoCo H10 F1", "exact"]
MESH = (4, 2)


def switched(seed: int, steps: int, root: str, phases: list[str] = PHASES) -> list[float]:
    """The loss of every step of one run of ``steps`` steps in ``len(phases)`` equal phases
    (names of ``convergence.RUNS``), each resumed from the previous one's checkpoint
    under ``root``."""
    losses: list[float] = []
    path = None
    for i, run in enumerate(phases):
        compress = dict(RUNS[run])
        mesh = hsdp.init_mesh(*MESH, "cpu", outer_sync=compress.pop("outer_sync", None))
        model, opt = build(mesh, "hsdp", seed, **compress)
        if path is not None:
            hsdp.load(path, model, opt)
        begin, end = i * steps // len(phases), (i + 1) * steps // len(phases)
        losses += train_steps(model, opt, range(begin, end), seed)
        path = f"{root}/seed{seed}-phase{i}"
        hsdp.save(path, model, opt)
    return losses


def world_job(rank: int, world: int, seeds: list[int], steps: int, root: str,
              on_run: Callable[[str, list[float]], None] | None = None
              ) -> dict[str, list[float]]:
    """Per seed, the exact run and the switched one; keys "4x2 hsdp/seed0/exact" and
    ".../switched" (``convergence.summarize``'s form). ``on_run(key, losses)`` after each."""
    out: dict[str, list[float]] = {}
    for seed in seeds:
        for run in ("exact", "switched"):
            key = f"{MESH[0]}x{MESH[1]} hsdp/seed{seed}/{run}"
            if run == "exact":
                out[key] = train(hsdp.init_mesh(*MESH, "cpu"), "hsdp", seed, steps)
            else:
                out[key] = switched(seed, steps, root)
            if on_run is not None:
                on_run(key, out[key])
    return out


def verdict(curves: dict[str, list[float]], tail: int) -> dict[str, object]:
    """The switched runs' final loss (mean over seeds of each run's last ``tail`` steps)
    minus the exact runs', the exact runs' spread over seeds (max - min) and whether the
    difference is within it."""
    finals = final_losses(curves, tail)
    (mesh,) = {m for m, _ in finals}
    exact, switch = finals[(mesh, "exact")], finals[(mesh, "switched")]
    diff = statistics.fmean(switch) - statistics.fmean(exact)
    spread = max(exact) - min(exact)
    return {"exact_finals": exact, "switched_finals": switch, "switched_minus_exact": diff,
            "exact_spread": spread, "within_spread": abs(diff) <= spread}
