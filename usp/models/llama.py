"""Llama-style decoder in plain PyTorch (RMSNorm, RoPE, GQA attention via SDPA, SwiGLU; the
shared pieces in usp/models/layers.py, the optional MoE feed-forward in usp/models/moe.py).

Layout follows torchtitan so later parallelism passes can work on FQNs:
`tok_embeddings`, `layers` (ModuleDict keyed "0".."L-1"), `norm`, `output`.
A pipeline stage may delete layers or set `tok_embeddings` / `norm` / `output` to None;
forward then passes hidden states through instead.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from usp.models.layers import (
    FeedForward,
    apply_rope,
    precompute_rope,
    rope_inv_freq,
    yarn_attention_factor,
    yarn_mscale,
)
from usp.models.mla import LatentAttention
from usp.models.moe import AttachAuxLoss, GroupedExperts, MoE

# How a parameter receives its whole-model value (initialisation, an imported checkpoint):
# place(param, value). The model knows no parallelism: an engine that shards parameters passes a
# function that keeps only its own part of `value`.
Place = Callable[[nn.Parameter, torch.Tensor], None]
# Names torch's wrappers insert into parameter names (activation checkpointing, torch.compile).
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def copy_whole(param: nn.Parameter, value: torch.Tensor) -> None:
    """The default Place: a plain parameter holds the whole value."""
    param.copy_(value)


@dataclass
class LlamaArgs:
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None = n_heads
    head_dim: int | None = None  # None = dim // n_heads; q and the attention output are n_heads x head_dim wide
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    ffn_dim: int = 384
    vocab_size: int = 4096
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    # RoPE frequency scaling (usp.models.layers.rope_inv_freq): "default" (none), "llama3" or "yarn"
    rope_type: str = "default"
    rope_factor: float | None = None
    rope_low_freq_factor: float | None = None  # llama3
    rope_high_freq_factor: float | None = None  # llama3
    rope_original_max_positions: int | None = None
    rope_beta_fast: float | None = None  # yarn (None: 32)
    rope_beta_slow: float | None = None  # yarn (None: 1)
    rope_mscale: float | None = None  # yarn: the attention temperature's terms (usp.models.layers.yarn_*)
    rope_mscale_all_dim: float | None = None
    rope_attention_factor: float | None = None
    rope_truncate: bool | None = None  # yarn: round the ramp's bounds (None: true)
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Mixture of experts (usp.models.moe): n_experts > 0 replaces every block's MLP.
    n_experts: int = 0
    top_k: int = 2
    moe_ffn_dim: int = 0  # hidden size of one expert; 0 = ffn_dim
    shared_expert: bool = False
    capacity_factor: float = 0.0  # 0 = dropless
    router_bias_update_rate: float = 0.0  # > 0: auxiliary-loss-free balancing (usp.models.moe)
    router_norm_topk: bool = True  # the top-k router probabilities renormalised to sum to 1 (Mixtral)
    aux_loss_scope: str = "batch"  # the balance loss over the global batch, or per sequence (DeepSeek-V3's)
    # DeepSeek-V3's options (usp.models.moe, usp.models.mla; docs/models.md)
    n_shared_experts: int = 1  # the shared expert's hidden size in experts (moe_ffn_dim x this)
    router_score: str = "softmax"  # softmax | sigmoid: how the router's logits become the gate's scores
    router_groups: int = 1  # experts in this many groups; a token picks among router_topk_groups of them
    router_topk_groups: int = 1
    router_scale: float = 1.0  # the routed experts' weights are multiplied by this (routed_scaling_factor)
    n_dense_layers: int = 0  # the first this many blocks have a dense MLP (ffn_dim) in a MoE model
    kv_lora_rank: int = 0  # > 0: multi-head latent attention (usp.models.mla) with a KV latent this wide
    q_lora_rank: int = 0  # MLA's low-rank q (0: one q projection)
    qk_nope_head_dim: int = 0  # MLA: the per-head q/k part without RoPE
    qk_rope_head_dim: int = 0  # MLA: the RoPE part (one key shared by the heads)
    v_head_dim: int = 0  # MLA: width of a value head
    rope_interleave: bool = False  # MLA: RoPE pairs channels (2j, 2j+1) (DeepSeek's checkpoints)
    mtp_depth: int = 0  # 1: DeepSeek-V3's multi-token prediction, one more block predicting the token after next

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if (self.head_dim is None and self.dim % self.n_heads) or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.dim={self.dim} must divide by n_heads={self.n_heads} (or model.head_dim be set), "
                f"and n_heads by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.mtp_depth not in (0, 1):
            raise ValueError(f"mtp_depth={self.mtp_depth}: usp implements multi-token prediction of depth 1 (or 0)")
        if self.kv_lora_rank > 0 and (self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2
                                      or self.qk_nope_head_dim < 0 or self.v_head_dim < 1):
            raise ValueError("multi-head latent attention (kv_lora_rank > 0) needs an even qk_rope_head_dim >= 2, "
                             f"qk_nope_head_dim >= 0 and v_head_dim >= 1, got {self.qk_rope_head_dim}, "
                             f"{self.qk_nope_head_dim}, {self.v_head_dim}")

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """The channels RoPE rotates per head: MLA's RoPE part, else the whole head."""
        return self.qk_rope_head_dim if self.mla else int(self.head_dim or 0)

    def moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has a MoE feed-forward (the first n_dense_layers are dense)."""
        return self.n_experts > 0 and layer >= self.n_dense_layers

    def rope_tables(self, max_seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos/sin tables (max_seq_len, rope_dim // 2), with this model's frequency scaling; under
        YaRN both multiplied by its attention factor (transformers' attention_scaling), which scales the
        rotated channels' share of q . k by its square."""
        inv_freq = rope_inv_freq(self.rope_dim, self.rope_theta, self.rope_type, self.rope_factor,
                                 self.rope_low_freq_factor, self.rope_high_freq_factor,
                                 self.rope_original_max_positions, device=device, beta_fast=self.rope_beta_fast,
                                 beta_slow=self.rope_beta_slow, truncate=self.rope_truncate)
        cos, sin = precompute_rope(inv_freq, max_seq_len)
        if self.rope_type != "yarn":
            return cos, sin
        assert self.rope_factor is not None  # rope_inv_freq refused yarn without one
        scale = yarn_attention_factor(self.rope_factor, self.rope_mscale, self.rope_mscale_all_dim,
                                      self.rope_attention_factor)
        return cos * scale, sin * scale

    @property
    def softmax_mscale(self) -> float:
        """What latent attention multiplies its softmax scale by: YaRN's mscale(factor, mscale_all_dim)
        squared when mscale_all_dim is set (DeepSeek-V3's reference code, transformers' yarn_apply_mscale:
        every channel, not only the rotated ones), else 1."""
        if self.rope_type != "yarn" or not self.rope_mscale_all_dim or self.rope_factor is None:
            return 1.0
        return yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2

    @classmethod
    def from_config(cls, model_cfg: Any, vocab_size: int | None = None) -> LlamaArgs:
        """Take the architecture fields from a ModelConfig; `vocab_size` overrides the config's
        (which is -1 until the tokenizer is known)."""
        kw = {f.name: getattr(model_cfg, f.name) for f in fields(cls) if hasattr(model_cfg, f.name)}
        if vocab_size is not None:
            kw["vocab_size"] = vocab_size
        if kw.get("vocab_size", -1) <= 0:
            raise ValueError("model.vocab_size is unresolved; pass the tokenizer's vocab_size")
        return cls(**kw)


