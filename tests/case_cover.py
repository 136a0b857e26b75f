"""Split a list of test cases into a default-tier part that covers the list's settings and
the rest, which the full tier runs.

A case is a frozen dataclass; its settings are its fields. ``strength`` 2 (pairwise
coverage): every pair of settings found in the list meets in one chosen case, the usual
way to keep combinatorial suites small (most interaction bugs need two settings
together). ``strength`` 1: every setting's every value occurs in one chosen case (every
feature once), for worlds whose cases each cost seconds (TP, float8).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

Combination = tuple[tuple[str, Any], ...]


def _combinations(case: Any, strength: int) -> set[Combination]:
    return set(itertools.combinations(sorted(dataclasses.asdict(case).items()), strength))


def cover_split(cases: Sequence[Any], keep: Iterable[Any] = (), strength: int = 2
                ) -> tuple[list, list]:
    """``(cover, rest)``: ``cover`` holds ``keep`` and, chosen greedily (most new
    combinations first, ties in list order), cases until every combination of
    ``strength`` settings found in ``cases`` occurs in one of them; ``rest`` holds the
    other cases, in list order."""
    keep = list(keep)
    missing = set(keep) - set(cases)
    assert not missing, f"kept cases not in the list: {missing}"
    chosen = set(keep)
    seen = set().union(*(_combinations(c, strength) for c in keep)) if keep else set()
    todo = set().union(*(_combinations(c, strength) for c in cases)) - seen
    while todo:
        best = max((c for c in cases if c not in chosen),
                   key=lambda c: len(_combinations(c, strength) & todo))
        chosen.add(best)
        todo -= _combinations(best, strength)
    return [c for c in cases if c in chosen], [c for c in cases if c not in chosen]
