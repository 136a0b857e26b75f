"""hsdp_tools.models: parameter counts, presets on meta, causality, configs from JSON."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hsdp_tools.models import (
    PRESETS,
    GPTConfig,
    LlamaConfig,
    build_model,
    config_from_dict,
    lm_loss,
    preset,
)

SMALL = [GPTConfig(), LlamaConfig(), LlamaConfig(kv_heads=4, checkpoint="reentrant")]


@pytest.mark.parametrize("cfg", SMALL, ids=["gpt", "llama", "llama-mha-checkpoint"])
def test_param_counts_and_backward(cfg):
    torch.manual_seed(0)
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params
    assert [sum(p.numel() for p in b.parameters()) for b in model.blocks] == (
        [cfg.block_params] * cfg.layers)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq))
    lm_loss(model(tokens), tokens).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters()
               if p is not getattr(model, "pos", None))


@pytest.mark.parametrize("cfg", SMALL[:2], ids=["gpt", "llama"])
def test_causal(cfg):
    """A position's logits do not depend on later tokens (causal attention, RoPE on q/k)."""
    torch.manual_seed(0)
    model = build_model(cfg)
    a = torch.randint(0, cfg.vocab, (1, cfg.seq))
    b = a.clone()
    b[0, -1] = (a[0, -1] + 1) % cfg.vocab
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :-1], lb[:, :-1])
    assert not torch.allclose(la[:, -1], lb[:, -1])


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build_on_meta_with_their_sizes(name):
    cfg = preset(name, layers=2)
    with torch.device("meta"):
        model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params
    assert all(p.is_meta for p in model.parameters())


def test_known_sizes():
    assert round(PRESETS["llama-8b"].num_params / 1e9, 2) == 8.03
    assert round(PRESETS["llama-70b"].num_params / 1e9, 1) == 70.6


def test_config_round_trip_and_errors():
    for cfg in (*SMALL, *PRESETS.values()):
        assert config_from_dict(dataclasses.asdict(cfg)) == cfg
    old = {"vocab": 40, "hidden": 24, "heads": 2, "ffn": 56, "layers": 3, "seq": 12,
           "checkpoint": "none", "mbs": 2}  # a bench JSON from before arch was recorded
    assert config_from_dict(old) == GPTConfig(40, 24, 2, 56, 3, 12)
    with pytest.raises(ValueError, match="unknown model"):
        preset("llama-9b")
    with pytest.raises(ValueError, match="kv_heads"):
        LlamaConfig(heads=4, kv_heads=3)


def test_grouped_query_attention_matches_torch():
    """The repeated key / value heads are those of torch's ``enable_gqa``."""
    from hsdp_tools.models import repeat_kv

    torch.manual_seed(0)
    q = torch.randn(2, 8, 5, 4)
    k, v = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                           enable_gqa=True)
    out = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4),
                                                           is_causal=True)
    torch.testing.assert_close(out, ref)
