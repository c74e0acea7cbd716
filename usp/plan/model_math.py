"""Closed-form parameter and FLOP counts for the Llama model in `usp.models.llama`.

Pure Python on purpose: the planner imports this to size runs before torch is loaded,
so this module must never import torch.
"""
from __future__ import annotations

from typing import Any


def _kv_heads(n_heads: int, n_kv_heads: int | None) -> int:
    return n_heads if n_kv_heads is None else n_kv_heads


def param_breakdown(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int | None,
    ffn_dim: int,
    vocab_size: int,
    tie_embeddings: bool,
    n_experts: int = 0,
    top_k: int = 2,
    moe_ffn_dim: int = 0,
    shared_expert: bool = False,
) -> dict[str, int]:
    """Parameter counts by part. `attention`, `mlp` and `norms` are PER LAYER (multiply by
    n_layers before summing; `count_params` does that).

    attention: wq (h x h) + wk, wv (h x h_kv*head_dim) + wo (h x h), no biases
    mlp:       SwiGLU w1, w3 (h x ffn) + w2 (ffn x h)
    norms:     attention_norm + ffn_norm (h each)
    lm_head:   v x h when untied, 0 when it shares the embedding matrix

    MoE (n_experts > 0, usp.models.moe): `mlp` is the whole MoE layer = router + experts +
    shared_expert, and these extra PER LAYER keys are added:
    expert (one SwiGLU expert, hidden = moe_ffn_dim or ffn_dim), experts (all E of them),
    router (h x E), shared_expert (one expert-sized SwiGLU, or 0), active_mlp (what one token
    uses: router + top_k experts + shared_expert).
    """
    h_kv = _kv_heads(n_heads, n_kv_heads)
    if dim % n_heads or n_heads % h_kv:
        raise ValueError(f"dim={dim}, n_heads={n_heads}, n_kv_heads={h_kv} do not divide evenly")
    kv_dim = h_kv * (dim // n_heads)
    out = {
        "embedding": vocab_size * dim,
        "attention": 2 * dim * dim + 2 * dim * kv_dim,
        "mlp": 3 * dim * ffn_dim,
        "norms": 2 * dim,
        "final_norm": dim,
        "lm_head": 0 if tie_embeddings else vocab_size * dim,
    }
    if n_experts > 0:
        if not 0 < top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be in [1, n_experts={n_experts}]")
        expert = 3 * dim * (moe_ffn_dim or ffn_dim)
        shared = expert if shared_expert else 0
        out.update(expert=expert, experts=n_experts * expert, router=dim * n_experts, shared_expert=shared,
                   mlp=n_experts * expert + dim * n_experts + shared,
                   active_mlp=top_k * expert + dim * n_experts + shared)
    return out


def count_params(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int | None,
    ffn_dim: int,
    vocab_size: int,
    tie_embeddings: bool,
    n_experts: int = 0,
    top_k: int = 2,
    moe_ffn_dim: int = 0,
    shared_expert: bool = False,
) -> int:
    """Exact number of (unique) parameters, i.e. what `sum(p.numel() for p in model.parameters())` gives
    (for a MoE model: all experts, on one process before expert parallelism slices them)."""
    b = param_breakdown(dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, tie_embeddings,
                        n_experts, top_k, moe_ffn_dim, shared_expert)
    per_layer = b["attention"] + b["mlp"] + b["norms"]
    return b["embedding"] + n_layers * per_layer + b["final_norm"] + b["lm_head"]


def active_params(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int | None,
    ffn_dim: int,
    vocab_size: int,
    tie_embeddings: bool,
    n_experts: int = 0,
    top_k: int = 2,
    moe_ffn_dim: int = 0,
    shared_expert: bool = False,
) -> int:
    """Parameters one token uses: like `count_params` but with only top_k routed experts (plus the
    router and the shared expert) per MoE layer; embedding and LM head included (the convention
    behind Mixtral-8x7B's "12.9B active"). Equals count_params for a dense model."""
    b = param_breakdown(dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, tie_embeddings,
                        n_experts, top_k, moe_ffn_dim, shared_expert)
    per_layer = b["attention"] + b.get("active_mlp", b["mlp"]) + b["norms"]
    return b["embedding"] + n_layers * per_layer + b["final_norm"] + b["lm_head"]


def _arch(cfg: Any) -> dict[str, Any]:
    return dict(
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=_kv_heads(cfg.n_heads, getattr(cfg, "n_kv_heads", None)),
        ffn_dim=cfg.ffn_dim,
        vocab_size=cfg.vocab_size,
        tie_embeddings=cfg.tie_embeddings,
        **_moe_arch(cfg),
    )


def _moe_arch(cfg: Any) -> dict[str, Any]:
    return dict(
        n_experts=getattr(cfg, "n_experts", 0) or 0,
        top_k=getattr(cfg, "top_k", 2),
        moe_ffn_dim=getattr(cfg, "moe_ffn_dim", 0) or 0,
        shared_expert=bool(getattr(cfg, "shared_expert", False)),
    )


def count_params_cfg(model_cfg: Any) -> int:
    """`count_params` reading the fields of a ModelConfig-like object (vocab_size must be resolved)."""
    return count_params(**_arch(model_cfg))


def active_params_cfg(model_cfg: Any) -> int:
    """`active_params` reading the fields of a ModelConfig-like object."""
    return active_params(**_arch(model_cfg))


def matmul_params(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int | None,
    ffn_dim: int,
    vocab_size: int,
    n_experts: int = 0,
    top_k: int = 2,
    moe_ffn_dim: int = 0,
    shared_expert: bool = False,
) -> int:
    """Parameters that take part in matmuls: all block projections plus the LM head
    (counted even when tied, since the v x h matmul still runs). The embedding lookup and
    the norm weights do no matmul and are excluded. For MoE, a token's matmuls: router +
    top_k experts + shared expert."""
    b = param_breakdown(dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, False,
                        n_experts, top_k, moe_ffn_dim, shared_expert)
    return n_layers * (b["attention"] + b.get("active_mlp", b["mlp"])) + vocab_size * dim


def flops_per_token(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int | None,
    ffn_dim: int,
    vocab_size: int,
    seq_len: int,
    n_experts: int = 0,
    top_k: int = 2,
    moe_ffn_dim: int = 0,
    shared_expert: bool = False,
) -> int:
    """Training FLOPs per token (forward + backward), Ultra-Scale Playbook convention:

        FLOPs/token = 6 * N + 12 * L * h * s

    N = `matmul_params(...)` (projections + LM head, no embedding lookup, no norms);
    6 = 2 FLOPs per multiply-add x (1 forward + 2 backward). The second term is the
    attention score/value matmuls (QK^T and AV): 2 matmuls x 2 FLOPs x 3 passes x h x s per layer,
    counted without the causal-mask halving, as in the playbook/PaLM MFU formula.
    For MoE, N counts the active experts only (top_k + shared) plus the router.
    """
    n = matmul_params(dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size,
                      n_experts, top_k, moe_ffn_dim, shared_expert)
    return 6 * n + 12 * n_layers * dim * seq_len


def flops_per_token_cfg(model_cfg: Any, seq_len: int) -> int:
    """`flops_per_token` reading the fields of a ModelConfig-like object."""
    a = _arch(model_cfg)
    a.pop("tie_embeddings")
    return flops_per_token(**a, seq_len=seq_len)
