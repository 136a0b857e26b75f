"""Train a tiny Llama-style model with hsdp: the torchtitan-style script to copy.

    torchrun --nproc-per-node 4 examples/train_llama.py --mesh 2x2 --steps 20
    torchrun --nproc-per-node 4 examples/train_llama.py --mesh 2x2 --steps 40 \\
        --ckpt /tmp/llama-ckpt --save-every 10 --resume      # continues where it stopped

What it shows, in order: the mesh; the model built on the meta device (no rank ever holds
it whole); activation checkpointing, torch.compile and fully_shard per block, then the
root; ``hsdp.materialize`` (allocate this rank's shards, run the init per module);
AdamW with warm-up + cosine LR; gradient accumulation over microbatches; torch's
``clip_grad_norm_``; checkpoint save / resume; a progress and loss log.
On CPU it runs on gloo (use ``--dtype fp32 --compile-backend aot_eager`` there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import hsdp

# --------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    dim: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention: heads share kv_heads key/value heads
    ffn: int = 176
    seq: int = 32
    rope_theta: float = 10000.0
    eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) \
            * self.weight


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding; ``rope`` holds (cos, sin) for each position."""
    cos, sin = rope.unbind(0)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, init_std: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)
        self.wo.init_std = init_std

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = rotate(self.wq(x).view(b, t, self.heads, self.head_dim), rope)
        k = rotate(self.wk(x).view(b, t, self.kv_heads, self.head_dim), rope)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim)
        rep = self.heads // self.kv_heads
        k, v = (z.repeat_interleave(rep, dim=2) for z in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU."""

    def __init__(self, cfg: LlamaConfig, init_std: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2.init_std = init_std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int) -> None:
        super().__init__()
        init_std = 0.02 / math.sqrt(2 * (layer_id + 1))  # deeper layers start smaller
        self.attention_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attention = Attention(cfg, init_std)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.feed_forward = FeedForward(cfg, init_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.output.init_std = cfg.dim ** -0.5
        self.register_buffer("rope", torch.empty(2, cfg.seq, 1, cfg.dim // cfg.heads // 2),
                             persistent=False)
        self.activation_checkpointing = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        rope = self.rope[:, : tokens.shape[1]]
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, rope, use_reentrant=False)
            else:
                h = layer(h, rope)
        return self.output(self.norm(h))


@torch.no_grad()
def init_weights(m: nn.Module) -> None:
    """Initialize ``m``'s own parameters and buffers (called once per module)."""
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=getattr(m, "init_std", 0.02))
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight)
    elif isinstance(m, RMSNorm):
        nn.init.ones_(m.weight)
    elif isinstance(m, Llama):
        cfg = m.cfg
        half = cfg.dim // cfg.heads // 2
        freqs = cfg.rope_theta ** -(torch.arange(half, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), freqs)
        m.rope.copy_(torch.stack((angles.cos(), angles.sin())).unsqueeze(2))


# --------------------------------------------------------------------------- data


def batch(step: int, rows: int, cfg: LlamaConfig) -> torch.Tensor:
    """Global batch of ``step``: ``rows`` sequences of ``seq + 1`` tokens that mostly
    follow a fixed random successor table (learnable), with 10% random tokens."""
    table = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(step)
    tokens = torch.empty(rows, cfg.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab, (rows,), generator=g)
    noise = torch.rand(rows, cfg.seq, generator=g) < 0.1
    rand = torch.randint(0, cfg.vocab, (rows, cfg.seq), generator=g)
    for t in range(cfg.seq):
        tokens[:, t + 1] = torch.where(noise[:, t], rand[:, t], table[tokens[:, t]])
    return tokens


