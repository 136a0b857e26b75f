"""Importing hsdp changes nothing global: torch's ``destroy_process_group`` is wrapped once
hsdp makes its first groups, DCP's load planner is extended once hsdp is first asked for
its entries of a state dict, and optimizers get hsdp's step hooks one by one, when they
are found to hold fully_shard-ed parameters."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.optim.optimizer as optim_mod
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    import torch.distributed._state_dict_utils as sd_utils
    import torch.distributed.checkpoint.state_dict as torch_sd

    original = dist.destroy_process_group
    planner = DefaultLoadPlanner.set_up_planner
    import hsdp

    def patched():
        return [f for f in (sd_utils._distribute_tensors, torch_sd._get_optim_state_dict)
                if getattr(f, "_hsdp", False)]

    assert not patched(), "import wrapped torch's state-dict functions"

    assert dist.destroy_process_group is original, "import patched destroy_process_group"
    assert DefaultLoadPlanner.set_up_planner is planner, "import patched DCP's load planner"
    assert not optim_mod._global_optimizer_pre_hooks, "import installed optimizer hooks"
    assert not optim_mod._global_optimizer_post_hooks, "import installed optimizer hooks"

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    mesh = hsdp.init_mesh(2, 2, "cpu")
    assert getattr(dist.destroy_process_group, "_hsdp_waits", False), "not wrapped"

    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    hsdp.fully_shard(net, mesh=mesh)
    assert len(patched()) == 2, "fully_shard did not wrap torch's state-dict functions"
    plain = nn.Linear(4, 4)
    opt, other = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(
        plain.parameters(), lr=0.1)
    for _ in range(2):
        net(torch.randn(2, 4)).sum().backward()
        plain(torch.randn(2, 4)).sum().backward()
        opt.step()
        other.step()
    assert len(opt._optimizer_step_pre_hooks) == len(opt._optimizer_step_post_hooks) == 1
    assert not other._optimizer_step_pre_hooks and not other._optimizer_step_post_hooks
    assert len(optim_mod._global_optimizer_pre_hooks) == 1  # the detector only
    assert not optim_mod._global_optimizer_post_hooks
    assert DefaultLoadPlanner.set_up_planner is planner, "patched before a state dict"
    hsdp.get_state_dict(net, opt)  # hsdp's entries may now meet a checkpoint without them
    assert getattr(DefaultLoadPlanner.set_up_planner, "_hsdp", False), "planner not extended"
    dist.destroy_process_group()
    print("ok")
""")


def test_import_installs_nothing_and_optimizers_are_hooked_one_by_one():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
