"""hsdp as torchtitan's data-parallel backend (``hsdp.integrations.torchtitan``): Llama3
``debugmodel`` on a 2x2 gloo mesh equals one process and torchtitan's FSDP2 path
(torchtitan_jobs.py). Needs the ``hsdp[torchtitan]`` extra (docs/guide/torchtitan.md)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan.train", reason="torchtitan is not installed: pip install "
                    "--no-deps per the hsdp[torchtitan] extra (docs/guide/torchtitan.md)")

from dist_utils import run_jobs, run_ranks  # noqa: E402

from hsdp.runtime.outer_modes import parse_mode  # noqa: E402
from torchtitan_jobs import (  # noqa: E402
    DILOCO_H1,
    MOE,
    _meta_model,
    checkpoint_job,
    extra_state_job,
    float8_parity_job,
    moe_job,
    parity_job,
    tp_parity_job,
)
from torchtitan_pp_jobs import pp_job, reference  # noqa: E402


TESTS = str(Path(__file__).resolve().parents[1])  # the job and config modules
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def jobs_4(tmp_path_factory) -> dict[str, list[dict]]:
    """The 4-rank jobs, in ONE spawned world (process start-up dominates on two cores)."""
    return run_jobs(4, {"parity": (parity_job, ()),
                        "checkpoint": (checkpoint_job, (str(tmp_path_factory.mktemp("ckpt")),)),
                        "float8": (float8_parity_job, ())})


@pytest.mark.full
def test_llama3_debugmodel_matches_one_process_and_fsdp2(jobs_4):
    per_rank = jobs_4["parity"]
    assert len(per_rank[0]) == 19
    # outer_sync's DiLoCo took effect (H=1: synchronous, its own key below)
    for r in per_rank:
        assert r.pop("hsdp+diloco schedule") == repr(parse_mode("outer_sync", DILOCO_H1)), r
    # int8 outer reduction (outer_reduce's): close, and not exact
    compressed = {k for k in per_rank[0] if "+int8" in k and "init" not in k}
    bad = {k: e for r in per_rank for k, e in r.items()
           if not (1e-5 < e < 2e-2 if k in compressed else e < 1e-5)}
    assert not bad, bad


@pytest.mark.full
def test_tensor_parallel_degree_2_matches_one_process_and_fsdp2_tp():
    """tensor_parallel_degree 2 on a (2, 2, 2) gloo mesh: torchtitan's own TP plan (with
    sequence parallel: 32 weights sharded over tp, every block's 5 linears, the embedding
    and the output head; the norms replicated), then hsdp on the 3-D mesh (meta build,
    init_weights through hsdp.materialize, which keeps TP's RoPE cache a DTensor as
    torchtitan's init_states does), starts equal to one process and trains equal to it
    and to torchtitan's FSDP2 + TP path. The sharding specs come from the model config's
    ``update_from_config`` (torchtitan's trainer calls it): without them ``parallelize``
    applies no TP but the embedding still takes the tp group and looks tokens up
    vocab-parallel in its unsharded table (tp rank 1 shifted by 1024), which put FSDP2
    and hsdp alike 0.34 from one process."""
    per_rank = run_ranks(tp_parity_job, 8)
    assert len(per_rank[0]) == 10
    for r in per_rank:
        sharded = {k: r.pop(k) for k in list(r) if k.endswith("tp-sharded")}
        assert sharded == dict.fromkeys(sharded, 32) and len(sharded) == 3, sharded
        bad = {k: e for k, e in r.items() if not e < 1e-5}
        assert not bad, bad


@pytest.mark.full
def test_pipeline_parallel_degree_2_matches_one_process_and_fsdp2_pp(tmp_path):
    """pipeline_parallel_degree 2 x (outer 2 x inner 2) on 8 gloo ranks through torchtitan's
    ``pipeline_llm`` split and its schedules, hsdp's ``pipeline_llama`` as the model spec's
    ``pipelining_fn`` (torchtitan_pp_jobs.py): 1F1B (hsdp with AC) and
    Interleaved1F1B train 10 steps, clipped over both stages (torchtitan's
    ``clip_grad_norm_`` with the pp mesh; every step's norm above the limit), equal to one
    process and to torchtitan's FSDP2 + PP; a CheckpointManager resume is bit for bit; the
    pp 2 checkpoint resumes at pp 1 (outer 2 x inner 4) and trains on equal to pp 2. pp 2
    x tp 2 x (outer 1 x inner 2) (torchtitan's TP plan on each stage, then hsdp on the
    stage's 3-D mesh) trains equal to one process on the batches of 2 DP ranks."""
    init, want = reference()
    per_rank = run_ranks(pp_job, 8, str(tmp_path), init, want, reference(dp=2)[1])
    assert len(per_rank[0]) == 10
    for r in per_rank:
        assert r.pop("resume equal"), r
        norms = {k: r.pop(k) for k in list(r) if k.endswith("max grad norm")}
        assert all(n > 0.5 for n in norms.values()), norms
        bad = {k: e for k, e in r.items() if not e < 1e-5}
        assert not bad, bad


@pytest.fixture(scope="module")
def extra_state(tmp_path_factory) -> list[dict]:
    return run_ranks(extra_state_job, 4, str(tmp_path_factory.mktemp("extra")))


@pytest.mark.full
def test_checkpoint_manager_carries_the_residual_and_diloco_state(extra_state):
    """int8 (error feedback) resumes through torchtitan's CheckpointManager bit for bit,
    and its checkpoints hold the residual and the DiLoCo keys: once they had neither and
    the int8 resume was off at the next step."""
    for r in extra_state:
        assert r["int8 resume equal"] and r["int8 keys saved"] and r["diloco keys saved"], r


@pytest.mark.full
def test_checkpoint_manager_resumes_diloco_mid_period_bit_for_bit(extra_state):
    """Saved in the middle of a DiLoCo period, every outer replica resumes with its own
    parameters: once torchtitan's model load (after the optimizer's, FusedQKVLinear's
    merge writing the checkpoint's replica-0 wqkv) left replicas other than 0 off."""
    for r in extra_state:
        assert r["diloco resume equal"], r


@pytest.mark.full
def test_checkpoint_manager_resumes_bit_for_bit_and_crosses_with_fsdp2(jobs_4):
    per_rank = jobs_4["checkpoint"]
    for r in per_rank:
        assert r["hsdp resume equal"] and r["hfsdp resume equal"], r
        assert r["hsdp async resume equal"], r  # once: "cannot pickle 'ProcessGroup'"
        bad = {k: e for k, e in r.items() if not isinstance(e, bool) and not e < 1e-5}
        assert not bad, bad


# What the CPU recipe of docs/guide/torchtitan.md passes as this test does.
CPU_RECIPE = ["--module", "titan_cpu_configs", "--training.seq_len", "64",
              "--training.local_batch_size", "2"]


def _trainer(out: Path, config: str, nproc: int, *args: str,
             log: list[str] | None = None) -> dict[int, tuple[float, ...]]:
    """torchtitan's own ``torchtitan.train`` main on ``nproc`` gloo ranks with
    ``--module titan_cpu_configs --config CONFIG``; (loss, grad norm) per step. ``log``
    gets its output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, str(ROOT / "src")]),
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(out / "hf"),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nproc), "-m", "torchtitan.train", *CPU_RECIPE[:2],
           "--config", config, "--hf_assets_path", str(out / "assets" / "tokenizer"),
           "--dataloader.dataset_path", str(out / "assets" / "data"),
           "--debug.seed", "0", *CPU_RECIPE[2:], "--metrics.log_freq", "1",
           "--metrics.disable_color_printing",
           "--checkpoint.enable", "--checkpoint.folder", "ckpt", *args]
    run = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    if log is not None:
        log.append(run.stdout + run.stderr)
    steps = {int(m[1]): (float(m[2]), float(m[3])) for m in re.finditer(
        r"step:\s*(\d+)\s+loss:\s*([-\d.]+)\s+grad_norm:\s*([-\d.]+)\s+memory:\s*[\d.]+GiB"
        r".*tps: [1-9]", run.stdout + run.stderr)}
    return steps


def test_guide_gives_the_cpu_recipe_of_this_test():
    """The guide's torchtitan command needs GPUs (on CPU torchtitan stops in its own
    ``_cuda_setDevice``); the CPU recipe it gives is the one the trainer test below runs."""
    guide = (ROOT / "docs" / "guide" / "torchtitan.md").read_text()
    block = guide[guide.index("On\nCPU (gloo)"):].split("\n\n")[1]
    words = block.replace("\\\n", " ").split()
    assert "scripts/torchtitan_gpu.py assets" in guide and "PYTHONPATH=tests:src" in words
    assert words[words.index("-m") + 1] == "torchtitan.train"
    at = [words.index(w) for w in CPU_RECIPE[::2]]
    assert [words[i + 1] for i in at] == CPU_RECIPE[1::2] and "_cuda_setDevice" in guide


def test_torchtitan_trainer_main_trains_with_hsdp_from_its_cli(tmp_path):
    """torchtitan's trainer main, configured only through its CLI and a config module
    (``hsdp.integrations.torchtitan.with_hsdp``), trains with hsdp on a 2x2 gloo mesh: 4
    steps logged with their metrics (memory, tokens/s), finite losses that change. hsdp's
    settings come from the command line: the printed job config shows them and hsdp's one
    line says it is active with them, once per job. Its numbers against torchtitan's
    FSDP2: ``test_torchtitan_trainer_main_with_hsdp_matches_its_fsdp2`` (full tier)."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "torchtitan_gpu.py"), "assets",
                    str(tmp_path / "assets")], check=True)
    log: list[str] = []
    got = _trainer(tmp_path, "hsdp_debugmodel", 4, "--training.steps", "4",
                   "--parallelism.data_parallel_replicate_degree", "2",
                   "--parallelism.data_parallel_shard_degree", "2", "--hsdp.no-overlap_outer",
                   "--debug.print_config", "--dump_folder", "hsdp", log=log)
    assert sorted(got) == [1, 2, 3, 4], got
    assert all(math.isfinite(loss) and norm > 0 for loss, norm in got.values()), got
    assert len({loss for loss, _ in got.values()}) == 4, got  # the weights change
    _assert_settings_logged(log[0])


@pytest.mark.full
def test_torchtitan_trainer_main_with_hsdp_matches_its_fsdp2(tmp_path):
    """The same trainer main, hsdp and torchtitan's FSDP2 from one seed checkpoint (hsdp's
    ``init_weights`` draws other random values than torchtitan's): hsdp logs the losses
    and gradient norms of the FSDP2 run (to the 5 decimals it prints)
    (``--hsdp.no-overlap_outer``: the same numbers)."""
    log: list[str] = []
    _trainer_equals_fsdp2(tmp_path, "debugmodel", hsdp_args=["--hsdp.no-overlap_outer",
                                                             "--debug.print_config"], log=log)
    _assert_settings_logged(log[0])


def _assert_settings_logged(text: str) -> None:
    """hsdp's settings of ``--hsdp.no-overlap_outer`` in the printed job config and in
    hsdp's one line, once."""
    said = re.findall(r"hsdp active \(hsdp.integrations.torchtitan\): .*", text)
    assert said == ["hsdp active (hsdp.integrations.torchtitan): strategy hsdp, mesh outer 2 "
                    "x inner 2, overlap_outer False, outer_reduce none, outer_sync none"], said
    printed = re.search(r'"hsdp": (\{[^}]*\})', text)
    assert printed and json.loads(printed[1]) == {
        "strategy": "hsdp", "overlap_outer": False, "outer_reduce": "none",
        "outer_sync": "none"}, text[-3000:]


@pytest.mark.full
def test_torchtitan_trainer_main_runs_hsdp_with_expert_parallel(tmp_path):
    """The same CLI with DeepSeek-V3 (3 blocks, 2 MoE) and ``expert_parallel_degree`` 2 on
    2x2 ranks: the trainer trains (4 steps logged with their metrics, the loss moves). Its
    numbers against one process and torchtitan's FSDP2 on this configuration are
    ``test_deepseek_v3_expert_parallel_matches_one_process_and_fsdp2``'s."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "torchtitan_gpu.py"), "assets",
                    str(tmp_path / "assets")], check=True)
    got = _trainer(tmp_path, "hsdp_moe_debugmodel", 4, "--training.steps", "4",
                   "--parallelism.data_parallel_replicate_degree", "2",
                   "--parallelism.data_parallel_shard_degree", "2",
                   "--parallelism.expert_parallel_degree", "2",
                   "--training.disable_cuda_graphs", "--dump_folder", "hsdp")
    assert sorted(got) == [1, 2, 3, 4], got
    assert all(math.isfinite(loss) and norm > 0 for loss, norm in got.values()), got
    assert len({loss for loss, _ in got.values()}) == 4, got  # the weights change


def _trainer_equals_fsdp2(tmp_path: Path, model: str, *args: str, hsdp_args: list[str],
                          log: list[str]) -> None:
    """``hsdp_<model>`` (with ``hsdp_args``; its output appended to ``log``) and
    ``fsdp2_<model>`` 4 steps on 2x2 ranks from one seed checkpoint."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "torchtitan_gpu.py"), "assets",
                    str(tmp_path / "assets")], check=True)
    _trainer(tmp_path, f"hsdp_{model}", 1, "--checkpoint.create_seed_checkpoint",
             "--dump_folder", "seed")
    mesh = ["--checkpoint.initial_load_path", str(tmp_path / "seed" / "ckpt" / "step-0"),
            "--training.steps", "4", "--parallelism.data_parallel_replicate_degree", "2",
            "--parallelism.data_parallel_shard_degree", "2", *args]
    got = _trainer(tmp_path, f"hsdp_{model}", 4, *mesh, *hsdp_args, "--dump_folder", "hsdp",
                   log=log)
    want = _trainer(tmp_path, f"fsdp2_{model}", 4, *mesh, "--dump_folder", "fsdp2")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    # Values a float ulp apart can print one unit apart in the 5th decimal when they sit
    # on a rounding boundary (seen once: 8.18448 vs 8.18447), so one printed unit is allowed.
    for step, (loss, norm) in want.items():
        assert got[step] == pytest.approx((loss, norm), abs=1.5e-5), (step, got, want)


