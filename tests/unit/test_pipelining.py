"""hsdp.pipelining.PipelineStage refuses what it cannot run, before anything is built."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

from hsdp.pipelining import PipelineStage


def test_stage_module_must_be_an_hsdp_root():
    with pytest.raises(ValueError, match="passed to hsdp.fully_shard last"):
        PipelineStage(nn.Linear(2, 2), 0, 2, torch.device("cpu"))
    inner = nn.Linear(2, 2)
    inner._hsdp_unit = types.SimpleNamespace(enclosing=object())  # a unit inside a model
    with pytest.raises(ValueError, match="root of the stage's sharded model"):
        PipelineStage(inner, 0, 2, torch.device("cpu"))


def test_split_backward_is_refused():
    root = nn.Linear(2, 2)
    root._hsdp_unit = types.SimpleNamespace(enclosing=None)
    with pytest.raises(NotImplementedError, match="split backwards"):
        PipelineStage(root, 0, 2, torch.device("cpu"), dw_builder=lambda: None)
