"""Simulate one training step of hsdp's schedule (overlap vs serial) without GPUs.

A discrete-event simulation of the four streams of ``schedule.md`` (compute, ag, rs,
outer). Each stream is a FIFO: an op starts once the previous op on its stream has
finished and every event it waits on has completed. Ops are issued in exactly the
order ``schedule.py`` issues them in the steady state (from the second step on: the
root and the last unit of the forward stay gathered for the backward). Collective times
come from ``hsdp.fabric.Fabric`` with the sizes ``group.py`` passes to it; a step starts
with every stream idle and ends when every stream is idle, as ``bench step`` times it.

Modelled as in the runtime:

- the zero-length FREE of a gathered buffer on ag, after the compute that read it: later
  all-gathers queue behind it, which bounds the prefetch to one unit ahead;
- after a unit's backward: copy-in and RS, then its FREE, then compute waits the
  previous unit's RS (release of its input); compute waits every RS and outer reduction
  at the end of the backward (finalize);
- the outer reduction on the last microbatch only, on the outer stream (on rs when
  ``overlap_outer=False``); hfsdp's outer all-gathers after the optimizer;
- a step's all-gathers wait the compute issued before its first forward (the optimizer);
  those of later microbatches do not (the shards have not changed).

Simplifications (documented, deliberate):

- the host is never the bottleneck: it is always ahead, so an op starts as soon as its
  stream and events allow (the backward's first prefetch may run during the forward),
  and launch overheads are not modelled: host-bound runs (small kernels, e.g. short
  sequences) take longer than predicted;
- the root's forward compute runs after the other units' (a GPT's head; the embedding
  lookup before the blocks is free) and its backward compute before theirs; its
  reduction comes last (its embedding gradient arrives last), as in the runtime;
- the copy-in takes 0 ms unless ``copy_in_gbps`` is set: then it moves
  ``N * (param_bytes + 3 * reduce_bytes)`` bytes (read the gradients, write the RS
  input, divide it in place) at that memory bandwidth;
- the optimizer takes ``optimizer_ms`` (default 0; see ``gpt_units`` on calibration);
- padding is the layout's for one parameter of ``params`` elements (per-parameter
  alignment, under 16 elements each, is left out); the accumulation add on rs after
  the first microbatch and the FREE_GRAD ops at the start of a step (idle streams)
  take no time.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hsdp.bench.step import MODEL_DEFAULTS
from hsdp.fabric import Fabric, Link
from hsdp.layout import FlatLayout
from hsdp.models import GPTConfig, config_from_dict
from hsdp.policy import STRATEGIES, check_strategy
from hsdp.report.args import parse_mesh
from hsdp.report.metrics import Interval, step_metrics
from hsdp.report.table import print_table as print_rows
from hsdp.streams import STREAM_NAMES

# (overlapped, serialized) schedule names per strategy, as in ``bench step``
SCHEDULE_NAMES = {"hsdp": ("overlap", "serial"), "hfsdp": ("hfsdp", "hfsdp-serial")}
# per-schedule numbers of the report, with ``bench step``'s keys
METRIC_KEYS = ("t_step_ms", "exposed_comm_ms", "outer_tail_ms", "comm_comm_overlap_ms",
               "lower_bound_ms")


@dataclass(frozen=True)
class UnitSpec:
    """One ``fully_shard`` unit: the parameters it owns and its compute per microbatch."""

    name: str
    params: int
    fwd_ms: float
    bwd_ms: float


@dataclass(frozen=True)
class SimConfig:
    """One step of one schedule. ``units``: the root first, then the others in forward
    order."""

    units: tuple[UnitSpec, ...]
    outer: int
    inner: int
    strategy: str = "hsdp"
    overlap_outer: bool = True
    microbatches: int = 1
    param_bytes: int = 2
    reduce_bytes: int = 4
    optimizer_ms: float = 0.0
    copy_in_gbps: float | None = None
    fabric: Fabric = field(default_factory=Fabric)

    def __post_init__(self) -> None:
        check_strategy(self.strategy)
        if not self.units or self.outer < 1 or self.inner < 1 or self.microbatches < 1:
            raise ValueError("sim: need at least one unit, outer, inner, microbatches >= 1")
        if len({u.name for u in self.units}) != len(self.units):
            raise ValueError("sim: unit names must be distinct")


@dataclass(frozen=True)
class SimResult:
    """Ops as intervals (us, the runtime's labels): every op of the side streams, FREE
    included (zero-length), and the compute ops that take time; ``step_metrics`` of them
    and the step time."""

    intervals: list[Interval]
    metrics: dict
    t_step_ms: float


@dataclass(frozen=True)
class _Costs:
    """Durations (us) of one unit's ops."""

    ag: float
    rs: float
    outer: float
    outer_ag: float
    copy_in: float


def _costs(cfg: SimConfig, unit: UnitSpec) -> _Costs:
    hfsdp = cfg.strategy == "hfsdp"
    lay = FlatLayout.build([(unit.params,)], cfg.inner, cfg.outer, hfsdp)
    n, s = lay.total, lay.shard_numel
    pb, rb = cfg.param_bytes, cfg.reduce_bytes

    def us(kind: str, axis: str, nbytes: int) -> float:
        return cfg.fabric.seconds(kind, axis, nbytes, cfg.inner if axis == "inner"
                                  else cfg.outer) * 1e6

    copy_in = n * (pb + 3 * rb) / (cfg.copy_in_gbps * 1e3) if cfg.copy_in_gbps else 0.0
    return _Costs(ag=us("all_gather", "inner", n * pb),
                  rs=us("reduce_scatter", "inner", n * rb),
                  outer=us("reduce_scatter" if hfsdp else "all_reduce", "outer", s * rb),
                  outer_ag=us("all_gather", "outer", s * pb) if hfsdp else 0.0,
                  copy_in=copy_in)


class _Streams:
    """FIFO streams; an event is the time (us) its op ends."""

    def __init__(self) -> None:
        self.free = dict.fromkeys(STREAM_NAMES, 0.0)
        self.intervals: list[Interval] = []

    def submit(self, stream: str, label: str, us: float, after: tuple[float, ...] = ()) -> float:
        start = max((self.free[stream], *after))
        self.free[stream] = end = start + us
        if us > 0 or stream != "compute":
            self.intervals.append(Interval(stream, label, start, end))
        return end

    def record(self) -> float:
        """Event at the end of the compute issued so far."""
        return self.free["compute"]

    def wait(self, event: float) -> None:
        """Later compute starts after ``event``."""
        self.free["compute"] = max(self.free["compute"], event)


class _Step:
    """``schedule.Runtime``'s issue order, replayed on ``_Streams``."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.s = _Streams()
        self.unit = {u.name: u for u in cfg.units}
        self.cost = {u.name: _costs(cfg, u) for u in cfg.units}
        # forward order; backward: the root, then the others reversed (_set_order)
        self.order = [u.name for u in cfg.units]
        self.root, self.last = self.order[0], self.order[-1]
        self.next_fwd = dict(zip(self.order, self.order[1:]))
        bwd = [self.root, *self.order[:0:-1]]
        self.next_bwd = dict(zip(bwd, bwd[1:]))
        self.gathered: dict[str, float] = {}  # unit -> end of its all-gather
        self.params_written = 0.0
        self.pending_rs: list[tuple[str, float]] = []
        self.outer_events: list[float] = []
        self.outer_kind = "OUTER_RS" if cfg.strategy == "hfsdp" else "OUTER_AR"

    def run(self) -> SimResult:
        for m in range(self.cfg.microbatches):
            self.forward(first=m == 0)
            self.backward(is_last=m == self.cfg.microbatches - 1)
        s = self.s
        s.submit("compute", "OPTIMIZER", self.cfg.optimizer_ms * 1e3)
        if self.cfg.strategy == "hfsdp":  # _refresh_outer_shards after optimizer.step()
            updated = s.record()
            for name in self.order:
                s.submit("outer", f"OUTER_AG:{name}", self.cost[name].outer_ag, (updated,))
        end = max(s.free.values())
        return SimResult(s.intervals, step_metrics(s.intervals, (0.0, end)), end / 1e3)

    def compute(self, phase: str, name: str) -> None:
        u = self.unit[name]
        ms = u.fwd_ms if phase == "FWD" else u.bwd_ms
        self.s.submit("compute", f"{phase}:{name}", ms * 1e3)

    # ------------------------------------------------------------------ gather

    def issue_unshard(self, name: str | None) -> None:
        if name is not None and name not in self.gathered:
            self.gathered[name] = self.s.submit("ag", f"AG:{name}", self.cost[name].ag,
                                                (self.params_written,))

    def unshard(self, name: str) -> None:
        self.issue_unshard(name)
        self.s.wait(self.gathered[name])

    def reshard(self, name: str) -> None:
        if self.gathered.pop(name, None) is not None:
            self.s.submit("ag", f"FREE:{name}", 0.0, (self.s.record(),))

    # ------------------------------------------------------------------ forward

    def forward(self, first: bool) -> None:
        if first:  # _begin_forward: a new step's shards were written on compute
            self.params_written = self.s.record()
        self.unshard(self.root)
        self.issue_unshard(self.next_fwd.get(self.root))
        for name in self.order[1:]:
            self.unshard(name)
            self.issue_unshard(self.next_fwd.get(name))  # prefetch before the release
            self.compute("FWD", name)
            if name != self.last:  # the last unit stays gathered for the backward
                self.reshard(name)
        self.compute("FWD", self.root)  # the root stays gathered too

    # ------------------------------------------------------------------ backward

    def backward(self, is_last: bool) -> None:
        self.unshard(self.root)
        self.issue_unshard(self.next_bwd.get(self.root))
        self.compute("BWD", self.root)
        for name in self.order[:0:-1]:
            self.unshard(name)
            self.issue_unshard(self.next_bwd.get(name))  # prefetch before RS is issued
            self.compute("BWD", name)
            self.reduce(name, is_last)  # the gradient hooks fire before _post_backward
            self.reshard(name)  # _post_backward: free first, then release older RS inputs
            self.release(keep=name)
        self.reshard(self.root)  # _finalize: the root's _post_backward, then waits
        self.reduce(self.root, is_last)
        self.release()
        for ev in self.outer_events:
            self.s.wait(ev)
        self.outer_events = []

    def reduce(self, name: str, is_last: bool) -> None:
        s, c = self.s, self.cost[name]
        copied = s.submit("compute", f"COPY_IN:{name}", c.copy_in)
        ev_rs = s.submit("rs", f"RS:{name}", c.rs, (copied,))
        self.pending_rs.append((name, ev_rs))
        if is_last:
            stream = "outer" if self.cfg.overlap_outer else "rs"
            self.outer_events.append(
                s.submit(stream, f"{self.outer_kind}:{name}", c.outer, (ev_rs,)))

    def release(self, keep: str | None = None) -> None:
        """_release_rs_inputs: compute waits the RS of every unit but ``keep``."""
        for name, ev in self.pending_rs:
            if name != keep:
                self.s.wait(ev)
        self.pending_rs = [(n, ev) for n, ev in self.pending_rs if n == keep]


def simulate(cfg: SimConfig) -> SimResult:
    """One steady-state step of ``cfg``'s schedule."""
    return _Step(cfg).run()


# --------------------------------------------------------------------------- GPT


def block_params(cfg: GPTConfig) -> int:
    """Parameters of one ``hsdp.models.Block``: two norms, qkv, proj, fc1, fc2."""
    h, f = cfg.hidden, cfg.ffn
    return 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)


