"""Shared fixtures. fake_world_8: an in-process fake world of 8 ranks (torch's fake process
group): collectives do nothing. The longest files run first, so that the two workers of
scripts/test.sh (pytest-xdist, one file at a time each) end together."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

LONGEST_FIRST = ("test_torchtitan.py", "test_fault_tolerance.py", "test_parity.py",
                 "test_checkpoint_safety.py", "test_checkpoint.py", "test_drop_in.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable: a file's tests keep their order


@pytest.fixture
def fake_world_8():
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        yield 8
    finally:
        dist.destroy_process_group()