@pytest.mark.full
@pytest.mark.xfail(strict=True, reason="hsdp's float8 all-gather and converter runs end "
                   "7.3e-4 from FSDP2's (both within the one-process bound); seen on a "
                   "fresh checkout, not yet explained")
def test_float8_converters_match_one_process_and_fsdp2(jobs_4):
    """A model converted by hsdp's torchtitan float8 converter (float8 all-gather) and by
    torchtitan's own (high-precision all-gather) trains under ``parallelize_llama``
    (both strategies) to the one-process float8 result and torchtitan's FSDP2 one after
    a step; after 5 steps hsdp (FSDP2's reduction order) still equals FSDP2, while float8
    rounding has amplified reduction-order noise for the rest (torchtitan_jobs.py):
    hfsdp stays as close to one process as FSDP2 is. The float8 all-gather covers all 31
    float8 linears (6 blocks x 5, and the output head)."""
    per_rank = jobs_4["float8"]
    for r in per_rank:
        assert r.pop("hsdp float8 all-gather float8 weights") == 31, r
        assert r.pop("hfsdp float8 all-gather float8 weights") == 31, r
        assert r.pop("hsdp torchtitan converter float8 weights") == 0, r
        fsdp2_drift = r.pop("fsdp2 last vs ref")
        assert r.pop("hfsdp float8 all-gather last vs ref") < 2 * fsdp2_drift, r
        for k in [k for k in r if k.endswith("last vs ref") or k.startswith("hfsdp")
                  and k.endswith("last vs fsdp2")]:
            r.pop(k)
        bad = {k: e for k, e in r.items() if not e < 1e-5}
        assert not bad, bad