# ----------------------------------------------------------------------- blocks

class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # Qwen3's QK-norm: one RMSNorm over head_dim, shared by the heads, on q and k before RoPE
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.core_attention = None  # optional (q, k, v) -> o replacing SDPA (context parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # view(..., -1, head_dim) rather than n_heads: tensor parallelism shards the heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, head_dim)
        if self.core_attention is not None:
            o = self.core_attention(q, k, v)
        else:  # fewer KV heads than query heads (GQA): SDPA shares each KV head itself
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention: Attention | LatentAttention = LatentAttention(args) if args.mla else Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward: MoE | FeedForward
        if args.moe_layer(layer):
            self.feed_forward = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


MTP_IGNORE = -100  # the positions whose token after next lies past the sequence


class MTPBlock(TransformerBlock):
    """DeepSeek-V3's multi-token-prediction module of depth 1 (technical report section 2.2), a block of the
    model's kind (the MoE one after the dense layers) after a projection of the token after each position and
    the main model's last hidden state there: x = [embedding of t(i+1) | h(i)] (b, s, 2 dim) ->
    eh_proj([enorm(embedding) | hnorm(h)]) -> the block -> head_norm; the model's output head then predicts
    t(i+2). It sits in `layers` under key n_layers (so data / expert parallelism, recompute and compile treat
    it as a block), and Llama.forward runs it apart from the main stack. Names as DeepSeek's checkpoints'
    model.layers.{n_layers}: enorm, hnorm, eh_proj, shared_head.norm (head_norm)."""

    def __init__(self, args: LlamaArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.enorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.head_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        emb, h = x.chunk(2, dim=-1)
        x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(h)), dim=-1))
        return self.head_norm(super().forward(x, cos, sin))


