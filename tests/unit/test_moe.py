"""MoE parameter math of the planner (usp/perf/specs.py Arch): dense shapes unchanged by the MoE
defaults, Mixtral-8x7B's published 46.7B total parameters."""
from __future__ import annotations

from types import SimpleNamespace

from usp.perf.specs import Arch


def compose_model(name: str):
    from usp.config.compose import compose_config

    cfg, _ = compose_config(None, [f"model={name}"])
    return cfg.model


def test_dense_math_unchanged_by_moe_defaults():
    a = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=None, ffn_dim=384, vocab_size=4096, tie_embeddings=True)
    dense = Arch.from_model(SimpleNamespace(**a))
    assert dense.total_params == 950_912
    assert Arch.from_model(SimpleNamespace(**a, n_experts=0, top_k=5)).total_params == 950_912


def test_mixtral_8x7b_param_count():
    cfg = compose_model("mixtral_8x7b")
    assert round(Arch.from_model(cfg).total_params / 1e9, 1) == 46.7  # published: 46.7B total
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size) == \
        (4096, 32, 32, 8, 14336, 32000)
    assert (cfg.n_experts, cfg.top_k, cfg.tie_embeddings, cfg.rope_theta) == (8, 2, False, 1e6)


def test_reference_keeps_the_micro_batch_steps_only_for_the_balancing_loss():
    """One process equals a layout's MoE load-balancing loss only with the same micro-batch steps;
    every other reference takes the global batch in one forward (which also checks accumulation)."""
    from usp.config.reference import reference_grad_accum, reference_overrides
    from usp.contract.config_schema import ModelConfig

    assert reference_grad_accum(ModelConfig(n_experts=4, aux_loss_coef=0.01), 4) == 4
    assert reference_grad_accum(ModelConfig(n_experts=4, aux_loss_coef=0.0, router_bias_update_rate=1e-3), 4) == -1
    assert reference_grad_accum(ModelConfig(n_experts=0, aux_loss_coef=0.01), 4) == -1
    ov = reference_overrides(["model=moe_tiny", "parallelism.ep=2", "train.grad_accum=4", "train.micro_batch=2"], 4)
    assert ov[0] == "model=moe_tiny" and ov[-2:] == ["train.micro_batch=-1", "train.grad_accum=4"]
