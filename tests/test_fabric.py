"""Alpha-beta fabric model."""

import pytest

from hsdp.fabric import Fabric, Link


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