# ------------------------------------------------------------------------ model

class Llama(nn.Module):
    def __init__(self, args: LlamaArgs, max_seq_len: int = 2048) -> None:
        super().__init__()
        self.args, self.max_seq_len = args, max_seq_len
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        if args.mtp_depth:  # a block after the main ones, which forward runs apart (MTPBlock)
            self.layers[str(args.n_layers)] = MTPBlock(args, args.n_layers)
        # > 0: the multi-token-prediction loss gets this gradient through the logits (AttachAuxLoss): mtp_loss_coef /
        # micro batches per step, set by the engine; 0: the MTP block doesn't run
        self.mtp_loss_scale = 0.0
        self.mtp_loss: torch.Tensor | None = None  # the last training forward's MTP cross-entropy
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: derived from args, so they stay out of checkpoints.
        cos, sin = args.rope_tables(max_seq_len)
        self.sequence_shards = 1  # > 1 when hidden states are sequence-sharded (tensor + sequence parallel)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.rope_cos.is_meta:  # built under torch.device("meta"): materialize() initialises
            self.init_weights()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (b, s) int ids, or (b, s, dim) hidden states when `tok_embeddings` is None.
        positions: absolute positions (s,) of the tokens; default arange(s).
        Returns logits (b, s, vocab), or hidden states when `norm`/`output` are None."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Sequence length of the whole input: under sequence parallelism h is only this rank's
        # slice of the sequence (tensor parallel sets sequence_shards).
        s = tokens.shape[1] if self.tok_embeddings is not None else h.shape[1] * self.sequence_shards
        if positions is None:
            positions = torch.arange(s, device=h.device)
        elif positions.shape != (s,):
            raise ValueError(f"positions must have shape ({s},), got {tuple(positions.shape)}")
        else:
            positions = positions.to(self.rope_cos.device)
        # Keep the rotation in fp32 even if the module was cast to bf16.
        cos, sin = self.rope_cos[positions].float(), self.rope_sin[positions].float()
        mtp = self.layers[str(self.args.n_layers)] if str(self.args.n_layers) in self.layers else None
        for layer in self.layers.values():
            if layer is not mtp:
                h = layer(h, cos, sin)
        last = h
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        if mtp is not None and self.mtp_loss_scale and torch.is_grad_enabled():
            h = AttachAuxLoss.apply(h, self._mtp_loss(mtp, tokens, last, cos, sin), self.mtp_loss_scale)
        return h

    def _mtp_loss(self, mtp: nn.Module, tokens: torch.Tensor, last: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
        """Multi-token prediction (depth 1): at each position i < s - 2 the MTP block, given t(i+1)'s embedding
        and the main model's last hidden state at i, predicts t(i+2); the mean cross-entropy over those
        positions. Every token it needs is in `tokens` (the input), so no label reaches the model. As
        Megatron does, the next tokens are rolled in and the last two positions left out of the loss, so
        the MTP block's input is s long and tensor parallelism shards it over the sequence like the main
        stack's (causal attention: no position sees the rolled-in ones after it)."""
        if self.tok_embeddings is None or self.output is None:
            raise RuntimeError("multi-token prediction needs the whole model (no pipeline stage)")
        targets = torch.roll(tokens, -2, dims=1)
        targets[:, -2:] = MTP_IGNORE
        x = torch.cat((self.tok_embeddings(torch.roll(tokens, -1, dims=1)), last), dim=-1)
        logits = self.output(mtp(x, cos, sin))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=MTP_IGNORE)
        self.mtp_loss = loss.detach()
        return loss

    def materialize(self, device, seed: int | None = None, place: Place | None = None) -> Llama:
        """A model built on the meta device (whole, cut to a pipeline stage, or already
        parallelized), allocated on `device` and initialised there. Only what this module holds is
        allocated: a sharded parameter's local part (DTensor, FSDP2) and no full copy first.
        Same values as an eager build (`init_weights`); `place` as there."""
        self.allocate(device)
        self.init_weights(seed, place)
        return self

    def allocate(self, device) -> Llama:
        """Uninitialised storage on `device` for what this module holds (`to_empty`), tie kept."""
        self.to_empty(device=device)
        # to_empty gives a plain parameter a new Parameter per module holding it (a DTensor one
        # keeps its identity): the LM head shares the embedding's again
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None \
                and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        return self

    def canonical_name(self, name: str) -> str:
        """A parameter's name in the whole, unwrapped model: recompute's and torch.compile's
        wrapper prefixes removed, and a tied LM head (a last pipeline stage's copy) named as the
        embedding it copies."""
        for prefix in WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        return "tok_embeddings.weight" if self.args.tie_embeddings and name == "output.weight" else name

    def full_parameters(self) -> Iterator[tuple[str, nn.Parameter, tuple[int, ...], slice]]:
        """(canonical name, parameter, shape of that whole-model tensor, its rows this module holds),
        each parameter once. A DTensor parameter's shape is its global shape; expert parallelism
        keeps a slice of the stacked experts (rows expert_start .. + n_local), otherwise all rows."""
        sliced = {id(p): m for m in self.modules() if isinstance(m, GroupedExperts) and m.n_local != m.n_experts
                  for p in m.parameters(recurse=False)}
        for name, p in self.named_parameters():  # deduplicates the tied weight
            m = sliced.get(id(p))
            if m is None:
                yield self.canonical_name(name), p, tuple(p.shape), slice(None)
            else:
                rows = slice(m.expert_start, m.expert_start + m.n_local)
                yield self.canonical_name(name), p, (m.n_experts, *p.shape[1:]), rows

    def initial_value(self, name: str, shape: tuple[int, ...], seed: int | None = None) -> torch.Tensor:
        """The whole initial fp32 tensor of parameter `name` (canonical) of shape `shape`, on the CPU:
        a function of (seed, name) only. Linear/Embedding weights ~ N(0, init_std), output
        projections (wo, w2) scaled by 1/sqrt(2 n_layers), norms = 1. Each parameter draws from
        its own CPU generator seeded from (seed, name), so the values don't depend on the global
        RNG, on the device, or on which layers or which part of a tensor this process holds."""
        module_name = name.rsplit(".", 2)[-2]  # e.g. "wo", "ffn_norm", "tok_embeddings"
        if module_name.endswith("norm"):
            return torch.ones(shape, dtype=torch.float32)
        seed = 0 if seed is None else seed
        std = self.args.init_std
        if module_name in ("wo", "w2") or name.endswith("experts.w2"):
            std = std / math.sqrt(2 * self.args.n_layers)
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, place: Place | None = None) -> None:
        """Deterministic init (`initial_value`), one parameter at a time; RoPE tables recomputed
        (so a model materialised from the meta device works).

        `place(param, value)` puts the whole-model value of a parameter into it; the default copies
        it whole. A parallel engine passes one that keeps only this process's part of a sharded
        parameter: the transient is one parameter's whole tensor, never the model."""
        place = place or copy_whole
        for name, p, shape, rows in self.full_parameters():
            place(p, self.initial_value(name, shape, seed)[rows])
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The RoPE tables (non-persistent buffers, derived from args) and the aux-loss-free
        balancing biases (zero: balancing starts unbiased)."""
        for m in self.modules():
            if isinstance(m, MoE) and m.expert_bias is not None:
                m.expert_bias.zero_()
        cos, sin = self.args.rope_tables(self.max_seq_len, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @classmethod
    def from_config(cls, model_cfg: Any, vocab_size: int | None = None,
                    max_seq_len: int = 2048) -> Llama:
        return cls(LlamaArgs.from_config(model_cfg, vocab_size), max_seq_len=max_seq_len)