def gpt_units(cfg: GPTConfig, mbs: int, tflops: float) -> tuple[UnitSpec, ...]:
    """The units of ``hsdp.models.GPT`` sharded as ``bench step`` does (each block,
    then the root: embedding, positions, final norm, head, logit scale).

    Compute at ``tflops`` achieved TFLOP/s, tokens = ``mbs * seq`` per rank: forward
    ``2 * params * tokens`` FLOPs, where the root counts its head and final norm only
    (embedding and positions are looked up, not multiplied), plus attention
    ``4 * seq^2 * hidden * mbs`` per block (scores and weighted sum, causal mask
    ignored); backward twice the forward, plus one forward more when ``cfg.checkpoint``
    recomputes it. Loss, optimizer and elementwise kernels are not counted: a
    calibrated ``tflops`` absorbs them.
    """
    tokens = mbs * cfg.seq
    block = block_params(cfg)
    root = cfg.num_params - cfg.layers * block
    bwd_factor = 2.0 + (cfg.checkpoint != "none")

    def unit(name: str, params: int, flops: float) -> UnitSpec:
        ms = flops / (tflops * 1e12) * 1e3
        return UnitSpec(name, params, ms, bwd_factor * ms)

    head = cfg.hidden * cfg.vocab + 2 * cfg.hidden
    attention = 4 * cfg.seq ** 2 * cfg.hidden * mbs
    return (unit("GPT", root, 2 * head * tokens),
            *(unit(f"Block{i}", block, 2 * block * tokens + attention)
              for i in range(cfg.layers)))


