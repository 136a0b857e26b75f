"""step_metrics and the interval-union helpers, on hand-computed interval sets."""

import pytest

from hsdp_tools.report.metrics import (
    Interval,
    intersect,
    kind,
    op_kind,
    step_metrics,
    subtract,
    total,
    union,
)


def iv(stream: str, label: str, lo: float, hi: float) -> Interval:
    return Interval(stream, label, lo, hi)


def test_union_merges_overlapping_nested_touching_and_drops_empty():
    spans = [(5, 7), (0, 2), (1, 3), (10, 20), (12, 15), (20, 21), (30, 30)]
    assert union(spans) == [(0, 3), (5, 7), (10, 21)]
    assert total(union(spans)) == 3 + 2 + 11
    assert union([]) == []


def test_intersect_and_subtract():
    a = [(0, 10), (20, 30)]
    b = [(5, 25), (28, 40)]
    assert intersect(a, b) == [(5, 10), (20, 25), (28, 30)]
    assert subtract(a, b) == [(0, 5), (25, 28)]
    assert subtract(b, a) == [(10, 20), (30, 40)]
    assert subtract(a, []) == a
    assert subtract([], a) == []
    assert intersect(a, []) == []
    # one b span covering several a spans, and b spans strictly inside one a span
    assert subtract([(0, 1), (2, 3)], [(-1, 5)]) == []
    assert subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]


def test_kinds_come_from_stream_compute_and_labels_otherwise():
    assert op_kind(iv("compute", "RS_looking_kernel", 0, 1)) == "compute"
    assert op_kind(iv("ag", "AG:blocks.0", 0, 1)) == "inner_ag"
    assert op_kind(iv("rs", "RS:blocks.0", 0, 1)) == "inner_rs"
    assert op_kind(iv("rs", "OUTER_AR:blocks.0", 0, 1)) == "outer"  # serialized baseline
    assert op_kind(iv("outer", "OUTER_AG:x", 0, 1)) == "outer"
    assert op_kind(iv("ag", "FREE:blocks.0", 0, 1)) == "other"
    assert kind(iv("ag", "AG", 0, 1)) == kind(iv("rs", "RS", 0, 1)) == "inner"


def test_overlapping_step():
    ivs = [
        iv("compute", "fwd", 0, 100), iv("compute", "bwd", 150, 300),
        iv("ag", "AG0", 0, 50),
        iv("rs", "RS1", 120, 200), iv("rs", "RS2", 250, 320),
        iv("outer", "OUTER_AR1", 180, 260), iv("outer", "OUTER_AR2", 320, 400),
    ]
    m = step_metrics(ivs)
    assert m["window_us"] == [0, 400]
    assert m["span_ms"] == pytest.approx(0.4)
    assert m["busy_ms"]["by_stream"] == pytest.approx(
        {"compute": 0.25, "ag": 0.05, "rs": 0.15, "outer": 0.16})
    assert m["busy_ms"]["by_kind"] == pytest.approx(
        {"compute": 0.25, "inner": 0.2, "outer": 0.16, "inner_ag": 0.05, "inner_rs": 0.15})
    # comm = [0,50] + [120,400] (RS2 ends where OUTER_AR2 starts)
    assert m["comm_busy_ms"] == pytest.approx(0.33)
    # inner & outer: [180,200] + [250,260]
    assert m["comm_comm_overlap_ms"] == pytest.approx(0.03)
    # comm outside compute: [120,150] + [300,400]
    assert m["exposed_comm_ms"] == pytest.approx(0.13)
    # last outer ends 400, compute ends 300
    assert m["outer_tail_ms"] == pytest.approx(0.1)
    # compute 0.25 + the last outer reduction (OUTER_AR2, 0.08) > inner 0.2 > outer 0.16
    assert m["tail_floor_ms"] == pytest.approx(0.08)
    assert m["lower_bound_ms"] == pytest.approx(0.33)


def test_nested_intervals_count_once():
    ivs = [
        iv("compute", "outer_kernel", 0, 100), iv("compute", "inner_kernel", 10, 20),
        iv("rs", "RS", 20, 80), iv("outer", "OUTER_RS", 30, 40),
    ]
    m = step_metrics(ivs)
    assert m["busy_ms"]["by_kind"]["compute"] == pytest.approx(0.1)
    assert m["busy_ms"]["by_kind"]["inner"] == pytest.approx(0.06)
    assert m["comm_comm_overlap_ms"] == pytest.approx(0.01)
    assert m["exposed_comm_ms"] == 0
    assert m["outer_tail_ms"] == 0  # compute outlasts the outer collective
    # OUTER_RS lies inside compute: their union, 0.1 (compute + OUTER_RS, 0.11, would be
    # more than the whole 0.1 ms window)
    assert m["lower_bound_ms"] == pytest.approx(0.1) == pytest.approx(m["span_ms"])


