"""The peers' collectives, observed and emulated: wrappers around ``torch.distributed``.

torch FSDP2 and Megatron-FSDP issue their collectives through ``torch.distributed`` module
attributes looked up at call time (``dist.all_gather_single``, ``dist.reduce_scatter_tensor``,
``dist.all_reduce``, ...), each inside the CUDA stream context the peer chose for it.
``intercept`` swaps those attributes for wrappers that, for calls on a group of ``axes``
(``id(group) -> "inner" | "outer"``):

- under emulation, first delay the current stream (CUDA) or thread (CPU) by
  ``Fabric.seconds`` of that collective, exactly as ``hsdp_tools.bench.emulate``'s
  ``DelayedCollectives`` do;
- while ``tracer.enabled``, mark the call as an hsdp op so that ``hsdp_tools.bench.trace`` reads it
  like hsdp's own: ``record_function("hsdp:<stream>:<label>")`` on CUDA, and on CPU an
  ``OpRecord`` on the stream plus a compute ``wait:`` record (the peers' collectives block
  the calling thread on CPU: there are no streams there).

Work handles. Under torch's fake process group an async collective's handle completes at
once, so a peer that orders compute after a collective through ``work.wait()`` (rather
than through stream events) would never wait for the emulated delay. Under emulation on
CUDA the wrappers therefore return, for ``async_op=True``, a handle whose ``wait()`` also
makes the waiting stream wait for an event recorded after the delay: what ``wait()`` on a
real NCCL handle does.

Coalesced collectives. Inside ``torch.distributed._coalescing_manager`` a collective is only
recorded; the manager issues them all as one call when its block exits and hands out its
own handle. For each module in ``coalescing`` that imported the manager by name
(Megatron-FSDP), ``intercept`` replaces that name with a wrapper that annotates the exit
(where real NCCL launches) and, under emulation, adds the delay-waiting handle.

Streams and labels follow hsdp's names: inner all-gather "AG" on "ag", inner
reduce-scatter "RS" on "rs", outer collectives "OUTER_AR" / "OUTER_RS" / "OUTER_AG" on
"outer". Calls on any other group pass through untouched, hsdp's own included: its runtime
uses its own communicators, never a peer's groups.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import ModuleType

import torch
import torch.distributed as dist

from hsdp.sharding.comm import BackendNames, fake_all_gather_args
from hsdp.streams.contract import OpRecord, Tracer
from hsdp_tools.sim.fabric import Fabric

# torch.distributed name -> (collective kind for Fabric, argument holding the full buffer)
WRAPPED = {
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
}
SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}


class DelayedWork:
    """A work handle whose ``wait()`` first makes the current CUDA stream wait for
    ``event`` (recorded after an emulated delay), then waits ``work`` (if any)."""

    def __init__(self, work, event: torch.cuda.Event) -> None:
        self._work = work
        self._event = event

    def wait(self, *args, **kwargs) -> bool:
        torch.cuda.current_stream().wait_event(self._event)
        return True if self._work is None else self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._event.query() and (self._work is None or self._work.is_completed())

    def __getattr__(self, name: str):
        return getattr(self._work, name)


@contextmanager
def intercept(axes: dict[int, str], tracer: Tracer, fabric: Fabric | None = None,
              sleep: Callable[[float], None] = time.sleep,
              coalescing: Sequence[ModuleType] = (),
              nbytes: dict[str, int] | None = None) -> Iterator[None]:
    """Within the block, collectives on the groups of ``axes`` are delayed by ``fabric`` (if
    given, using ``sleep``: a ``hsdp_tools.bench.emulate.SleepClock`` on CUDA) and traced into
    ``tracer``, and their bytes added to ``nbytes["<kind>:<axis>"]`` (if given); the
    original functions are restored on exit."""
    state = _State(axes, tracer, fabric, sleep, nbytes)
    originals = {name: getattr(dist, name) for name in WRAPPED if hasattr(dist, name)}
    managers = [(m, m._coalescing_manager) for m in coalescing]
    try:
        for name, fn in originals.items():
            kind, sized = WRAPPED[name]
            setattr(dist, name, _wrap(fn, kind, sized, state))
        for module, manager in managers:
            module._coalescing_manager = _wrap_manager(manager, state)
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        for module, manager in managers:
            module._coalescing_manager = manager


class _State:
    """What the wrappers share: the axes, the tracer, the delay model and, per group under
    an open coalescing manager, the ops recorded there so far (stream, label, delayed)."""

    def __init__(self, axes: dict[int, str], tracer: Tracer, fabric: Fabric | None,
                 sleep: Callable[[float], None], nbytes: dict[str, int] | None = None) -> None:
        self.axes = axes
        self.nbytes = nbytes
        self.tracer = tracer
        self.fabric = fabric
        self.sleep = sleep
        self.coalescing: dict[int, list[tuple[str, str]]] = {}
        self.backend = BackendNames()


def op_names(kind: str, axis: str) -> tuple[str, str]:
    """(stream, label) of a collective in hsdp's terms."""
    label = ("OUTER_" if axis == "outer" else "") + SHORT[kind]
    return ("outer" if axis == "outer" else SHORT[kind].lower()), label


