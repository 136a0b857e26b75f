"""Step-time comparisons state their noise: no verdict from too few steps, "within noise"
inside the spread, CPU runs labelled as schedule checks (hsdp_tools.report.compare)."""

from __future__ import annotations

from hsdp_tools.bench.step_results import print_table
from hsdp_tools.report.compare import CPU_NOTE, MIN_STEPS, compare, describe


def entry(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"t_step_ms": s[len(s) // 2], "t_step_min_ms": s[0], "t_step_max_ms": s[-1],
            "t_step_samples_ms": samples}


def test_two_steps_give_no_verdict():
    # The demo's case: 2 steps whose ranges happen not to overlap.
    v = compare(entry([1.0, 1.2]), entry([8.0, 8.5]))
    assert v["verdict"] == "too few steps" and v["steps"] == 2
    line = describe("overlap_vs_fsdp2", v, cpu=False)
    assert "no verdict from 2 timed steps" in line and "saves" not in line, line


def test_spread_decides_between_noise_and_a_verdict():
    fast, slow = [9.0, 9.1, 9.2, 9.1, 9.0], [12.0, 12.2, 12.1, 12.3, 12.0]
    v = compare(entry(fast), entry(slow))
    assert v["verdict"] == "faster" and v["steps"] == MIN_STEPS
    line = describe("overlap_vs_serial", v, cpu=False)
    assert "saves 3.00 ms" in line and "spread 0.20 / 0.30 ms over 5 steps" in line, line
    noisy = compare(entry([9.0, 9.1, 12.5, 9.1, 9.0]), entry(slow))
    assert noisy["verdict"] == "within noise"
    assert "within noise" in describe("overlap_vs_serial", noisy, cpu=False)
    assert compare(entry(slow), entry(fast))["verdict"] == "slower"


def test_cpu_table_labels_times_as_schedule_checks(capsys):
    a, b = entry([1.0, 1.2]), entry([8.0, 8.5])
    schedule = {"peak_mem_phase_bytes": None, "t_host_ms": None, "t_free_ms": None,
                "tokens_per_s": 1.0, "peak_mem_bytes": None, "exposed_comm_ms": None,
                "outer_tail_ms": None, "comm_comm_overlap_ms": None, "lower_bound_ms": None,
                "free_over_unsharded": None}
    result = {"meta": {"mesh": {"outer": 2, "inner": 2}, "emulate": False, "num_params": 1e6,
                       "model": {"dtype": "fp32"}, "global_tokens_per_step": 512,
                       "steps": 2, "layout": "gloo ranks on CPU",
                       "hardware": {"device": "cpu"}, "fabric": None},
              "schedules": {"overlap": {**schedule, **a}, "fsdp2": {**schedule, **b}},
              "summary": {"overlap_vs_fsdp2": compare(a, b)}}
    print_table(result)
    out = " ".join(capsys.readouterr().out.split())
    assert "overlap vs fsdp2 (schedule check, not speed): no verdict" in out, out
    assert " ".join(CPU_NOTE.split()) in out and "saves" not in out, out
