"""Every shell command of README.md and docs/**/*.md runs as written.

The convention (README, "Documentation"): shell commands live in fenced ```bash blocks,
one command per line (``\\`` continues a line; lines starting with ``#`` are comments).
Each block's commands run, as written and in order, as one bash script (``set -e``) in a
scratch folder that links the repository's ``src``, ``tests``, ``scripts``, ``examples``,
``docs`` and ``pyproject.toml`` (so relative paths work and outputs stay out of the tree),
with the test's Python first on ``PATH`` and ``src`` on ``PYTHONPATH`` (as after ``pip
install -e .``); whatever a block left running is killed with its process group. The
test ids name the file, line and commands.

A command that cannot run here is listed in ``NOT_ON_CPU`` with its reason (GPU only,
several nodes, installs packages, the test suite itself, rewrites committed files) and
shows up as a skipped test; a documented GPU command comes with a small CPU variant in the
same document where one makes sense. Blocks that take more than ~20 s on two cores are in
``FULL`` (``@pytest.mark.full``). A command that is neither in a ```bash block nor
allowed fails ``test_shell_commands_are_in_bash_blocks``; an entry of the lists that
matches no documented command fails ``test_lists_name_documented_commands``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINKED = ("src", "tests", "scripts", "examples", "docs", "pyproject.toml", "README.md")
TIMEOUT_S = 1800

_GPU = "GPU only (CUDA{}); its CPU variant is in the same document"
# Documented commands not run here: command (continuations joined, whitespace collapsed,
# trailing comment dropped) -> why.
NOT_ON_CPU = {
    "scripts/demo.sh": "installs packages (scripts/setup.sh: .venv, torch, the extras) before "
                       "its demo; the demo itself is `python -m hsdp demo`, run here",
    "scripts/test.sh": "the whole test suite, this test included (CI runs it)",
    "python -m hsdp bench collectives --mesh 2x4 --json c.json":
        _GPU.format(": 1 MiB-1 GiB buffers on 8 ranks"),
    "python -m hsdp bench step --mesh 2x4 --schedules overlap,serial,fsdp2,mfsdp --json s.json":
        _GPU.format(": Megatron-FSDP (mfsdp) is CUDA only"),
    "python -m hsdp bench step --emulate --mesh 16x8 --seq 4096":
        _GPU.format(": one GPU posing as 128 ranks, 8 Llama-8B layers"),
    "python -m hsdp bench step --emulate --schedules overlap,overlap-graph,fsdp2":
        _GPU.format(": CUDA graphs"),
    "python -m hsdp bench step --emulate --arch moe --ep 8 --seq 4096":
        _GPU.format(": Qwen3-30B-A3B-shaped blocks"),
    "python -m hsdp bench diloco --mesh 16x8 --outer-gbps 1,3":
        "hours on two cores (11 rows x 2 links, 50-step periods); its CPU variant is in the "
        "same document",
    "python -m hsdp bench quant --json q.json":
        _GPU.format(": the Triton kernels beside the eager ops"),
    "python -m hsdp sim calibrate s.json --collectives c.json --machine h200x2 --out p.json":
        _GPU.format(": calibrates from the GPU runs above (s.json, c.json)"),
    "python -m hsdp sim --profile p.json --model llama-70b --mesh 16x8 --seq 8192":
        _GPU.format(": prices with the GPU profile calibrated above"),
    "python -m hsdp bench step --emulate --mesh 16x8 --tp 8 --seq 4096 --inner-gbps 47":
        _GPU.format(": one GPU posing as 1024 ranks"),
    "torchrun --nnodes 16 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 "
    "train.py": "16 nodes (and the user's train.py)",
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 "
    "-m hsdp bench step --mesh 2x8 --schedules overlap,serial,fsdp2": "2 nodes of 8 GPUs",
    "srun torchrun --nnodes $SLURM_JOB_NUM_NODES --nproc-per-node 8 --rdzv-backend c10d "
    "--rdzv-endpoint $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1):29500 train.py":
        "a SLURM allocation of 4 nodes",
    "pip install -e . && pip install --no-deps $(python -c \"import tomllib; print(' '.join("
    "tomllib.load(open('pyproject.toml','rb'))['project']['optional-dependencies']"
    "['torchtitan']))\")": "installs packages (the test environment has them)",
    "torchrun --nproc-per-node 8 -m torchtitan.train "
    "--module hsdp.integrations.torchtitan --config llama3_debugmodel "
    "--parallelism.data_parallel_replicate_degree 2 --hsdp.strategy hsdp":
        _GPU.format(": torchtitan 0.3.0 has no CPU device"),
    "torchrun --nproc-per-node 8 -m torchtitan.train --module "
    "hsdp.integrations.torchtitan --config deepseek_v3_debugmodel "
    "--parallelism.data_parallel_replicate_degree 2 --parallelism.expert_parallel_degree 2 "
    "--training.disable_cuda_graphs": _GPU.format(": torchtitan 0.3.0 has no CPU device"),
    "python scripts/when_overlap_pays.py --note 'On the runs made on the profile'\"'\"'s own "
    "host, 14 of 16 held-out schedules within 5 %, the worst -5.8 % (compute at seq 1024); "
    "the -27.8 % is a run on another host, a one-GPU machine whose host issued the step up to "
    "1.8x slower (host time is not modelled per host).'":
        "rewrites the committed page, figures and JSON (docs/when_overlap_pays.md)",
}
# Blocks (named by one of their commands) that take more than ~20 s on two cores.
FULL = {
    "python -m hsdp demo",
    "python -m hsdp sim --model llama-8b --sweep nodes=2,8,32,128 "
    "outer_gbps=12.5,25,50,100",
    "python -m hsdp sim --model llama-70b --tp 8 --mesh 2x8 --inner-gbps 47 "
    "--sweep nodes=2,4,8,16",
    "python scripts/torchtitan_gpu.py assets /tmp/titan_assets",
    "python -m hsdp bench collectives --device cpu --mesh 2x2 --sizes 64KiB,256KiB --iters 3 "
    "--warmup 1 --json c.json",
    "torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 &",
    "python -m hsdp advise --model llama-8b --mesh 2x4",
}
# The start of a line that is a shell command (outside ```bash blocks: a convention breach).
SHELL_START = re.compile(r"(python|torchrun|pip|scripts/|torchft_lighthouse|srun|export |"
                         r"[A-Z][A-Z0-9_]*=\S*\s)")


@dataclass(frozen=True)
class Command:
    path: str  # relative to the repository
    line: int  # 1-based line of its first physical line
    text: str  # as written, continuation lines joined
    block: int  # line of the block's opening fence

    @property
    def key(self) -> str:
        """The command without its trailing comment, whitespace collapsed."""
        return " ".join(re.split(r"\s#\s", self.text)[0].split())


def _logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(line number, text) with ``\\`` continuations joined."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for n, text in lines:
        if pending is not None:
            n, text = pending[0], pending[1] + " " + text.strip()
        if text.rstrip().endswith("\\"):
            pending = (n, text.rstrip()[:-1].rstrip())
        else:
            pending = None
            out.append((n, text))
    return out


def documented_commands() -> list[Command]:
    commands = []
    for path in DOCS:
        rel = str(path.relative_to(ROOT))
        block, body = None, []
        for n, text in enumerate(path.read_text().splitlines(), 1):
            if block is None and text.strip() == "```bash":
                block, body = n, []
            elif block is not None and text.strip() == "```":
                commands += [Command(rel, ln, t.strip(), block) for ln, t in
                             _logical_lines(body) if t.strip() and not t.strip().startswith("#")]
                block = None
            elif block is not None:
                body.append((n, text))
    return commands


def shell_lines_outside_bash_blocks() -> list[str]:
    """``path:line: text`` of command-like lines in indented or non-bash fenced blocks."""
    found = []
    for path in DOCS:
        rel, fence = str(path.relative_to(ROOT)), None
        for n, text in enumerate(path.read_text().splitlines(), 1):
            if text.strip().startswith("```"):
                fence = None if fence is not None else text.strip()[3:]
                continue
            code = (text[4:] if fence is None and text.startswith("    ") else
                    text if fence not in (None, "bash", "python") else None)
            if code is not None and SHELL_START.match(code.strip()):
                found.append(f"{rel}:{n}: {code.strip()}")
    return found


COMMANDS = documented_commands()


def _blocks() -> list:
    """One pytest param per block's runnable commands, one skipped param per command of
    NOT_ON_CPU."""
    params, blocks = [], {}
    for c in COMMANDS:
        if c.key in NOT_ON_CPU:
            params.append(pytest.param([c], id=f"{c.path}:{c.line}: {c.key}",
                                       marks=pytest.mark.skip(reason=NOT_ON_CPU[c.key])))
        else:
            blocks.setdefault((c.path, c.block), []).append(c)
    for (path, _), cmds in blocks.items():
        marks = [pytest.mark.full] if any(c.key in FULL for c in cmds) else []
        params.append(pytest.param(cmds, marks=marks, id=f"{path}:{cmds[0].line}: " +
                                   " ; ".join(c.key for c in cmds)))
    return params


def test_shell_commands_are_in_bash_blocks():
    assert shell_lines_outside_bash_blocks() == []


def test_lists_name_documented_commands():
    keys = {c.key for c in COMMANDS}
    assert len(COMMANDS) > 20, COMMANDS
    assert sorted(set(NOT_ON_CPU) - keys) == [] and sorted(FULL - keys) == []


@pytest.mark.parametrize("commands", _blocks())
def test_documented_commands_run_as_written(commands: list[Command], tmp_path):
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=str(tmp_path / "src"), OMP_NUM_THREADS="1", COLUMNS="200")
    script = "set -e\n" + "\n".join(c.text for c in commands)
    log = tmp_path / "output.log"
    with open(log, "w") as f:  # a file, not a pipe: a background process may keep it open
        proc = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=TIMEOUT_S)
    finally:
        try:  # what the block left running (a lighthouse sent to the background)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    where = f"{commands[0].path}:{commands[0].line}"
    assert rc == 0, f"{where}: exit {rc}\n{log.read_text()[-6000:]}"
