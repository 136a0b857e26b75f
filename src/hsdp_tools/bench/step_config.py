"""``bench step``'s command line and its resolved configuration (``StepBenchConfig``):
model, mesh, schedules, fabric, emulation."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import hsdp
from hsdp.float8 import INSTALL as FLOAT8_INSTALL
from hsdp.runtime.outer_modes import parse_mode
from hsdp.topology.outer_mode import OuterMode
from hsdp_tools.bench.collectives import DTYPES, default_mesh
from hsdp_tools.bench.graphed import EAGER_STEPS
from hsdp_tools.bench.launch import (
    add_layout_argument,
    check_shared_layout,
)
from hsdp_tools.bench.mfsdp import PeerUnavailable, import_mfsdp
from hsdp_tools.bench.trainee import (
    SCHEDULES,
)
from hsdp_tools.models import CHECKPOINT_MODES, GPTConfig, LlamaConfig, ModelConfig
from hsdp_tools.models_moe import MoEConfig
from hsdp_tools.report.args import parse_mesh
from hsdp_tools.sim.fabric import Fabric, Link, fit_link

# (overlapped, serialized) pairs whose saving is reported
PAIRS = (("overlap", "serial"), ("hfsdp", "hfsdp-serial"), ("overlap-graph", "serial-graph"),
         ("hfsdp-graph", "hfsdp-serial-graph"))
# (replayed, eager) pairs of the same schedule
GRAPH_PAIRS = tuple((f"{name}-graph", name) for name in ("overlap", "serial", "hfsdp",
                                                          "hfsdp-serial"))


# Model when not given (hsdp_tools.models). GPU: 8 Llama-8B layers (SwiGLU, grouped-query
# attention, RMSNorm), what users run, with enough compute per layer that an H200 is not
# waiting on the host; CPU: the same architecture, quick.
MODEL_DEFAULTS = {
    "cuda": {"arch": "llama", "layers": 8, "hidden": 4096, "heads": 32, "kv_heads": 8,
             "ffn": 14336, "vocab": 32768, "seq": 2048, "mbs": 1},
    "cpu": {"arch": "llama", "layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2,
            "ffn": 384, "vocab": 1024, "seq": 128, "mbs": 2},
}


ARCHS = {"llama": LlamaConfig, "gpt": GPTConfig, "moe": MoEConfig}

# --arch moe: sizes not given (hsdp_tools.models_moe). GPU: 8 blocks shaped as Qwen3-30B-A3B's
# (hidden 2048, 32 heads / 4 KV heads, 128 experts of width 768, 8 per token).
MOE_DEFAULTS = {
    "cuda": {"arch": "moe", "layers": 8, "hidden": 2048, "heads": 32, "kv_heads": 4,
             "ffn": 768, "vocab": 32768, "seq": 4096, "mbs": 1, "experts": 128, "top_k": 8,
             "ep": 1},
    "cpu": {"arch": "moe", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 32,
            "vocab": 256, "seq": 64, "mbs": 2, "experts": 8, "top_k": 2, "ep": 1},
}
MOE_SIZES = (("experts", "experts per block (moe)"), ("top_k", "experts per token (moe)"),
             ("ep", "expert-parallel ranks, a divisor of the inner size (moe)"))


MODEL_SIZES = (("layers", "transformer blocks"), ("hidden", "hidden size"),
               ("heads", "attention heads"), ("kv_heads", "key/value heads (llama)"),
               ("ffn", "MLP size"), ("vocab", "vocabulary size"), ("seq", "sequence length"),
               ("mbs", "micro-batch size (sequences per rank)"))


EMULATED_MESH = {"cuda": (16, 8), "cpu": (2, 4)}  # --emulate without --mesh


GIB = 1 << 30


def add_arguments(p: argparse.ArgumentParser,
                  model_defaults: dict[str, dict[str, int]] = MODEL_DEFAULTS) -> None:
    """The options; ``model_defaults`` (per device type) fill the model sizes not given."""
    p.set_defaults(model_defaults=model_defaults)
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to spawn (default: all GPUs, twice that with "
                        "--share-gpus, or 4 on CPU); ignored under torchrun and with "
                        "--emulate")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cpu: gloo ranks even where GPUs exist (default: cuda when present)")
    p.add_argument("--mesh", type=parse_mesh, default=None,
                   help="OUTERxINNER (default: 2 x world/2; with --emulate 16x8 on GPU, "
                        "2x4 on CPU)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per data-parallel rank (llama only): a 3-D "
                        "OUTERxINNERxTP mesh, torch's TP plan on its 'tp' dim (default 1)")
    add_layout_argument(p)
    model = p.add_argument_group("model (hsdp_tools.models; defaults: GPU / CPU)")
    d = f"{model_defaults['cuda']['arch']} / {model_defaults['cpu']['arch']}"
    model.add_argument("--arch", choices=sorted(ARCHS), default=None,
                       help=f"llama: RMSNorm, grouped-query attention, SwiGLU; gpt: "
                            f"LayerNorm, GELU MLP ({d})")
    for name, help_ in MODEL_SIZES:
        d = f"{model_defaults['cuda'][name]} / {model_defaults['cpu'][name]}"
        model.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                           help=f"{help_} ({d})")
    for name, help_ in MOE_SIZES:
        d = f"{MOE_DEFAULTS['cuda'][name]} / {MOE_DEFAULTS['cpu'][name]}"
        model.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                           help=f"{help_} ({d}; --arch moe's other defaults: "
                                f"hsdp_tools.bench.step_config.MOE_DEFAULTS)")
    model.add_argument("--checkpoint", choices=CHECKPOINT_MODES, default="none",
                       help="activation checkpointing (see hsdp_tools.models)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="microbatches per step (outer reduction on the last only)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="parameter dtype for compute (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--float8", action="store_true",
                   help="torchao float8 linears (tensorwise, float8 all-gather on) in every "
                        "schedule; emulated matmuls on CPU (needs hsdp[float8])")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32",
                   help="gradient reduction dtype")
    p.add_argument("--schedules", type=parse_schedules, default=parse_schedules(
        "overlap,serial,fsdp2"), help=f"comma-separated among {', '.join(SCHEDULES)} "
                                      f"(default: overlap,serial,fsdp2)")
    p.add_argument("--outer-reduce", type=_mode_arg("outer_reduce"), default=None,
                   metavar="DTYPE[:BLOCK]", help="the compressed outer reduction of the "
                   "schedules overlap-q and hfsdp-q: int8 or fp8_e4m3, block 256 unless "
                   "given (default: int8)")
    p.add_argument("--outer-gather", type=_mode_arg("outer_gather"), default=None,
                   metavar="DTYPE[:BLOCK]", help="the compressed outer parameter all-gather "
                   "of the schedules hfsdp-g and hfsdp-qg: int8 or fp8_e4m3, block 256 unless "
                   "given (default: int8)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per schedule")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per schedule first")
    p.add_argument("--run-steps", type=int, default=0,
                   help="per schedule, this many more steps back to back, drained once at "
                        "the end (t_run: what a training loop sees, e.g. hfsdp's outer "
                        "all-gather overlapping the next forward; not for -graph "
                        "schedules; default 0: off)")
    p.add_argument("--record-steps", type=int, default=3,
                   help="untimed steps per schedule with its tracer on, without the "
                        "profiler: host marks and side-op stream times of each, for "
                        "`hsdp sim` calibration (default 3)")
    p.add_argument("--trace-steps", type=int, default=2,
                   help="profiled steps per schedule, one Chrome trace each; the first "
                        "gives the metrics and the timeline (default 2)")
    emu = p.add_argument_group("emulation")
    emu.add_argument("--emulate", action="store_true",
                     help="one process posing as the whole mesh, modelled collective times")
    emu.add_argument("--inner-gbps", type=float, default=370.0, help="inner bus GB/s")
    emu.add_argument("--outer-gbps", type=float, default=47.0, help="outer bus GB/s")
    emu.add_argument("--tp-gbps", type=float, default=370.0,
                     help="tp bus GB/s (TP collectives, with --tp)")
    emu.add_argument("--latency-us", type=float, default=20.0,
                     help="per collective, us (with --fabric-json: where it cannot be fitted)")
    emu.add_argument("--fabric-json", default=None, metavar="PATH",
                     help="fit inner/outer latency and bandwidth to a `bench collectives` "
                          "JSON instead (an axis of one rank keeps the flags' link)")
    p.add_argument("--json", default=None, metavar="PATH", help="write results here")
    p.add_argument("--out-dir", default="out/bench_step",
                   help="Chrome traces and timeline.png (default: ./out/bench_step)")


def _mode_arg(argument: str) -> Callable[[str], OuterMode | None]:
    """The argparse type of ``--outer-reduce`` / ``--outer-gather``: "int8",
    "fp8_e4m3:128" (``parse_mode``)."""
    def parse(text: str) -> OuterMode | None:
        try:
            return parse_mode(argument, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    return parse


def parse_schedules(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [n for n in names if n not in SCHEDULES]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"bad --schedules {text!r}: expected distinct names among {', '.join(SCHEDULES)}")
    return names


def fabric_from_collectives(path: str | Path, default: Fabric) -> tuple[Fabric, dict]:
    """A ``Fabric`` fitted to every size of a ``bench collectives`` JSON.

    Inner: the reduce-scatter ``t_rs_ms`` of ``size_bytes`` (its input) over the inner
    group; outer: the all-reduce ``t_ar_ms`` of ``size_bytes / inner`` (the RS output) over
    the outer group; each fitted by ``hsdp_tools.sim.fabric.fit_link`` (latency and bus bandwidth;
    ``default``'s latency where only the bandwidth can be fitted). An axis of one rank was
    not measured and runs no collective: it keeps ``default``'s link. Returns the fabric
    and, per axis, the fit's largest relative error over the sizes (None: not fitted).
    """
    data = json.loads(Path(path).read_text())
    inner, outer = data["meta"]["inner"], data["meta"]["outer"]
    links, errors = {}, {}
    for axis, kind, n, key, div in (("inner", "reduce_scatter", inner, "t_rs_ms", 1),
                                    ("outer", "all_reduce", outer, "t_ar_ms", inner)):
        links[axis], errors[axis] = getattr(default, axis), None
        if n < 2:
            continue
        samples = [(r["size_bytes"] // div, r[key] * 1e-3) for r in data["rows"]]
        try:
            link = fit_link(kind, n, samples, links[axis].latency_us)
        except ValueError as e:
            raise SystemExit(f"hsdp bench step: {path}: {axis}: {e}") from None
        model = Fabric(link, link)
        links[axis] = link
        errors[axis] = max(abs(model.seconds(kind, "inner", b, n) - t) / t for b, t in samples)
    if all(e is None for e in errors.values()):
        raise SystemExit(f"hsdp bench step: {path}: mesh {outer}x{inner} has no group of "
                         f"two or more ranks to fit a link on")
    return Fabric(links["inner"], links["outer"]), errors


@dataclass(frozen=True)
class StepBenchConfig:
    """``bench step``'s resolved arguments, identical on every rank."""

    world: int
    outer: int
    inner: int
    model: ModelConfig
    mbs: int
    microbatches: int
    dtype: str
    reduce_dtype: str
    schedules: tuple[str, ...]
    steps: int
    warmup: int
    record_steps: int
    trace_steps: int
    emulate: bool
    fabric: Fabric | None
    fabric_source: str | None
    json_path: str | None
    out_dir: str
    cuda: bool
    share_gpus: bool = False
    fabric_fit: dict | None = None  # per axis: the fit's largest relative error
    float8: bool = False  # torchao float8 linears (--float8)
    tp: int = 1  # tensor-parallel ranks (--tp): world = outer * inner * tp
    tp_fabric: Fabric | None = None  # emulated TP collectives (its inner link: --tp-gbps)
    outer_reduce: hsdp.OuterReduce | None = None  # the "-q" schedules' (--outer-reduce)
    outer_gather: hsdp.OuterGather | None = None  # the "-g" schedules' (--outer-gather)
    run_steps: int = 0  # steps back to back per schedule (--run-steps; 0: none)

    @property
    def global_tokens(self) -> int:
        """A TP group's ranks share their tokens."""
        return self.outer * self.inner * self.mbs * self.model.seq * self.microbatches

    @property
    def mp(self) -> hsdp.MixedPrecision:
        return hsdp.MixedPrecision(DTYPES[self.dtype], DTYPES[self.reduce_dtype])

    def describe(self) -> str:
        m = self.model
        kv = f" ({m.kv_heads} kv)" if isinstance(m, LlamaConfig) else ""
        moe = (f" ({m.experts} experts, {m.top_k} per token, ep {m.ep})"
               if isinstance(m, MoEConfig) else "")
        return (f"{m.arch} {m.layers} layers, hidden {m.hidden}, ffn {m.ffn}{moe}, heads "
                f"{m.heads}{kv}, vocab {m.vocab}, seq {m.seq}, mbs {self.mbs}, {self.dtype}"
                f"{' + float8' if self.float8 else ''}: {m.num_params / 1e6:.1f} M params")


def resolve(args: argparse.Namespace, cuda: bool, world: int | None) -> StepBenchConfig:
    """Fill defaults that depend on the device and world; check the rest. ``world`` is
    None with ``--emulate`` (the mesh decides it)."""
    def fail(msg: str) -> SystemExit:
        return SystemExit(f"hsdp bench step: {msg}")

    device = "cuda" if cuda else "cpu"
    tp = args.tp
    if tp < 1:
        raise fail(f"--tp must be at least 1, got {tp}")
    if world is None:
        outer, inner = args.mesh or EMULATED_MESH[device]
        world = outer * inner * tp
    else:
        if world < 1:
            raise fail(f"need at least one rank, got {world}")
        if world % tp:
            raise fail(f"--tp {tp} does not divide the job's {world} ranks; pick --nproc "
                       f"a multiple of {tp}")
        outer, inner = args.mesh or default_mesh(world // tp)
        if outer * inner * tp != world:
            with_tp, times_tp = (f" with --tp {tp}", "*TP") if tp > 1 else ("", "")
            raise fail(f"mesh {outer}x{inner}{with_tp} has {outer * inner * tp} ranks but the "
                       f"job has {world}; pick --mesh OUTERxINNER with OUTER*INNER{times_tp} = "
                       f"{world} (or --nproc {outer * inner * tp})")
    share = bool(args.share_gpus) and cuda and not args.emulate
    if share:
        check_shared_layout("bench step", outer, inner, torch.cuda.device_count())
    if min(args.steps, args.warmup, args.record_steps, args.trace_steps,
           args.microbatches) < 1:
        raise fail("need --steps >= 1, --warmup >= 1 (the first step records the unit "
                   "order and creates optimizer state), --record-steps >= 1, "
                   "--trace-steps >= 1 and --microbatches >= 1")
    if args.run_steps < 0:
        raise fail(f"--run-steps must be 0 (off) or more, got {args.run_steps}")
    if args.float8:
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            raise fail(f"--float8 needs torchao: {FLOAT8_INSTALL}") from None
    graphed = [n for n in args.schedules if SCHEDULES[n].graphs]
    if graphed and (not cuda or args.float8 or tp > 1 or args.share_gpus
                    or args.warmup <= EAGER_STEPS):
        raise fail(f"schedules {', '.join(graphed)} capture CUDA graphs: they need CUDA "
                   f"(--device cuda) and --warmup >= {EAGER_STEPS + 1} ({EAGER_STEPS} eager "
                   f"steps, then the capture), "
                   f"and run without --float8 (its all-gather is refused under capture), "
                   f"--tp and --share-gpus (not captured yet)")
    if args.float8 and "mfsdp" in args.schedules:
        raise fail("--float8: schedule 'mfsdp' is not converted; leave it out")
    if args.float8 and any(SCHEDULES[n].compressed_gather for n in args.schedules):
        raise fail("--float8 with schedules hfsdp-g / hfsdp-qg: float8 all-gather already "
                   "moves one byte per weight over outer (outer_gather refuses float8 units)")
    if tp > 1:
        _check_tp(args, fail)
    if "mfsdp" in args.schedules:
        try:
            import_mfsdp()
        except PeerUnavailable as e:
            raise fail(str(e)) from None
        if not cuda:
            raise fail("schedule 'mfsdp': Megatron-FSDP runs on CUDA only")
    if args.arch == "moe":
        _check_moe(args, inner, fail)
    elif any(getattr(args, k) is not None for k, _ in MOE_SIZES):
        raise fail("--experts, --top-k and --ep apply to --arch moe only")
    defaults = MOE_DEFAULTS if args.arch == "moe" else args.model_defaults
    sizes = {k: getattr(args, k) if getattr(args, k, None) is not None else v
             for k, v in defaults[device].items()}
    mbs, arch = sizes.pop("mbs"), sizes.pop("arch")
    if arch == "gpt":
        if args.kv_heads is not None:
            raise fail("--kv-heads applies to --arch llama only")
        sizes.pop("kv_heads", None)
    try:
        model = ARCHS[arch](checkpoint=args.checkpoint, **sizes)
    except ValueError as e:
        raise fail(str(e)) from None
    fabric, source, fit, tp_fabric = None, None, None, None
    if args.emulate:
        fabric = Fabric(Link(args.inner_gbps, args.latency_us),
                        Link(args.outer_gbps, args.latency_us))
        source = "flags"
        if tp > 1:
            tp_link = Link(args.tp_gbps, args.latency_us)
            tp_fabric = Fabric(tp_link, tp_link)
    if args.emulate and args.fabric_json:
        fabric, fit = fabric_from_collectives(args.fabric_json, fabric)
        source = args.fabric_json
    return StepBenchConfig(world, outer, inner, model, mbs, args.microbatches,
                           args.dtype or ("bf16" if cuda else "fp32"), args.reduce_dtype,
                           tuple(args.schedules), args.steps, args.warmup, args.record_steps,
                           args.trace_steps, args.emulate, fabric,
                           source, args.json, args.out_dir, cuda, share, fit, args.float8, tp,
                           tp_fabric, args.outer_reduce, args.outer_gather, args.run_steps)


def _check_moe(args: argparse.Namespace, inner: int, fail: Callable[[str], SystemExit]
               ) -> None:
    """What ``--arch moe`` does not run, refused before any rank starts."""
    ep = args.ep or 1
    if ep < 1 or inner % ep:
        raise fail(f"--ep {ep} must divide the inner size {inner} (the experts are split "
                   f"inside an inner group)")
    if args.float8 or "mfsdp" in args.schedules or args.share_gpus:
        raise fail("--arch moe runs without --float8, schedule 'mfsdp' and --share-gpus")


def _check_tp(args: argparse.Namespace, fail: Callable[[str], SystemExit]) -> None:
    """What ``--tp`` > 1 does not run, refused before any rank starts."""
    if (args.arch or args.model_defaults["cpu"]["arch"]) != "llama":
        raise fail("--tp: the TP plan is for --arch llama only")
    if args.float8:
        raise fail("--tp with --float8: torchao's float8 TP styles are not wired in; leave "
                   "one out")
    if "mfsdp" in args.schedules:
        raise fail("--tp: schedule 'mfsdp' has no TP plan here; leave it out")
    if args.share_gpus:
        raise fail("--tp with --share-gpus is not supported; give each rank its own GPU")
