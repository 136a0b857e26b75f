"""init_mesh and the launch: default sizes from torchrun / SLURM / the ranks' hosts, and an
inner group that spans hosts refused (hosts faked per rank; 4 gloo ranks, one job)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from dist_utils import run_ranks

import hsdp
from hsdp.topology import hosts

LAUNCH_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS",
               "SLURM_JOB_NUM_NODES")


def _attempt(call: Callable[[], object]) -> object:
    try:
        mesh = call()
    except ValueError as e:
        return f"ValueError: {e}"
    return tuple(mesh.mesh.shape)


def launch_job(rank: int, world: int) -> dict[str, object]:
    """Each case: per-rank host names and launcher variables, then init_mesh."""
    for k in LAUNCH_VARS:
        os.environ.pop(k, None)
    out: dict[str, object] = {}

    def case(name: str, layout: str, env: dict[str, str], call: Callable[[], object]) -> None:
        host = f"node{layout[rank]}"
        hosts.host_id = lambda: (host, host)  # this rank's fake machine
        os.environ.update(env)
        out[name] = _attempt(call)
        for k in env:
            del os.environ[k]

    case("across", "AABB", {}, lambda: hsdp.init_mesh(1, 4, "cpu"))
    case("allowed", "AABB", {}, lambda: hsdp.init_mesh(1, 4, "cpu",
                                                       allow_inner_across_hosts=True))
    case("interleaved", "ABAB", {}, lambda: hsdp.init_mesh(2, 2, "cpu"))
    case("from_hosts", "AABB", {}, lambda: hsdp.init_mesh(device_type="cpu"))
    case("torchrun", "AAAA", {"LOCAL_WORLD_SIZE": "2"}, lambda: hsdp.init_mesh(device_type="cpu"))
    case("slurm", "AAAA", {"SLURM_NTASKS_PER_NODE": "1(x4)"},
         lambda: hsdp.init_mesh(device_type="cpu"))
    case("outer_only", "AABB", {}, lambda: hsdp.init_mesh(outer=2, device_type="cpu"))
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    per_rank = run_ranks(launch_job, 4)
    assert all(r == per_rank[0] for r in per_rank), per_rank  # every rank: same answer
    return per_rank[0]


def test_inner_group_across_hosts_is_refused_with_the_fix(results):
    msg = results["across"]
    assert msg.startswith("ValueError: init_mesh(outer=1, inner=4): inner group 0"), msg
    assert "nodeA, nodeB" in msg and "init_mesh(outer=2, inner=2)" in msg, msg
    assert "allow_inner_across_hosts=True" in msg, msg
    assert results["allowed"] == (1, 4), results
    assert "place each node's ranks consecutively" in results["interleaved"], results


def test_default_sizes_from_the_launch(results):
    assert results["from_hosts"] == (2, 2), results  # 2 hosts x 2 ranks
    assert results["torchrun"] == (2, 2), results  # LOCAL_WORLD_SIZE wins (one machine)
    assert results["slurm"] == (4, 1), results
    assert results["outer_only"] == (2, 2), results


@pytest.mark.parametrize("env, expected", [
    ({"LOCAL_WORLD_SIZE": "8", "SLURM_NTASKS_PER_NODE": "4"}, 8),
    ({"SLURM_NTASKS_PER_NODE": "4(x2)"}, 4),
    ({"SLURM_NTASKS_PER_NODE": "4,2(x3)"}, None),  # nodes differ: the hosts decide
    ({"SLURM_NTASKS": "16", "SLURM_JOB_NUM_NODES": "2"}, 8),
    ({}, None)])
def test_launcher_ranks_per_node(monkeypatch, env, expected):
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert hosts.launcher_ranks_per_node() == expected
