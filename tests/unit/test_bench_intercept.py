"""hsdp_tools.bench.intercept on torch's fake process group (one process, CPU): which calls get
the emulated delay and a trace record, coalesced ones included, and that everything is
restored afterwards."""

import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _coalescing_manager

from hsdp.streams.contract import Tracer
from hsdp_tools.bench.intercept import intercept
from hsdp_tools.sim.fabric import Fabric, Link

# torch 2.13 deprecates the names Megatron-FSDP calls; they are what is intercepted here
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture
def groups():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        yield dist.new_group([0, 1, 2, 3]), dist.new_group([0, 4]), dist.new_group([0, 1])
    finally:
        dist.destroy_process_group()


def test_delays_and_records_only_the_peer_groups(groups):
    inner, outer, other = groups
    fabric = Fabric(Link(100.0, 10.0), Link(10.0, 30.0))
    slept: list[float] = []
    tracer = Tracer(enabled=True)
    # a stand-in for a module that imported the coalescing manager by name (Megatron-FSDP)
    peer = types.SimpleNamespace(_coalescing_manager=_coalescing_manager)
    originals = {n: getattr(dist, n) for n in ("all_reduce", "all_gather_into_tensor",
                                               "reduce_scatter_tensor")}
    full, shard = torch.zeros(64), torch.zeros(16)
    with intercept({id(inner): "inner", id(outer): "outer"}, tracer, fabric, slept.append,
                   (peer,)):
        dist.all_reduce(shard, group=outer)
        dist.reduce_scatter_tensor(shard, full, group=inner)
        dist.all_reduce(shard, group=other)  # not a peer group: untouched
        with peer._coalescing_manager(inner, async_ops=True) as cm:
            dist.all_gather_into_tensor(full, shard, group=inner, async_op=True)
            dist.all_gather_into_tensor(full, shard, group=inner, async_op=True)
        cm.wait()
        assert dist.all_reduce is not originals["all_reduce"]
    assert {n: getattr(dist, n) for n in originals} == originals
    assert peer._coalescing_manager is _coalescing_manager
    assert slept == pytest.approx([fabric.seconds("all_reduce", "outer", 64, 2),
                                   fabric.seconds("reduce_scatter", "inner", 256, 4),
                                   fabric.seconds("all_gather", "inner", 256, 4),
                                   fabric.seconds("all_gather", "inner", 256, 4)])
    recs = tracer.take()
    # blocking calls: one op record on the stream and one compute wait each; the coalesced
    # (async) ones return before the collective ends and leave no CPU record
    assert [(r.stream, r.label) for r in recs] == [
        ("outer", "OUTER_AR"), ("compute", "wait:OUTER_AR"), ("rs", "RS"),
        ("compute", "wait:RS")]


def test_no_fabric_no_delay(groups):
    inner, _, _ = groups
    slept: list[float] = []
    with intercept({id(inner): "inner"}, Tracer(), None, slept.append):
        dist.all_reduce(torch.zeros(4), group=inner)
    assert slept == []


def test_emulated_all_gathers_move_no_data(groups):
    """torch's fake process group copies an all-gather's input into every chunk of its
    output (GPU time and copy launches that no real all-gather adds to the modelled time):
    under emulation the peers' all-gathers, plain and coalesced, and hsdp's own reach it
    with empty views, so the output is left as it was; the delay stays the full one."""
    from hsdp_tools.bench.emulate import DelayedCollectives

    inner, outer, _ = groups
    full, shard = torch.zeros(64), torch.ones(16)
    dist.all_gather_into_tensor(full, shard, group=inner)  # not intercepted: copies
    assert full.sum() == 64
    fabric = Fabric(Link(100.0, 10.0), Link(10.0, 30.0))
    slept: list[float] = []
    peer = types.SimpleNamespace(_coalescing_manager=_coalescing_manager)
    full.zero_()
    with intercept({id(inner): "inner", id(outer): "outer"}, Tracer(), fabric, slept.append,
                   (peer,)):
        dist.all_gather_into_tensor(full, shard, group=inner)
        with peer._coalescing_manager(inner, async_ops=True) as cm:
            dist.all_gather_into_tensor(full, shard, group=inner, async_op=True)
        cm.wait()
    DelayedCollectives(fabric, slept.append).all_gather(full, shard, inner, "inner")
    assert full.sum() == 0
    assert slept == pytest.approx([fabric.seconds("all_gather", "inner", 256, 4)] * 3)