def _refused_before_sharding(model, training, match: str, tp: int = 1, ep: int = 1) -> None:
    """hsdp's ``parallelize_llama`` on a 2x2 (x tp) mesh raises ``match`` with nothing
    sharded."""
    from torchtitan.config import CompileConfig, ParallelismConfig
    from torchtitan.distributed import ParallelDims

    from hsdp.integrations import torchtitan as hsdp_titan

    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=tp, pp=1, ep=ep,
                        world_size=4 * tp, spmd_backend="partial_dtensor")
    with pytest.raises(ValueError, match=match):
        hsdp_titan.parallelize_llama(
            model, parallel_dims=dims, training=training,
            parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
            compile_config=CompileConfig(), ac_config=None, dump_folder="")
    assert not any(hasattr(m, "_hsdp_unit") for m in model.modules())


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"])
def test_split_backward_pipeline_schedules_are_refused_before_splitting(schedule):
    """Zero-bubble schedules split each backward into input and weight parts, which hsdp
    cannot reduce from its hooks: ``pipeline_llama`` names the schedule before it splits
    or shards anything; ``parallelize_llama`` under PP without its stage mesh says to use
    ``pipeline_llama``."""
    from torchtitan.config import ParallelismConfig

    from hsdp.integrations import torchtitan as hsdp_titan
    from hsdp.integrations.torchtitan_pipeline import pipeline_llama

    model = _meta_model()
    parallelism = ParallelismConfig(pipeline_parallel_degree=2,
                                    pipeline_parallel_schedule=schedule)
    with pytest.raises(ValueError, match=f"pipeline schedule '{schedule}' .*input and weight"):
        pipeline_llama(model, parallel_dims=None, parallelism=parallelism,
                       parallelize_fn=hsdp_titan.parallelize_llama)
    assert not any(hasattr(m, "_hsdp_unit") for m in model.modules())


