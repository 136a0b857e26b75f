"""Host time per training step on CPU: hsdp vs FSDP2 vs the unsharded reference.

    PYTHONPATH=src python scripts/host_overhead.py                  # the table
    PYTHONPATH=src python scripts/host_overhead.py --profile 30     # + cProfile of hsdp

One process poses as rank 0 of a 16x8 world on torch's fake process group (collectives
return at once, no emulated delays) and steps a Llama-style model so small that its
compute is negligible: what is left of a step is the host time of issuing it (Python and
dispatch), the cost that makes the real step host-bound on a GPU (issue 10, "Overhead").
Schedules are stepped in turn (A B C A B C ...); the table gives, per schedule, the median
(min-max) host ms per step (``Trainee.step``: until the optimizer step returned) after the
warm-up, and the excess over the reference; then the same for the process CPU time of the
whole step (all threads: on a machine shared with other jobs it moves less than wall time).
``--profile N`` adds a cProfile of the hsdp schedule (by own time), first of hsdp's own
functions, then of everything.

On CPU hsdp's side streams are worker threads: their closures (casts, collectives) would
run beside the main thread, competing with it for the GIL and the cores, and out of its
profile. On CUDA the host runs each closure itself when it submits it (the device work is
what is deferred), so by default (``--streams inline``) the script does the same: a side
stream's closure runs on the calling thread at submit. ``--streams threads`` measures the
CPU streams as they are.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import hsdp  # noqa: E402
from hsdp.streams.contract import Event  # noqa: E402
from hsdp.streams.cpu_backend import ThreadEvent, ThreadSideStream  # noqa: E402
from hsdp_tools.bench.emulate import fake_mesh  # noqa: E402
from hsdp_tools.bench.trainee import Trainee, build, build_unsharded, synthetic_batches  # noqa: E402
from hsdp_tools.models import LlamaConfig  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--mesh", default="16x8", help="OUTERxINNER (fake process group)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="param dtype")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--schedules", default="overlap,fsdp2,ref",
                   help="comma-separated among overlap, serial, hfsdp, fsdp2, ref")
    p.add_argument("--streams", choices=("inline", "threads"), default="inline",
                   help="side-stream closures on the calling thread at submit, as the host "
                        "issues them on CUDA (default), or on hsdp's CPU worker threads")
    p.add_argument("--steps", type=int, default=30, help="timed steps per schedule")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile N more hsdp steps (the first hsdp schedule)")
    return p.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(1)  # intra-op threads only add noise to ops this small
    if args.streams == "inline":
        ThreadSideStream.submit = _submit_inline
    outer, inner = (int(x) for x in args.mesh.split("x"))
    cfg = LlamaConfig(layers=args.layers, hidden=args.hidden, heads=4, kv_heads=2,
                      ffn=3 * args.hidden, vocab=256, seq=args.seq)
    mp = hsdp.MixedPrecision(DTYPES[args.dtype], DTYPES[args.reduce_dtype])
    cpu = torch.device("cpu")
    mesh = fake_mesh(outer, inner, "cpu")
    batches = synthetic_batches(cfg.vocab, 1, cfg.seq, 1, cpu)
    names = args.schedules.split(",")
    trainees: dict[str, Trainee] = {
        n: build_unsharded(cfg, mp, inner, cpu) if n == "ref"
        else build(n, cfg, mp, mesh, cpu, None, True) for n in names}
    for t in trainees.values():
        for _ in range(args.warmup):
            t.step(batches, delays=False)
    host: dict[str, list[float]] = {n: [] for n in names}
    cpu_ms: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.steps):
        for n, t in trainees.items():
            c0 = time.process_time()
            host[n].append(t.step(batches, delays=False) * 1e3)
            cpu_ms[n].append((time.process_time() - c0) * 1e3)
    print(f"mesh {args.mesh} (fake pg), llama {args.layers} layers hidden {args.hidden} "
          f"seq {args.seq}, {args.dtype}/{args.reduce_dtype}; ms per step over {args.steps} "
          f"steps, median (min-max); host: wall time of issuing the step; cpu: CPU time of "
          f"the whole step, all threads (steadier on a loaded machine)")
    for title, table in (("host", host), ("cpu", cpu_ms)):
        ref = statistics.median(table["ref"]) if "ref" in table else None
        for n, ms in table.items():
            med = statistics.median(ms)
            extra = f"  (+{med - ref:.2f} over ref)" if ref is not None and n != "ref" else ""
            print(f"  {title:4s} {n:8s} {med:7.2f} ({min(ms):.2f}-{max(ms):.2f}){extra}")
    hsdp_names = [n for n in names if n not in ("ref", "fsdp2")]
    if args.profile and hsdp_names:
        profile(trainees[hsdp_names[0]], batches, args.profile)


def _submit_inline(self: ThreadSideStream, fn: Callable[[], None], after: Sequence[Event] = (),
                   label: str = "") -> Event:
    """``ThreadSideStream.submit`` that runs ``fn`` now, on the calling thread (as the
    CUDA backend does): every earlier op has finished, so the order is kept."""
    for dep in after:
        dep.synchronize()
    fn()
    ev = ThreadEvent(label)
    ev.set()
    return ev


def profile(t: Trainee, batches: list[torch.Tensor], steps: int) -> None:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        t.step(batches, delays=False)
    pr.disable()
    # hsdp's own: the library, not the model it trains (hsdp_tools.models) or the bench's code.
    for title, pattern in (("hsdp's own functions", r"hsdp/(?!models\.py|bench/)"),
                           ("everything", "")):
        s = io.StringIO()
        stats = pstats.Stats(pr, stream=s).sort_stats("tottime")
        stats.print_stats(pattern, 30) if pattern else stats.print_stats(30)
        print(f"==== cProfile of {t.name}, {steps} steps, {title}, by own time")
        text = s.getvalue()
        print(text[text.find("   ncalls"):])


if __name__ == "__main__":
    main()
