"""Two schedules' step times compared, with the noise stated: a verdict only from enough
timed steps and outside the spread, and CPU timings labelled as schedule checks."""

from __future__ import annotations

MIN_STEPS = 5  # fewer timed steps than this: no verdict (a single slow step decides it)

CPU_NOTE = ("CPU: these times check the schedules (order, overlap and completion of the "
            "collectives on gloo and threads), not their speed; compare speed on GPUs")


def compare(a: dict, b: dict) -> dict:
    """``a`` against ``b`` (two schedules' entries, with their per-step samples): saving,
    ratio of medians, each one's spread (max - min), and a verdict: "too few steps"
    (under ``MIN_STEPS`` each), "within noise" (the min-max ranges overlap), else
    "faster" / "slower" (``a`` than ``b``)."""
    ta, tb = a["t_step_ms"], b["t_step_ms"]
    steps = min(len(a["t_step_samples_ms"]), len(b["t_step_samples_ms"]))
    within = (a["t_step_min_ms"] <= b["t_step_max_ms"]
              and b["t_step_min_ms"] <= a["t_step_max_ms"])
    verdict = ("too few steps" if steps < MIN_STEPS else "within noise" if within
               else "faster" if ta < tb else "slower")
    return {"saving_ms": tb - ta, "saving_pct": 100.0 * (tb - ta) / tb, "ratio": ta / tb,
            "within_noise": within, "steps": steps, "verdict": verdict,
            "spread_ms": [a["t_step_max_ms"] - a["t_step_min_ms"],
                          b["t_step_max_ms"] - b["t_step_min_ms"]]}


def describe(pair: str, v: dict, cpu: bool) -> str:
    """One line for ``compare``'s result ``v`` of ``pair`` ("a_vs_b")."""
    a, b = pair.split("_vs_")
    head = f"{a} vs {b}" + (" (schedule check, not speed)" if cpu else "")
    if v["verdict"] == "too few steps":
        return (f"{head}: no verdict from {v['steps']} timed steps (at least {MIN_STEPS}: "
                f"--steps); medians {v['ratio']:.3f}x")
    spread = f"spread {v['spread_ms'][0]:.2f} / {v['spread_ms'][1]:.2f} ms over {v['steps']} steps"
    if v["verdict"] == "within noise":
        return (f"{head}: within noise ({v['ratio']:.3f}x, {v['saving_ms']:.2f} ms; min-max "
                f"ranges overlap, {spread})")
    return (f"{head}: {v['ratio']:.3f}x, saves {v['saving_ms']:.2f} ms per step "
            f"({v['saving_pct']:.1f}%), {spread}")
