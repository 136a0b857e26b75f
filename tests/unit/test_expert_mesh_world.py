"""``hsdp.expert_mesh`` in a later world of the same process (torch's fake process group,
destroyed and made again, as ``hsdp sim`` does per simulated setup): the expert mesh is
made anew, with groups of the new world, not the cached one of the destroyed world."""

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import hsdp


def _expert_group_size() -> int:
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        mesh = hsdp.init_mesh(2, 4, "cpu")
        return hsdp.expert_mesh(mesh, 2)["ep"].get_group().size()
    finally:
        dist.destroy_process_group()


def test_expert_mesh_of_a_later_world_has_live_groups():
    assert _expert_group_size() == 2
    assert _expert_group_size() == 2  # raised "Could not resolve the process group"