def tflops_from_results(path: str | Path) -> float:
    """Achieved TFLOP/s of a ``bench step`` JSON: the FLOPs ``gpt_units`` counts for its
    model over the compute busy time of its ``overlap`` schedule."""
    data = json.loads(Path(path).read_text())
    meta = data["meta"]["model"]
    try:
        busy = data["schedules"]["overlap"]["metrics"]["busy_ms"]["by_kind"]["compute"]
    except (KeyError, TypeError):
        raise ValueError(f"{path}: no traced overlap schedule to calibrate on") from None
    cfg = config_from_dict(meta)
    at_one = gpt_units(cfg, meta["mbs"], 1.0)  # ms at 1 TFLOP/s
    return meta["microbatches"] * sum(u.fwd_ms + u.bwd_ms for u in at_one) / busy


# --------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu = MODEL_DEFAULTS["cuda"]
    model = p.add_argument_group("model (as bench step; defaults: its GPU model)")
    for name, help_ in (("layers", "transformer blocks"), ("hidden", "hidden size"),
                        ("heads", "attention heads"), ("ffn", "MLP size"),
                        ("vocab", "vocabulary size"), ("seq", "sequence length"),
                        ("mbs", "micro-batch size (sequences per rank)")):
        model.add_argument(f"--{name}", type=int, default=gpu[name],
                           help=f"{help_} (default {gpu[name]})")
    p.add_argument("--microbatches", type=int, default=1,
                   help="microbatches per step (outer reduction on the last only)")
    p.add_argument("--mesh", type=parse_mesh, default=(16, 8), help="OUTERxINNER (16x8)")
    p.add_argument("--strategy", choices=STRATEGIES, default="hsdp")
    speed = p.add_mutually_exclusive_group()
    speed.add_argument("--tflops", type=float, default=600.0,
                       help="achieved bf16 TFLOP/s of one GPU (default 600)")
    speed.add_argument("--tflops-from", metavar="PATH", default=None,
                       help="calibrate it on a `bench step` JSON (its overlap schedule's "
                            "compute busy time)")
    p.add_argument("--optimizer-ms", type=float, default=0.0,
                   help="optimizer step on compute, ms (default 0)")
    p.add_argument("--copy-in-gbps", type=float, default=None,
                   help="memory GB/s of the gradient copy-in (default: it takes no time)")
    p.add_argument("--inner-gbps", type=float, default=370.0, help="inner bus GB/s")
    p.add_argument("--outer-gbps", type=float, default=47.0, help="outer bus GB/s")
    p.add_argument("--latency-us", type=float, default=20.0, help="per collective, us")
    p.add_argument("--json", default=None, metavar="PATH", help="write results here")
    p.add_argument("--png", default=None, metavar="PATH", help="write the timeline here")


