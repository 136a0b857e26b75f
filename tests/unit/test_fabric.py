"""Alpha-beta fabric model."""

import pytest

from hsdp_tools.sim.fabric import Fabric, Link, fit_link


def test_ring_formulas():
    f = Fabric(Link(100.0, 10.0), Link(10.0, 0.0))
    gb = 10**9
    assert f.seconds("all_gather", "inner", gb, 4) == pytest.approx(10e-6 + 0.75 / 100)
    assert f.seconds("reduce_scatter", "outer", gb, 2) == pytest.approx(0.5 / 10)
    assert f.seconds("all_reduce", "outer", gb, 2) == pytest.approx(1.0 / 10)
    assert f.seconds("all_reduce", "outer", gb, 1) == 0.0


def test_rejects_unknown_and_invalid():
    with pytest.raises(ValueError):
        Fabric().seconds("broadcast", "inner", 1, 2)
    with pytest.raises(ValueError):
        Link(0.0)


def test_fit_link_falls_back_to_the_largest_size():
    one = fit_link("all_gather", 2, [(1 << 30, 2e-3)], latency_us=20.0)  # one size
    assert one.latency_us == 20.0
    assert Fabric(one, one).seconds("all_gather", "inner", 1 << 30, 2) == pytest.approx(2e-3)
    # smaller buffers slower than larger ones: no positive bandwidth to fit
    odd = fit_link("reduce_scatter", 4, [(1 << 20, 9e-3), (64 << 20, 0.5e-3)], 20.0)
    assert Fabric(odd, odd).seconds("reduce_scatter", "inner", 64 << 20, 4) == pytest.approx(
        0.5e-3)
    with pytest.raises(ValueError, match="not more than the latency"):
        fit_link("all_reduce", 2, [(1 << 20, 1e-6)], latency_us=20.0)
