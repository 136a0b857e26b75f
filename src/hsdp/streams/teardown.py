"""Process group teardown waits for hsdp's asynchronous work.

``optimizer.step()`` leaves HFSDP's outer all-gather running (it overlaps until the next
forward), and a CPU stream may be inside a collective. Destroying a process group under a
running collective aborts the process, so hsdp wraps
``torch.distributed.destroy_process_group`` once it makes its first groups (``init_mesh``,
``fully_shard``; importing hsdp patches nothing): it first waits until every hsdp stream is idle
(at most as long as hsdp's collectives may wait for a peer) and, when the whole world is
destroyed, first runs what higher layers registered with ``before_destroy`` (finishing
asynchronous saves), clears a stream failure and, after the world is gone, drops hsdp's
groups of that world (a new world starts clean; the dead world's threads and sockets are
freed). The world is destroyed even when a ``before_destroy`` callback raises; then the
error propagates.
``hsdp.synchronize`` remains the explicit way to wait.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d

from hsdp.streams.stream_set import quiesce_all
from hsdp.topology import liveness
from hsdp.topology.communicators import forget_world, longest_timeout, on_first_use

# Process-wide: destroy_process_group is process-wide; these run before it.
_BEFORE: list[Callable[[], None]] = []


def before_destroy(fn: Callable[[], None]) -> None:
    """Run ``fn`` (a collective on every rank) before the world's process group goes."""
    _BEFORE.append(fn)


def _install() -> None:
    original = distributed_c10d.destroy_process_group
    if getattr(original, "_hsdp_waits", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
        try:
            if dist.is_initialized() and group is None:
                for fn in _BEFORE:
                    fn()
        finally:
            if dist.is_initialized():
                quiesce_all(longest_timeout().total_seconds(), clear_failures=group is None)
                if group is None:
                    liveness.stop()  # while the world's store still answers
            original(group)
            if group is None:
                forget_world()
                gc.collect()  # models dropped before (reference cycles) free their groups now

    destroy_process_group._hsdp_waits = True
    distributed_c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


on_first_use(_install)  # patched once hsdp makes groups, not at import
