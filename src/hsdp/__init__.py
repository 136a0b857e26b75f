"""hsdp: hybrid-sharded data parallel with the DP-outer reduction on its own stream."""

from hsdp.api import (
    fully_shard,
    microbatch,
    precompute_float8_scales,
    synchronize,
)
from hsdp.checkpoint.dcp import load, save
from hsdp.checkpoint.full_state import full_state_dict, load_full_state_dict
from hsdp.checkpoint.replica_state import fault_tolerance
from hsdp.checkpoint.state_dicts import get_state_dict, set_state_dict
from hsdp.checkpoint.sync import CheckpointBusyError, CheckpointError
from hsdp.clip import clip_grad_norm_
from hsdp.ft.errors import FaultToleranceError
from hsdp.ft.outer import FaultTolerance
from hsdp.ft.transport import RecoveryTransport
from hsdp.materialize import materialize
from hsdp.module import register_forward_method
from hsdp.outer_auto import Auto, OuterChoice
from hsdp.runtime.diloco import DiLoCo
from hsdp.runtime.optim_hooks import attach_optimizer
from hsdp.sharding.outer_gather import OuterGather
from hsdp.sharding.outer_reduce import OuterReduce
from hsdp.sharding.policy import MixedPrecision, Strategy
from hsdp.topology.communicators import NcclConfig
from hsdp.topology.mesh import expert_mesh, init_mesh

__version__ = "0.1.0"

__all__ = [
    "Auto",
    "CheckpointBusyError",
    "CheckpointError",
    "DiLoCo",
    "FaultTolerance",
    "FaultToleranceError",
    "MixedPrecision",
    "OuterGather",
    "OuterChoice",
    "OuterReduce",
    "Strategy",
    "NcclConfig",
    "RecoveryTransport",
    "attach_optimizer",
    "clip_grad_norm_",
    "expert_mesh",
    "fault_tolerance",
    "full_state_dict",
    "fully_shard",
    "get_state_dict",
    "init_mesh",
    "load",
    "load_full_state_dict",
    "materialize",
    "microbatch",
    "precompute_float8_scales",
    "register_forward_method",
    "save",
    "set_state_dict",
    "synchronize",
]