def lr_lambda(warmup: int, steps: int, min_ratio: float):
    """Linear warm-up, then cosine decay to ``min_ratio`` of the peak."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# --------------------------------------------------------------------------- training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", default=None, help="OUTERxINNER (default: 1 x world size)")
    p.add_argument("--strategy", default="hsdp", choices=["hsdp", "hfsdp"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="global sequences per step")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                   help="compute dtype (weights, gradients and AdamW stay fp32)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--ac", action=argparse.BooleanOptionalAction, default=True,
                   help="activation checkpointing of every block")
    p.add_argument("--ckpt", default=None, help="checkpoint directory")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from --ckpt if present")
    p.add_argument("--log-file", default=None, help="JSON lines, one per step (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    for f in dataclasses.fields(LlamaConfig):  # model size: --dim, --layers, --seq, ...
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LlamaConfig)})


def build(args: argparse.Namespace, cfg: LlamaConfig, mesh) -> Llama:
    """The sharded model: meta device -> AC, compile, fully_shard -> materialize."""
    with torch.device("meta"):
        model = Llama(cfg)
    model.activation_checkpointing = args.ac
    # Blocks compute in bf16 and pass bf16 on; the root returns fp32 logits for the loss.
    param_dtype = torch.bfloat16 if args.dtype == "bf16" else None
    mp = hsdp.MixedPrecision(param_dtype, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        if args.compile:
            model.layers[i] = block = torch.compile(block, backend=args.compile_backend,
                                                    fullgraph=True)
        hsdp.fully_shard(block, mesh=mesh, strategy=args.strategy, mp_policy=mp)
    hsdp.fully_shard(model, mesh=mesh, strategy=args.strategy, mp_policy=hsdp.MixedPrecision(
        param_dtype, reduce_dtype=torch.float32, output_dtype=torch.float32))
    torch.manual_seed(args.seed)  # the init's random draws: as in a single process
    hsdp.materialize(model, init_weights)
    return model


def save(ckpt: str, model: nn.Module, opt, sched, step: int) -> None:
    """``ckpt/step-N``: model and optimizer with DCP (every rank writes its pieces; any mesh
    can load it), then the LR schedule next to it."""
    hsdp.save(os.path.join(ckpt, f"step-{step}"), model, opt)
    if dist.get_rank() == 0:
        torch.save(sched.state_dict(), os.path.join(ckpt, f"step-{step}.sched.pt"))
    dist.barrier()


def latest(ckpt: str) -> int | None:
    """The last step saved completely (both parts), if any."""
    steps = [int(name[5:-9]) for name in os.listdir(ckpt) if name.startswith("step-")
             and name.endswith(".sched.pt")] if os.path.isdir(ckpt) else []
    return max(steps, default=None)


def load(ckpt: str, step: int, model: nn.Module, opt, sched) -> None:
    hsdp.load(os.path.join(ckpt, f"step-{step}"), model, opt)
    sched.load_state_dict(torch.load(os.path.join(ckpt, f"step-{step}.sched.pt")))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = int(os.environ["WORLD_SIZE"])
    outer, inner = map(int, (args.mesh or f"1x{world}").split("x"))
    mesh = hsdp.init_mesh(outer, inner)  # also starts the process group (torchrun)
    rank, device = dist.get_rank(), mesh.device_type
    cfg = config(args)
    if args.batch % (world * args.microbatches):
        raise SystemExit(f"--batch {args.batch} must divide into {world} ranks x "
                         f"{args.microbatches} microbatches")

    model = build(args, cfg, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(args.warmup, args.steps, args.min_lr_ratio))
    start = (latest(args.ckpt) if args.resume and args.ckpt else None) or 0
    if start:
        load(args.ckpt, start, model, opt, sched)
        if rank == 0:
            print(f"resumed from {args.ckpt}/step-{start}")
    log = open(args.log_file, "a") if args.log_file and rank == 0 else None

    rows = args.batch // world
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        tokens = batch(step, args.batch, cfg)[rank * rows:(rank + 1) * rows].to(device)
        loss_sum = torch.zeros((), device=device)
        for i, micro in enumerate(tokens.chunk(args.microbatches)):
            with hsdp.microbatch(model, is_last=i == args.microbatches - 1):
                loss = loss_fn(model(micro[:, :-1]), micro[:, 1:]) / args.microbatches
                loss.backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad()
        dist.all_reduce(loss_sum)  # the mean over the global batch
        global_loss, norm = loss_sum.item() / world, grad_norm.item()  # on every rank
        step_s = time.perf_counter() - t0
        if rank == 0:
            tok_s = args.batch * cfg.seq / step_s
            print(f"step {step + 1:4d}/{args.steps} | loss {global_loss:.4f} | "
                  f"lr {lr:.2e} | grad_norm {norm:.3f} | {tok_s:,.0f} tok/s",
                  flush=True)
            if log:
                log.write(json.dumps({"step": step, "loss": global_loss, "lr": lr,
                                      "grad_norm": norm, "step_s": step_s}) + "\n")
                log.flush()
        if args.ckpt and args.save_every and (step + 1) % args.save_every == 0:
            save(args.ckpt, model, opt, sched, step + 1)
    hsdp.synchronize(model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
