"""The mixture-of-experts model of ``bench step --arch moe`` and its pricing in ``hsdp sim``:
expert-choice routing against a per-expert loop, the emulated token exchange under torch's
fake process group, the expert units' collectives on their own groups, and the refusals."""

import argparse
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

import hsdp
from hsdp_tools.bench.step_config import add_arguments, resolve
from hsdp_tools.bench.trainee import build
from hsdp_tools.models_moe import GroupedExperts, MoEConfig
from hsdp_tools.moe_exchange import EP_KEY
from hsdp_tools.moe_placement import build_bench_model, shard_divisors, unit_meshes
from hsdp_tools.sim.engine import Setup, record
from hsdp_tools.sim.ep_pricing import ep_pricer
from hsdp_tools.sim.fabric import Fabric, Link

CFG = MoEConfig(vocab=64, hidden=32, heads=4, kv_heads=2, ffn=16, layers=2, seq=16,
                experts=8, top_k=2, ep=1)


def test_expert_choice_routing_equals_a_per_expert_loop():
    torch.manual_seed(0)
    block = build_bench_model(CFG, None).blocks[0]
    y = torch.randn(2, CFG.seq, CFG.hidden)
    flat = y.reshape(-1, CFG.hidden)
    scores = torch.softmax(flat @ block.router.weight.t(), dim=-1)
    e = block.experts
    want = torch.zeros_like(flat)
    for i in range(CFG.experts):  # expert i takes its capacity of best-scoring tokens
        gate, tok = scores[:, i].topk(CFG.capacity(flat.shape[0]))
        x = flat[tok]
        out = (F.silu(x @ e.w1[i]) * (x @ e.w3[i])) @ e.w2[i]
        want.index_add_(0, tok, out * gate[:, None])
    torch.testing.assert_close(block._mlp(y), want.view_as(y), rtol=1e-5, atol=1e-6)


def test_exchange_under_the_fake_group_is_delayed_and_counted():
    """ep 2 on a fake 2x4 mesh: two all-to-alls per block forward and two backward, each
    of the routed tokens' buffer, delayed by its inner-link time over the 2 ep ranks."""
    cfg = dataclasses.replace(CFG, ep=2)
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        model = build_bench_model(cfg, hsdp.init_mesh(2, 4, "cpu"))
        slept, nbytes = [], {}
        fabric = Fabric(Link(100.0, 5.0), Link(10.0))
        model.exchange.delay = lambda n, ranks: slept.append(
            fabric.seconds("all_to_all", "inner", n, ranks))
        model.exchange.nbytes = nbytes
        tokens = torch.randint(0, cfg.vocab, (1, cfg.seq))
        model(tokens).float().sum().backward()
        assert model.blocks[0].experts.w1.to_local().shape[0] == cfg.experts // 2
        assert shard_divisors(model, 4).count(2) == 3 * cfg.layers  # experts: inner / ep
        mesh = hsdp.init_mesh(2, 4, "cpu")
        plain = build_bench_model(CFG, mesh)  # ep 1: the experts stay in their block's unit
        assert plain.exchange.group is None
        assert not any(isinstance(u, GroupedExperts) for u, _, _ in unit_meshes(plain, mesh))
    finally:
        dist.destroy_process_group()
    one = cfg.exchange_bytes(cfg.seq, 4)
    assert nbytes == {EP_KEY: 4 * cfg.layers * one}
    assert slept == [pytest.approx(fabric.seconds("all_to_all", "inner", one, 2))] * (
        4 * cfg.layers)


def test_sim_prices_expert_units_on_their_groups_and_the_exchange():
    """ep = inner: one rank per expert inner group, so the experts' units gather and
    scatter nothing and all-reduce their whole local experts over the outer group; the
    exchange adds four all-to-alls per block to compute."""
    cfg = dataclasses.replace(CFG, ep=4)
    rec = record(Setup(cfg, 2, 4, reduce_dtype="bf16"))
    assert len(rec.names) == Setup(cfg, 2, 4).units()  # with the expert units
    side = [op for op in rec.program.ops[rec.start:] if op.kind == "side" and op.payload]
    experts = [c for op in side if "GroupedExperts" in op.label for c in op.payload]
    local = 3 * (cfg.experts // 4) * cfg.hidden * cfg.ffn * 2  # bf16, every local expert
    assert experts == [("all_reduce", "outer", local, 2)] * cfg.layers
    dense = [c for op in side if "MoEBlock" in op.label for c in op.payload]
    assert {(k, a, g) for k, a, _, g in dense} == {("all_gather", "inner", 4),
                                                   ("reduce_scatter", "inner", 4),
                                                   ("all_reduce", "outer", 2)}
    link = Link(50.0, 1.0)
    priced = ep_pricer(lambda op: (0.0, 0.0), rec.program, cfg, 1, 2, link)
    added = sum(priced(op)[1] for op in rec.program.ops[rec.start:] if op.kind == "compute")
    one = Fabric(link, link).seconds("all_to_all", "inner", cfg.exchange_bytes(cfg.seq, 2), 4)
    assert added == pytest.approx(4 * cfg.layers * one)


def test_moe_options_are_checked():
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit, match="--ep 3 must divide the inner size 4"):
        resolve(p.parse_args(["--emulate", "--arch", "moe", "--ep", "3"]), False, None)
    with pytest.raises(SystemExit, match="apply to --arch moe only"):
        resolve(p.parse_args(["--emulate", "--ep", "2"]), False, None)
    cfg = resolve(p.parse_args(["--emulate", "--arch", "moe", "--ep", "4"]), False, None)
    assert (cfg.model.experts, cfg.model.ep) == (8, 4)


def test_hsdp_and_fsdp2_trainees_reduce_the_same_expert_bytes():
    """One emulated step of each on a fake 2x4 mesh, ep 2: the experts' gradients reach
    both libraries' reductions (FSDP2's only through DTensor.to_local: a plain view of the
    local tensor cuts them off), so both count the same bytes per collective (up to
    hsdp's alignment of each parameter in its flat buffer)."""
    cfg = dataclasses.replace(CFG, ep=2)
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        mesh = hsdp.init_mesh(2, 4, "cpu")
        mp = hsdp.MixedPrecision(torch.float32, torch.float32)
        batches = [torch.randint(0, cfg.vocab, (1, cfg.seq))]
        counted = []
        for name in ("overlap", "fsdp2"):
            t = build(name, cfg, mp, mesh, torch.device("cpu"), None, True)
            t.step(batches)
            counted.append(t.collective_bytes)
    finally:
        dist.destroy_process_group()
    assert counted[0] == pytest.approx(counted[1], rel=0.01)
    assert counted[0][EP_KEY] == 4 * cfg.layers * cfg.exchange_bytes(cfg.seq, 4)
