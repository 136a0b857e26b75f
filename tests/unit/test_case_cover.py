"""The default tier's case lists cover every pair of settings of the full lists."""

import itertools
from dataclasses import dataclass

from case_cover import _pairs, pairwise_split


@dataclass(frozen=True)
class _C:
    a: int
    b: str
    c: bool
    d: int = 0


def test_every_pair_is_covered_and_nothing_is_lost():
    cases = [_C(a, b, c) for a, b, c in itertools.product((1, 2, 4), "xy", (True, False))]
    cases.append(_C(2, "x", True, d=7))
    cover, rest = pairwise_split(cases, keep=[_C(4, "y", False)])
    assert sorted(cover + rest, key=str) == sorted(cases, key=str)  # a partition
    assert not set(cover) & set(rest)
    assert _C(4, "y", False) in cover and _C(2, "x", True, d=7) in cover
    assert set().union(*map(_pairs, cover)) == set().union(*map(_pairs, cases))
    assert len(cover) < len(cases)
