"""Layers shared by the Llama decoder (usp/models/llama.py) and the MoE layer
(usp/models/moe.py): rotary position embedding and the SwiGLU feed-forward. RMSNorm is
PyTorch's own nn.RMSNorm."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------- RoPE

ROPE_TYPES = ("default", "llama3")  # what precompute_rope implements (transformers' rope_type names)


def rope_inv_freq(head_dim: int, theta: float = 10000.0, rope_type: str = "default", factor: float | None = None,
                  low_freq_factor: float | None = None, high_freq_factor: float | None = None,
                  original_max_positions: int | None = None, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) in float32: theta^(-2j / head_dim), and for rope_type
    "llama3" Llama 3.1's scaling, as transformers' `_compute_llama3_parameters` computes it (same
    operations in the same order, so the tables are bit-identical): wavelengths longer than
    original_max_positions / low_freq_factor are divided by `factor`, shorter than
    original_max_positions / high_freq_factor kept, those between interpolated smoothly. Written
    here rather than imported: transformers is an optional extra (usp[hf]) that usp/models never
    imports, and `import transformers.modeling_rope_utils` alone costs 1.5 s (measured, CPU)."""
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r}: usp implements {', '.join(ROPE_TYPES)}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if rope_type == "default":
        return inv_freq
    if None in (factor, low_freq_factor, high_freq_factor, original_max_positions):
        raise ValueError("rope_type='llama3' needs factor, low_freq_factor, high_freq_factor and "
                         "original_max_positions")
    low_freq_wavelen = original_max_positions / low_freq_factor
    high_freq_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def precompute_rope(inv_freq: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim // 2), in float32 (on inv_freq's device)."""
    angles = torch.outer(torch.arange(max_seq_len, device=inv_freq.device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (b, s, heads, head_dim) by the angles of its tokens' positions.

    `cos`/`sin` are (s, head_dim // 2): the tables already indexed at the tokens' absolute
    positions, so a shard of the sequence (context parallelism) rotates exactly like the
    same tokens inside the full sequence. Channel j is paired with channel j + head_dim/2
    ("rotate half"), as in Hugging Face's Llama: usp's q/k projection weights are transformers'
    row for row. Computed in float32 and cast back.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).type_as(x)


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