def _wrap(fn: Callable, kind: str, sized: str, state: _State) -> Callable:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        axis = state.axes.get(id(group)) if group is not None else None
        if axis is None:
            return fn(*args, **kwargs)
        stream, label = op_names(kind, axis)
        buf = bound.arguments[sized]
        if kind == "all_gather" and state.backend(group, buf) == "fake":  # as Collectives
            out, inp = fake_all_gather_args(buf, bound.arguments["input_tensor"])
            bound.arguments["output_tensor"], bound.arguments["input_tensor"] = out, inp
            args, kwargs = bound.args, bound.kwargs
        async_op = bool(bound.arguments.get("async_op"))
        pending = state.coalescing.get(id(group))
        if pending is not None:  # recorded now, issued when the manager exits
            pending.append((stream, label))
        size = buf.numel() * buf.element_size()
        if state.nbytes is not None:
            key = f"{kind}:{axis}"
            state.nbytes[key] = state.nbytes.get(key, 0) + size
        with _traced(state.tracer, stream, label, buf.is_cuda, async_op or pending is not None):
            if state.fabric is not None:
                state.sleep(state.fabric.seconds(kind, axis, size, group.size()))
            work = fn(*args, **kwargs)
            if async_op and pending is None and state.fabric is not None and buf.is_cuda:
                return DelayedWork(work, _record())
            return work

    return wrapper


def _wrap_manager(manager: Callable, state: _State) -> Callable:
    @contextmanager
    def wrapper(group=None, device=None, async_ops: bool = False):
        key = id(group if group is not None else dist.group.WORLD)
        if state.axes.get(key) is None:
            with manager(group, device, async_ops) as cm:
                yield cm
            return
        inner = manager(group, device, async_ops)
        cm = inner.__enter__()
        state.coalescing[key] = pending = []
        try:
            yield cm
        except BaseException:
            del state.coalescing[key]
            if not inner.__exit__(*sys.exc_info()):
                raise
            return
        del state.coalescing[key]
        if not pending:
            inner.__exit__(None, None, None)
            return
        stream, label = pending[0]
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        with _traced(state.tracer, stream, label, cuda, True):  # the exit launches them
            inner.__exit__(None, None, None)
        if async_ops and state.fabric is not None and cuda:
            cm.append(DelayedWork(None, _record()))

    return wrapper


def _record() -> torch.cuda.Event:
    """An event on the current stream: it completes once the delay just enqueued has."""
    event = torch.cuda.Event()
    event.record()
    return event


def _traced(tracer: Tracer, stream: str, label: str, cuda: bool,
            async_op: bool) -> AbstractContextManager:
    if not tracer.enabled:
        return nullcontext()
    if cuda:
        return torch.profiler.record_function(f"hsdp:{stream}:{label}")
    if async_op:  # the call returns before the collective ends: its span says nothing
        return nullcontext()
    return _cpu_record(tracer, stream, label)


@contextmanager
def _cpu_record(tracer: Tracer, stream: str, label: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    t1 = time.perf_counter()
    tracer.add(OpRecord(stream, label, t0, t1))
    tracer.add(OpRecord("compute", f"wait:{label}", t0, t1))
