"""Split a list of test cases into a default-tier part where every pair of settings meets at
least once (pairwise coverage) and the rest, which the full tier runs.

A case is a frozen dataclass; its settings are its fields. Pairwise coverage is the usual
way to keep combinatorial suites small: most interaction bugs need two settings together,
and every pair that occurs in the full list occurs in the chosen part.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

Pair = tuple[tuple[str, Any], tuple[str, Any]]


def _pairs(case: Any) -> set[Pair]:
    return set(itertools.combinations(sorted(dataclasses.asdict(case).items()), 2))


def pairwise_split(cases: Sequence[Any], keep: Iterable[Any] = ()) -> tuple[list, list]:
    """``(cover, rest)``: ``cover`` holds ``keep`` and, chosen greedily (most new pairs
    first, ties in list order), cases until every pair of settings found in ``cases``
    occurs in one of them; ``rest`` holds the other cases, in list order."""
    keep = list(keep)
    missing = set(keep) - set(cases)
    assert not missing, f"kept cases not in the list: {missing}"
    chosen = set(keep)
    seen = set().union(*(_pairs(c) for c in keep)) if keep else set()
    todo = set().union(*(_pairs(c) for c in cases)) - seen
    while todo:
        best = max((c for c in cases if c not in chosen),
                   key=lambda c: len(_pairs(c) & todo))
        chosen.add(best)
        todo -= _pairs(best)
    return [c for c in cases if c in chosen], [c for c in cases if c not in chosen]
