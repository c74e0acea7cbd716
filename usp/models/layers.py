"""Layers shared by the Llama decoder (usp/models/llama.py) and the MoE layer
(usp/models/moe.py): rotary position embedding and the SwiGLU feed-forward. RMSNorm is
PyTorch's own nn.RMSNorm."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------- RoPE

def precompute_rope(head_dim: int, max_seq_len: int, theta: float = 10000.0,
                    device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim // 2), in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (b, s, heads, head_dim) by the angles of its tokens' positions.

    `cos`/`sin` are (s, head_dim // 2): the tables already indexed at the tokens' absolute
    positions, so a shard of the sequence (context parallelism) rotates exactly like the
    same tokens inside the full sequence. Pairs are interleaved (x[2i], x[2i+1]) as in Meta's
    Llama. Computed in float32 and cast back.
    """
    xf = x.float().unflatten(-1, (-1, 2))
    x1, x2 = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return out.flatten(-2).type_as(x)


# ------------------------------------------------------------------ feed-forward

class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