def test_mx_converted_model_is_refused_before_sharding():
    """torchtitan's MX / NVFP4 converters rely on FSDP2's all-gather hooks, which hsdp does
    not provide for them: a clear error, with nothing sharded."""
    from torchtitan.config import TrainingConfig

    model = _meta_model()
    ffn = model.layers["0"].feed_forward
    # stands for torchao's MX / NVFP4 linears (torchao modules other than Float8Linear)
    ffn.w1.__class__ = type("NVFP4Linear", (type(ffn.w1),),
                            {"__module__": "torchao.prototype.mx_formats"})
    _refused_before_sharding(model, TrainingConfig(), "float8 linears only, not NVFP4Linear")


@pytest.mark.full
def test_deepseek_v3_expert_parallel_matches_one_process_and_fsdp2(tmp_path):
    """``expert_parallel_degree`` 2 on (dp_replicate, dp_shard) = (2, 4): each MoE block's
    experts in an hsdp unit on the (2, 2, 2) expert mesh, nested in the block's (2 such
    units), start equal to one process and after 10 steps (torchtitan's load balancing on)
    equal it and torchtitan's FSDP2 path, hsdp and hfsdp with activation checkpointing; a
    resume from step 5 through ``CheckpointManager`` equals the uninterrupted run bit for
    bit, the expert biases included."""
    for r in run_ranks(moe_job, 8, str(tmp_path)):
        assert r.pop("hsdp resume equal"), r
        assert r.pop("hsdp ac=False biases moved") and r.pop("hfsdp ac=True biases moved")
        units = {k: r.pop(k) for k in list(r) if k.endswith("expert units")}
        assert units == dict.fromkeys(units, 2) and len(units) == 2, units
        bad = {k: e for k, e in r.items() if not e < 1e-5}
        assert len(r) == 7 and not bad, r