def run(args: argparse.Namespace) -> int:
    try:
        model = GPTConfig(vocab=args.vocab, hidden=args.hidden, heads=args.heads,
                          ffn=args.ffn, layers=args.layers, seq=args.seq)
        fabric = Fabric(Link(args.inner_gbps, args.latency_us),
                        Link(args.outer_gbps, args.latency_us))
        if args.mbs < 1 or args.microbatches < 1 or args.tflops <= 0:
            raise ValueError("need --mbs >= 1, --microbatches >= 1 and --tflops > 0")
        tflops = tflops_from_results(args.tflops_from) if args.tflops_from else args.tflops
    except ValueError as e:
        raise SystemExit(f"hsdp sim: {e}") from None
    units = gpt_units(model, args.mbs, tflops)
    outer, inner = args.mesh
    results = {
        name: simulate(SimConfig(units, outer, inner, args.strategy, overlap,
                                 args.microbatches, optimizer_ms=args.optimizer_ms,
                                 copy_in_gbps=args.copy_in_gbps, fabric=fabric))
        for name, overlap in zip(SCHEDULE_NAMES[args.strategy], (True, False), strict=True)}
    report = {
        "meta": {"model": {**asdict(model), "mbs": args.mbs,
                           "microbatches": args.microbatches},
                 "num_params": model.num_params, "mesh": {"outer": outer, "inner": inner},
                 "strategy": args.strategy, "tflops": tflops,
                 "optimizer_ms": args.optimizer_ms, "fabric": asdict(fabric),
                 "units": [asdict(u) for u in units]},
        "schedules": {name: {"t_step_ms": r.t_step_ms,
                             **{k: r.metrics[k] for k in ("exposed_comm_ms", "outer_tail_ms",
                                                          "comm_comm_overlap_ms",
                                                          "lower_bound_ms")},
                             "metrics": r.metrics,
                             "intervals": [asdict(iv) for iv in r.intervals]}
                      for name, r in results.items()},
    }
    fast, slow = SCHEDULE_NAMES[args.strategy]
    saving = results[slow].t_step_ms - results[fast].t_step_ms
    report["summary"] = {f"{fast}_vs_{slow}": {
        "saving_ms": saving, "saving_pct": 100.0 * saving / results[slow].t_step_ms}}
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.png:
        from hsdp.report.timeline import plot_timeline

        plot_timeline({name: r.intervals for name, r in results.items()}, args.png)
    return 0


def _print(report: dict) -> None:
    m = report["meta"]
    f = m["fabric"]
    print(f"sim: GPT {m['num_params'] / 1e6:.1f} M params, {m['model']['layers']} layers, "
          f"seq {m['model']['seq']}, mbs {m['model']['mbs']} x {m['model']['microbatches']} "
          f"microbatches; mesh {m['mesh']['outer']}x{m['mesh']['inner']} (outer x inner), "
          f"{m['strategy']}; {m['tflops']:.0f} TFLOP/s; inner {f['inner']['bus_gbps']:g} "
          f"GB/s, outer {f['outer']['bus_gbps']:g} GB/s, {f['inner']['latency_us']:g} us")
    rows = [[name, *(f"{s[c]:.2f}" for c in METRIC_KEYS)]
            for name, s in report["schedules"].items()]
    notes = [f"{pair.replace('_vs_', ' vs ')}: saves {v['saving_ms']:.2f} ms per step "
             f"({v['saving_pct']:.1f}%)" for pair, v in report["summary"].items()]
    print_rows("predicted step", ["schedule", *METRIC_KEYS], rows,
               [*notes, "lower bound = max(compute + last outer reduction, inner, outer busy)"])
