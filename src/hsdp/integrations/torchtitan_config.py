"""hsdp's section of torchtitan's (0.3.0) job config: ``--hsdp.strategy``,
``--hsdp.overlap_outer``, ``--hsdp.outer_reduce`` and ``--hsdp.outer_sync``, typed, listed
by ``--help`` and printed with the job config (``--debug.print_config``), through
torchtitan's own extension point: a ``Trainer.Config`` subclass returned by the config
function (``HsdpTrainer.Config``, which ``with_hsdp`` makes of torchtitan's config).

``HsdpTrainer`` is torchtitan's ``Trainer`` that hands its ``hsdp`` section to the model
spec's ``parallelize_fn`` (hsdp's ``parallelize_llama``, also under pipeline parallelism)
and logs once per job that hsdp is the data-parallel backend, with its settings. The
environment variables an older hsdp read instead (``HSDP_STRATEGY``, ...) are refused,
naming the option that replaces each: a setting is never silently ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Literal

import torch.distributed as dist
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from hsdp.runtime.outer_modes import parse_mode

# the environment variables an older hsdp read, and the options that replace them
_OLD_ENV = {"HSDP_STRATEGY": "--hsdp.strategy", "HSDP_OVERLAP_OUTER": "--hsdp.overlap_outer",
            "HSDP_OUTER_REDUCE": "--hsdp.outer_reduce", "HSDP_OUTER_SYNC": "--hsdp.outer_sync"}


def refuse_old_env() -> None:
    """Raise if an ``HSDP_*`` variable that an older hsdp read is set: it no longer takes
    effect, and the error names the job config option that does."""
    found = [f"{name}={os.environ[name]!r} (use {option})"
             for name, option in _OLD_ENV.items() if name in os.environ]
    if found:
        raise ValueError(f"hsdp: the torchtitan integration takes its settings from "
                         f"torchtitan's job config, not the environment: unset "
                         f"{', '.join(found)}")


@dataclass(kw_only=True, slots=True)
class HsdpConfig:
    """hsdp as torchtitan's data-parallel backend (``--hsdp.*``)."""

    strategy: Literal["hsdp", "hfsdp"] = "hsdp"
    """hfsdp also shards gradients and optimizer state over the outer axis."""

    overlap_outer: bool = True
    """Overlap the outer (cross-replica) reduction with the next units' backward."""

    outer_reduce: str = "none"
    """Compressed outer reduction: none, int8 or fp8_e4m3, with an optional :BLOCK (int8:128)."""

    outer_sync: str = "none"
    """DiLoCo on the outer axis: none, diloco or diloco:inner_steps=50,fragments=4,... (any
    field of hsdp.DiLoCo)."""

    def __post_init__(self) -> None:
        refuse_old_env()
        self.parsed()

    def parsed(self) -> dict[str, object]:
        """``parallelize_llama``'s keyword arguments; a bad value raises naming its option."""
        out: dict[str, object] = {"strategy": self.strategy, "overlap_outer": self.overlap_outer}
        for name in ("outer_reduce", "outer_sync"):
            try:
                out[name] = parse_mode(name, getattr(self, name))
            except ValueError as e:
                raise ValueError(f"hsdp: --hsdp.{name}: {e}") from None
        return out


class HsdpTrainer(Trainer):
    """torchtitan's trainer with an ``hsdp`` config section, handed to the model spec's
    ``parallelize_fn``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        hsdp: HsdpConfig = field(default_factory=HsdpConfig)

        def hsdp_model_spec(self) -> ModelSpec | None:
            """The model spec, its ``parallelize_fn`` given the ``hsdp`` settings (also
            under pipeline parallelism: ``pipelining_fn`` calls that one per stage)."""
            spec = self.model_spec
            return spec and dataclasses.replace(spec, parallelize_fn=functools.partial(
                spec.parallelize_fn, **self.hsdp.parsed()))

    def __init__(self, config: Config) -> None:
        config.model_spec = config.hsdp_model_spec()
        super().__init__(config)
        log_active(config.hsdp, self.model_parts, self.parallel_dims.ep,
                   self.parallel_dims.pp)


def as_hsdp_config(config: Trainer.Config) -> HsdpTrainer.Config:
    """torchtitan's trainer config with hsdp's section added (its defaults)."""
    if type(config) is not Trainer.Config:
        raise TypeError(f"hsdp's torchtitan integration adds its --hsdp section to "
                        f"torchtitan's Trainer.Config, not to {type(config).__qualname__} "
                        f"(a trainer of its own)")
    return HsdpTrainer.Config(**{f.name: getattr(config, f.name)
                                 for f in dataclasses.fields(config) if f.init})


def log_active(settings: HsdpConfig, model_parts: list, ep: int, pp: int) -> None:
    """One line in torchtitan's log (rank 0), once per job: hsdp is the data-parallel
    backend, on which mesh, with which strategy, outer reduction and outer sync."""
    unit = getattr(model_parts[0], "_hsdp_unit", None)  # none in a seed checkpoint's run
    if unit is None or dist.is_initialized() and dist.get_rank() != 0:
        return
    mesh = unit.mesh
    shape = " x ".join(f"{n} {s}" for n, s in zip(mesh.mesh_dim_names, mesh.shape))
    parsed = settings.parsed()
    logger.info(f"hsdp active (hsdp.integrations.torchtitan): strategy {settings.strategy}, "
                f"mesh {shape}{f' per stage of pp {pp}' if pp > 1 else ''}"
                f"{f', experts on ep {ep}' if ep > 1 else ''}, overlap_outer "
                f"{settings.overlap_outer}, outer_reduce {parsed['outer_reduce'] or 'none'}, "
                f"outer_sync {parsed['outer_sync'] or 'none'}")