def test_expert_with_tensor_parallel_is_refused_before_sharding():
    from torchtitan.config import TrainingConfig

    _refused_before_sharding(_meta_model(arch=MOE), TrainingConfig(),
                             "expert_parallel_degree > 1 with tensor_parallel_degree > 1",
                             tp=2, ep=2)


def test_cuda_graphs_stay_on_in_hsdps_configs(monkeypatch):
    """torchtitan captures forward + backward in a CUDA graph on CUDA unless
    ``training.disable_cuda_graphs``; hsdp can be captured (docs/guide/cuda_graphs.md), so
    its configs keep torchtitan's default and ``parallelize_llama`` accepts it. Without CUDA
    they turn it off: torchtitan refuses CUDA graphs with pipeline or expert parallelism
    even on CPU (the guides' CPU commands would fail)."""
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    from hsdp.integrations import torchtitan as hsdp_titan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert hsdp_titan.deepseek_v3_debugmodel().training.disable_cuda_graphs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not hsdp_titan.llama3_debugmodel().training.disable_cuda_graphs
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=4,
                        spmd_backend="partial_dtensor")
    hsdp_titan._check_supported(_meta_model(), dims, TrainingConfig(disable_cuda_graphs=False),
                                ParallelismConfig(spmd_backend="partial_dtensor"), None)


