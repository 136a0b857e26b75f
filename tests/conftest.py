"""Shared fixtures. fake_world_8: an in-process fake world of 8 ranks (torch's fake process
group): collectives do nothing."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture
def fake_world_8():
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        yield 8
    finally:
        dist.destroy_process_group()
