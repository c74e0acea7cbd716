"""Multi-head latent attention (MLA, DeepSeek-V2/V3), the attention of a model with model.kv_lora_rank > 0.

Per token x (dim) and head i (n_heads of them):

  q      = wq_b(q_a_norm(wq_a(x)))  (low-rank q, q_lora_rank > 0)  or  wq(x)   -> per head [q_nope | q_rope]
  [c | kr] = wkv_a(x)               c: the compressed KV (kv_lora_rank), kr: ONE RoPE key (qk_rope_head_dim)
  [k_nope | v] = wkv_b(kv_a_norm(c))                                           -> per head
  k      = [k_nope | rope(kr)]      the RoPE part shared by every head
  o      = wo(softmax(m q k^T / sqrt(qk_nope_head_dim + qk_rope_head_dim)) v)  v is v_head_dim wide; m: YaRN's
                                    mscale(factor, mscale_all_dim)^2 (1 without YaRN), folded into q

Names follow transformers' DeepseekV3Attention (q_a_proj -> wq_a, q_a_layernorm -> q_a_norm, q_b_proj -> wq_b,
kv_a_proj_with_mqa -> wkv_a, kv_a_layernorm -> kv_a_norm, kv_b_proj -> wkv_b, o_proj -> wo); the two latent
norms use eps 1e-6 whatever model.norm_eps is, as there. With model.rope_interleave (DeepSeek's checkpoints) RoPE
pairs channels (2j, 2j+1) of the RoPE part rather than (j, j + d/2): the channels are de-interleaved first, which
is what transformers' apply_rotary_pos_emb_interleave computes, so wq_b and wkv_a are HF's tensors row for row.

Tensor parallelism shards the heads (wq / wq_b, wkv_b column-parallel, wo row-parallel); wq_a, wkv_a and the
latent norms stay whole on every rank. The shared RoPE key is used by this rank's heads only, so its gradient is
a part of the whole: `rope_key_grad` (None, or an identity whose backward sums over the ranks) is the hook a
parallelism installs, as `core_attention` is context parallelism's."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from usp.models.layers import apply_rope

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which q_a_layernorm / kv_a_layernorm keep


class LatentAttention(nn.Module):
    def __init__(self, args: Any) -> None:
        super().__init__()
        dim, heads = args.dim, args.n_heads
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_rank, self.interleave = args.kv_lora_rank, bool(args.rope_interleave)
        qk = self.nope + self.rope
        if args.q_lora_rank > 0:
            self.wq_a: nn.Linear | None = nn.Linear(dim, args.q_lora_rank, bias=False)
            self.q_a_norm: nn.RMSNorm | None = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b: nn.Linear | None = nn.Linear(args.q_lora_rank, heads * qk, bias=False)
            self.wq: nn.Linear | None = None
        else:
            self.wq_a = self.q_a_norm = self.wq_b = None
            self.wq = nn.Linear(dim, heads * qk, bias=False)
        self.wkv_a = nn.Linear(dim, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = nn.RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, dim, bias=False)
        # YaRN's mscale^2 on the softmax scale, applied to q so every attention kernel (SDPA, flash, the
        # context-parallel ring) keeps its default 1 / sqrt(width) and gets the same scores
        self.q_scale = float(getattr(args, "softmax_mscale", 1.0))
        self.core_attention = None  # optional (q, k, v) -> o replacing SDPA (context parallel)
        self.rope_key_grad = None  # optional identity on the shared RoPE key (tensor parallel: sums its gradient)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:  # pairs (2j, 2j+1) -> (j, j + d/2): the same rotation as HF's interleaved one
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        if self.wq is not None:
            q = self.wq(x)
        else:
            assert self.wq_a is not None and self.q_a_norm is not None and self.wq_b is not None
            q = self.wq_b(self.q_a_norm(self.wq_a(x)))
        q = q.view(b, s, -1, self.nope + self.rope)  # -1: tensor parallelism shards the heads
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_a_norm(c)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope.view(b, s, 1, self.rope)
        if self.rope_key_grad is not None:
            k_rope = self.rope_key_grad(k_rope)
        q = torch.cat((q_nope, self._rope(q_rope, cos, sin)), dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat((k_nope, self._rope(k_rope, cos, sin).expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, head width)
        if self.core_attention is not None:
            o = self.core_attention(q, k, v)
        else:  # scale 1 / sqrt(q's width), as DeepSeek's (YaRN's mscale^2 is in q). Values narrower than q / k
            # are zero-padded (as torchtitan's): flash kernels need one head width, and without them SDPA
            # materialises the scores; the padded output columns are zero, and dropped
            narrow = q.shape[-1] - v.shape[-1]
            o = F.scaled_dot_product_attention(q, k, F.pad(v, (0, narrow)) if narrow > 0 else v, is_causal=True)
            o = o[..., :self.v_dim]
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))