def test_disjoint_serialized_step():
    ivs = [iv("compute", "bwd", 0, 10), iv("rs", "RS", 10, 20), iv("rs", "OUTER_AR", 20, 30)]
    m = step_metrics(ivs)
    assert m["busy_ms"]["by_stream"] == pytest.approx({"compute": 0.01, "rs": 0.02})
    assert m["busy_ms"]["by_kind"]["outer"] == pytest.approx(0.01)
    assert m["comm_comm_overlap_ms"] == 0
    assert m["exposed_comm_ms"] == pytest.approx(0.02)
    assert m["outer_tail_ms"] == pytest.approx(0.02)
    assert m["lower_bound_ms"] == pytest.approx(0.02)  # compute 0.01 + OUTER_AR 0.01


def test_compute_starting_after_last_outer_does_not_count_for_tail():
    ivs = [iv("compute", "bwd", 0, 10), iv("outer", "OUTER_AR", 5, 30),
           iv("compute", "optimizer", 30, 40)]
    assert step_metrics(ivs)["outer_tail_ms"] == pytest.approx(0.02)


def test_outer_without_compute_tail_runs_from_window_start():
    m = step_metrics([iv("outer", "OUTER_AR", 10, 30)], window=(0, 50))
    assert m["outer_tail_ms"] == pytest.approx(0.03)
    assert m["exposed_comm_ms"] == pytest.approx(0.02)


def test_other_labels_are_busy_per_stream_but_in_no_kind():
    m = step_metrics([iv("ag", "FREE:x", 0, 10), iv("ag", "drain", 5, 20)])
    assert m["busy_ms"]["by_stream"] == {"ag": pytest.approx(0.02)}
    assert m["comm_busy_ms"] == 0
    assert m["exposed_comm_ms"] == 0


def test_window_clips_intervals():
    ivs = [iv("compute", "a", 0, 100), iv("compute", "b", 150, 300),
           iv("rs", "RS1", 120, 200), iv("outer", "OUTER_AR1", 180, 260),
           iv("outer", "OUTER_AR2", 320, 400)]
    m = step_metrics(ivs, window=(100, 300))
    assert m["span_ms"] == pytest.approx(0.2)
    assert m["busy_ms"]["by_kind"]["compute"] == pytest.approx(0.15)
    assert m["busy_ms"]["by_kind"]["inner"] == pytest.approx(0.08)
    assert m["busy_ms"]["by_kind"]["outer"] == pytest.approx(0.08)
    assert "outer" in m["busy_ms"]["by_stream"]
    assert m["exposed_comm_ms"] == pytest.approx(0.03)  # [120,150]
    assert m["outer_tail_ms"] == 0  # last outer in the window ends at 260, compute at 300


def test_empty():
    m = step_metrics([])
    assert m["window_us"] == [0, 0]
    assert m["busy_ms"]["by_stream"] == {}
    assert set(m["busy_ms"]["by_kind"]) == {"compute", "inner", "outer", "inner_ag", "inner_rs"}
    for key in ("span_ms", "comm_busy_ms", "comm_comm_overlap_ms", "exposed_comm_ms",
                "outer_tail_ms", "lower_bound_ms"):
        assert m[key] == 0


def test_outer_tail_ignores_hfsdp_parameter_all_gather():
    ivs = [iv("compute", "k", 0, 100), iv("outer", "OUTER_RS:u", 90, 130),
           iv("outer", "OUTER_AG:u", 200, 260)]
    assert step_metrics(ivs)["outer_tail_ms"] == pytest.approx(0.03)


def test_lower_bound_never_exceeds_the_step_it_comes_from():
    """A recorded last outer reduction that overlaps compute (its stream interval includes
    waiting, or CPU threads share cores) is counted once: the bound stays within the
    step's span (it was compute 0.1 + OUTER_AR 0.05 = 0.15 over a 0.12 ms step)."""
    ivs = [iv("compute", "bwd", 0, 100), iv("rs", "RS", 40, 60),
           iv("outer", "OUTER_AR", 70, 120)]
    m = step_metrics(ivs)
    assert m["span_ms"] == pytest.approx(0.12)
    assert m["tail_floor_ms"] == pytest.approx(0.05)
    assert m["lower_bound_ms"] == pytest.approx(0.12)