def _parse(*args: str):
    """torchtitan's ``ConfigManager`` on hsdp's config module (as ``torchtitan.train``)."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--module", "hsdp.integrations.torchtitan",
                                       "--config", "llama3_debugmodel", *args])


SETTINGS = ["--hsdp.no-overlap_outer", "--hsdp.outer_reduce", "int8:16", "--hsdp.outer_sync",
            "diloco:inner_steps=5,fragments=1"]


def test_hsdp_settings_are_a_typed_section_of_torchtitans_job_config(capsys):
    """``--hsdp.*`` are torchtitan job config options: listed by ``--help``, parsed into
    the config (printed with it: ``to_dict``), a bad value refused at parse time naming
    its option."""
    import hsdp

    with pytest.raises(SystemExit):
        _parse("--help")
    shown = " ".join(capsys.readouterr().out.split())
    for option in ("hsdp options", "--hsdp.strategy {hsdp,hfsdp}", "--hsdp.no-overlap-outer",
                   "--hsdp.outer-reduce STR", "--hsdp.outer-sync STR", "(default: none)"):
        assert option in shown, option
    cfg = _parse("--hsdp.strategy", "hfsdp", *SETTINGS)
    assert cfg.to_dict()["hsdp"] == {"strategy": "hfsdp", "overlap_outer": False,
                                     "outer_reduce": "int8:16",
                                     "outer_sync": "diloco:inner_steps=5,fragments=1"}
    assert cfg.hsdp.parsed() == {"strategy": "hfsdp", "overlap_outer": False,
                                 "outer_reduce": hsdp.OuterReduce("int8", 16),
                                 "outer_sync": hsdp.DiLoCo(5, 1)}
    assert _parse("--hsdp.outer_sync", "diloco:inner_steps=50,fragments=4,outer_lr=0.5,"
                  "nesterov=false,delay=2").hsdp.parsed()["outer_sync"] == hsdp.DiLoCo(
        50, 4, outer_lr=0.5, nesterov=False, delay=2)
    for option, bad, match in (
            ("strategy", "zero3", "invalid choice 'zero3'"),
            ("outer_reduce", "int4", "--hsdp.outer_reduce: hsdp.OuterReduce: unknown dtype"),
            ("outer_sync", "local_sgd", "--hsdp.outer_sync: .*expected none or diloco"),
            ("outer_sync", "diloco:steps=5", "--hsdp.outer_sync: .*FIELD one of inner_steps"),
            ("outer_sync", "diloco:inner_steps=0", "inner_steps must be an int >= 1")):
        with pytest.raises(SystemExit):
            _parse(f"--hsdp.{option}", bad)
        said = " ".join(capsys.readouterr().err.replace("│", " ").split())
        assert re.search(match, said), (option, bad, said)


@pytest.mark.parametrize("name,value,option", [
    ("HSDP_STRATEGY", "hfsdp", "--hsdp.strategy"),
    ("HSDP_OVERLAP_OUTER", "0", "--hsdp.overlap_outer"),
    ("HSDP_OUTER_REDUCE", "int8", "--hsdp.outer_reduce"),
    ("HSDP_OUTER_SYNC", "diloco", "--hsdp.outer_sync")])
def test_old_environment_variables_are_refused_naming_the_option(monkeypatch, name, value,
                                                                 option):
    """An ``HSDP_*`` variable that an older hsdp read no longer takes effect: set, it stops
    the config and a direct ``parallelize_llama`` (nothing sharded), naming its option."""
    from torchtitan.config import TrainingConfig

    from hsdp.integrations import torchtitan as hsdp_titan

    monkeypatch.setenv(name, value)
    want = re.escape(f"unset {name}={value!r} (use {option})")
    with pytest.raises(ValueError, match=want):
        hsdp_titan.llama3_debugmodel()
    _refused_before_sharding(_meta_model(), TrainingConfig(), want)


def test_trainer_gives_each_stage_its_hsdp_settings_and_logs_them_once(caplog):
    """The trainer's model spec (``HsdpTrainer.Config.hsdp_model_spec``) runs
    ``parallelize_llama`` with the parsed ``--hsdp.*`` settings: called twice, as
    ``pipeline_llama`` does for two stages of a rank, each model takes them; the
    parallelize calls log nothing and ``log_active`` (the trainer's, once per job) logs one
    line (rank 0) with the mesh, strategy, outer reduction and outer sync."""
    import logging

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed import ParallelDims

    from hsdp.integrations.torchtitan_config import log_active

    def parallelize(cfg):  # as torchtitan's trainer calls the model spec's
        return cfg.hsdp_model_spec().parallelize_fn(
            _meta_model(), parallel_dims=dims, training=cfg.training,
            parallelism=cfg.parallelism, compile_config=cfg.compile, ac_config=None,
            dump_folder="")

    cfg = _parse(*SETTINGS)
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=4,
                            spmd_backend="partial_dtensor")
        with caplog.at_level(logging.INFO):
            parts = [parallelize(cfg) for _ in range(2)]
            assert not [r for r in caplog.records if "hsdp" in r.getMessage()]
            log_active(cfg.hsdp, parts, ep=1, pp=2)
        # the strategy and DiLoCo reach fully_shard: it refuses the two together
        with pytest.raises(ValueError, match="strategy='hfsdp' cannot train with outer_sync"):
            parallelize(_parse("--hsdp.strategy", "hfsdp", "--hsdp.outer_sync", "diloco"))
    finally:
        dist.destroy_process_group()
    for m in parts:
        said = m._hsdp_unit.description[0]
        assert "strategy='hsdp'" in said and "overlap_outer=False" in said, said
        assert "outer_reduce=OuterReduce(dtype='int8', block=16" in said, said
    lines = [r.getMessage() for r in caplog.records if "hsdp" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "hsdp active" in lines[0] and "mesh outer 2 x inner 2 per stage of pp 2" in lines[0]
    assert "strategy hsdp" in lines[0] and "overlap_outer False" in lines[0], lines
    assert "outer_reduce OuterReduce(dtype='int8', block=16" in lines[0], lines
    assert "outer_sync DiLoCo(inner_steps=5, fragments=1" in lines[0], lines
