"""plot_timeline writes a PNG."""

import pytest

from hsdp_tools.report.metrics import Interval
from hsdp_tools.report.timeline import plot_timeline

pytest.importorskip("matplotlib")


def test_plot_timeline_writes_png(tmp_path):
    serial = [Interval("compute", "bwd", 0, 100), Interval("rs", "RS:a", 100, 150),
              Interval("rs", "OUTER_AR:a", 150, 300)]
    overlapped = [Interval("compute", "bwd", 0, 100), Interval("rs", "RS:a", 100, 150),
                  Interval("outer", "OUTER_AR:a", 150, 300), Interval("ag", "AG:b", 20, 60),
                  Interval("ag", "FREE:b", 60, 61), Interval("extra", "RS:z", 5, 6)]
    path = plot_timeline({"serialized": serial, "overlapped": overlapped, "empty": []},
                         tmp_path / "timeline.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 1000


def test_plot_timeline_needs_a_schedule(tmp_path):
    with pytest.raises(ValueError):
        plot_timeline({}, tmp_path / "x.png")
