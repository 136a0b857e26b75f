"""A torchtitan config module for tests/dist/test_torchtitan.py's trainer test: torchtitan's own
``torchtitan.train`` main runs ``--module titan_cpu_configs --config {hsdp,fsdp2}_debugmodel``
on CPU gloo ranks. The configs are torchtitan's ``llama3_debugmodel`` with SDPA attention
(flex has no CPU backward), fp32, and AdamW at eps=0.1 (torchtitan_jobs.py says why);
``hsdp_moe_debugmodel`` is ``deepseek_v3_debugmodel`` (its first 3 blocks: 2 MoE) alike,
for ``--parallelism.expert_parallel_degree``.

torchtitan 0.3.0 has no CPU device: it takes ``cuda`` wherever no accelerator is found, and
its memory monitor needs a CUDA-like device module. Importing this module (torchtitan's
ConfigManager does, before building the trainer) points its device globals at CPU, with
host memory (peak RSS) standing in for device memory; and it needs a torch newer than
2.13 (see below)."""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import resource
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torchtitan.components.metrics as titan_metrics
import torchtitan.distributed.parallel_dims as titan_dims
import torchtitan.distributed.utils as titan_dist
import torchtitan.tools.utils as titan_utils
from torch.distributed.fsdp import FSDPModule
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3
from torchtitan.models.llama3 import parallelize_llama as fsdp2_parallelize_llama
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from hsdp.integrations.torchtitan import with_hsdp


class _CpuDevice:
    """torch.cpu with the calls torchtitan's trainer and memory monitor make of a device
    module; memory is this process's peak resident set."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0  # torch.cpu's is "cpu"; torchtitan passes it to barrier(device_ids=)

    @staticmethod
    def get_device_name(*_: object) -> str:
        return platform.processor() or "cpu"

    @staticmethod
    def get_device_properties(*_: object) -> SimpleNamespace:
        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE")
                               * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(*_: object) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak,
                "num_alloc_retries": 0, "num_ooms": 0}

    @staticmethod
    def reset_peak_memory_stats(*_: object) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


for _module in (titan_utils, titan_dist, titan_metrics):
    _module.device_type, _module.device_module = "cpu", _CpuDevice()
titan_dims.device_type = "cpu"
# torchtitan 0.3.0's trainer calls torch.distributed.set_timeout after its first step, a
# name newer than torch 2.13 (which has it as _set_pg_timeout).
if not hasattr(dist, "set_timeout"):
    dist.set_timeout = dist.distributed_c10d._set_pg_timeout


def _debugmodel(config_fn=llama3_debugmodel):
    cfg = config_fn()
    for layer in cfg.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg.training.dtype = "float32"
    cfg.training.mixed_precision_param = "float32"
    cfg.validator.enable = False
    cfg.parallelism.spmd_backend = "partial_dtensor"  # the DTensor path that hsdp takes
    cfg.optimizer = OptimizersContainer.Config(
        implementation="foreach",
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 0.01, "betas": (0.9, 0.95),
                                                         "eps": 0.1, "weight_decay": 0.1})])
    return cfg


def fsdp2_on_gloo(model, parallelize_fn=fsdp2_parallelize_llama, **kw):
    """torchtitan's FSDP2 ``parallelize_fn``; gloo has no PREMUL_SUM."""
    model = parallelize_fn(model, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return model


def fsdp2_debugmodel():
    cfg = _debugmodel()
    cfg.model_spec = dataclasses.replace(cfg.model_spec, parallelize_fn=fsdp2_on_gloo)
    return cfg


def _deepseek_v3_3_blocks():
    cfg = deepseek_v3_debugmodel()
    cfg.model_spec.model.layers = cfg.model_spec.model.layers[:3]
    return cfg


def fsdp2_moe_debugmodel():
    cfg = _debugmodel(_deepseek_v3_3_blocks)
    cfg.model_spec = dataclasses.replace(
        cfg.model_spec, parallelize_fn=functools.partial(fsdp2_on_gloo,
                                                         parallelize_fn=parallelize_deepseekv3))
    return cfg


hsdp_debugmodel = with_hsdp(_debugmodel)
hsdp_moe_debugmodel = with_hsdp(functools.partial(_debugmodel, _deepseek_v3_3_blocks))
