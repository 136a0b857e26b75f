"""The default tier's case lists cover every pair (or every value) of settings of the full
lists."""

import itertools
from dataclasses import dataclass

import pytest
from case_cover import _combinations, cover_split


@dataclass(frozen=True)
class _C:
    a: int
    b: str
    c: bool
    d: int = 0


@pytest.mark.parametrize("strength", [1, 2])
def test_every_combination_is_covered_and_nothing_is_lost(strength: int) -> None:
    cases = [_C(a, b, c) for a, b, c in itertools.product((1, 2, 4), "xy", (True, False))]
    cases.append(_C(2, "x", True, d=7))
    cover, rest = cover_split(cases, keep=[_C(4, "y", False)], strength=strength)
    assert sorted(cover + rest, key=str) == sorted(cases, key=str)  # a partition
    assert not set(cover) & set(rest)
    assert _C(4, "y", False) in cover and _C(2, "x", True, d=7) in cover
    assert (set().union(*(_combinations(c, strength) for c in cover))
            == set().union(*(_combinations(c, strength) for c in cases)))
    assert len(cover) < len(cases)
    if strength == 1:  # every value once: 3 values of a, so 3 cases (d=7 among them)
        assert len(cover) == 3, cover
