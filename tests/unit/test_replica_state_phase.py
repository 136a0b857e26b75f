"""``hsdp.fault_tolerance`` reads the model's phase from its runtime: refused inside a
forward or backward, accepted between steps (after the first forward too)."""

from types import SimpleNamespace

import pytest
import torch.nn as nn

from hsdp.checkpoint import replica_state
from hsdp.runtime.step import Phase, Step


class _Manager:
    def __init__(self) -> None:
        self.registered: list[str] = []

    def register_state_dict_fn(self, key, load, save) -> None:
        self.registered.append(key)


@pytest.mark.parametrize("phase", list(Phase))
def test_fault_tolerance_follows_the_runtime_phase(monkeypatch, phase):
    manager = _Manager()
    monkeypatch.setattr(replica_state, "comm_groups",
                        lambda mesh: SimpleNamespace(elastic=SimpleNamespace(manager=manager)))
    model = nn.Linear(2, 2)
    model._hsdp_unit = SimpleNamespace(mesh=None, groups=[],
                                       runtime=SimpleNamespace(step=Step(phase=phase)))
    if phase in (Phase.FORWARD, Phase.BACKWARD):
        with pytest.raises(RuntimeError, match="during forward or backward"):
            replica_state.fault_tolerance(model, None)
        assert manager.registered == []
    else:
        assert replica_state.fault_tolerance(model, None) is manager
        assert manager.registered == ["hsdp"]
