"""Where the ranks run: the launcher's ranks per node and every rank's host, to give
``init_mesh`` its default sizes and to keep each inner group on one host."""

from __future__ import annotations

import os
import re
import socket
from collections import Counter

import torch.distributed as dist

Host = tuple[str, str]  # (identity, name shown in messages)


def host_id() -> Host:
    """This process's machine: the kernel's boot id (the same in every container on one
    host, unlike the hostname), shown as its hostname."""
    name = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip(), name
    except OSError:
        return name, name


def all_hosts(group: dist.ProcessGroup) -> list[Host]:
    """Every rank's ``host_id()``, in rank order (a collective on ``group``)."""
    hosts: list[Host | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host_id(), group=group)
    return hosts  # type: ignore[return-value]


def launcher_ranks_per_node() -> int | None:
    """Ranks per node as the launcher set them: torchrun's ``LOCAL_WORLD_SIZE``, else
    SLURM's ``SLURM_NTASKS_PER_NODE`` (``"4"`` or ``"4(x2)"``), else ``SLURM_NTASKS`` /
    ``SLURM_JOB_NUM_NODES``; None when neither says (or nodes differ)."""
    env = os.environ
    if env.get("LOCAL_WORLD_SIZE"):
        return int(env["LOCAL_WORLD_SIZE"])
    m = re.fullmatch(r"(\d+)(\(x\d+\))?", env.get("SLURM_NTASKS_PER_NODE", ""))
    if m:
        return int(m.group(1))
    tasks, nodes = env.get("SLURM_NTASKS"), env.get("SLURM_JOB_NUM_NODES")
    if tasks and nodes and int(tasks) % int(nodes) == 0:
        return int(tasks) // int(nodes)
    return None


def _per_host(hosts: list[Host]) -> int | None:
    """Ranks per host when every host runs the same number of consecutive ranks."""
    per = Counter(h[0] for h in hosts)
    n = per[hosts[0][0]]
    blocks = {tuple(h[0] for h in hosts[i:i + n]) for i in range(0, len(hosts), n)}
    if len(set(per.values())) == 1 and all(len(set(b)) == 1 for b in blocks):
        return n
    return None


def default_sizes(outer: int | None, inner: int | None, world: int,
                  hosts: list[Host]) -> tuple[int, int]:
    """``init_mesh``'s sizes: the given ones; a missing one from the other and the world;
    neither: outer = nodes, inner = ranks per node (from the launcher, else the hosts)."""
    if outer is None and inner is None:
        inner = launcher_ranks_per_node() or _per_host(hosts)
        if inner is None or world % inner:
            raise ValueError(
                f"init_mesh(): cannot tell the ranks per node (the launcher sets no "
                f"LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE and the {world} ranks are not "
                f"spread evenly and in order over {len(set(h[0] for h in hosts))} hosts); "
                f"give the sizes: init_mesh(outer=nodes, inner=ranks_per_node)")
    if inner is None and outer is not None and world % outer == 0:
        inner = world // outer
    if outer is None and inner is not None and world % inner == 0:
        outer = world // inner
    if outer is None or inner is None:
        raise ValueError(f"init_mesh: the world's {world} ranks cannot be split evenly as "
                         f"outer={outer} x inner={inner}; choose sizes whose product is "
                         f"{world}")
    return outer, inner


def check_inner_on_one_host(outer: int, inner: int, hosts: list[Host]) -> None:
    """Raise (the same error on every rank) when an inner group (ranks ``o * inner ..
    o * inner + inner - 1``) spans hosts: its collectives would cross the slow link."""
    for o in range(outer):
        group = hosts[o * inner:(o + 1) * inner]
        n_hosts = len({h[0] for h in group})
        if n_hosts == 1:
            continue
        per = _per_host(hosts)
        fix = (f"init_mesh(outer={len(hosts) // per}, inner={per}) (or init_mesh(), which "
               f"reads the launch)" if per else
               "place each node's ranks consecutively (torchrun does) and give "
               "inner = ranks per node")
        raise ValueError(
            f"init_mesh(outer={outer}, inner={inner}): inner group {o} (ranks "
            f"{o * inner}..{(o + 1) * inner - 1}) spans {n_hosts} hosts "
            f"({', '.join(sorted({h[1] for h in group}))}): its all-gathers and "
            f"reduce-scatters would cross the inter-node link on every unit. Use {fix}; pass "
            f"allow_inner_across_hosts=True if sharding across hosts is intended")
