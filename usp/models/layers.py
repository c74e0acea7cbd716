"""Layers shared by the Llama decoder (usp/models/llama.py) and the MoE layer
(usp/models/moe.py): rotary position embedding and the SwiGLU feed-forward. RMSNorm is
PyTorch's own nn.RMSNorm."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------- RoPE

ROPE_TYPES = ("default", "llama3", "yarn")  # what rope_inv_freq implements (transformers' rope_type names)
# YaRN's defaults where config.json leaves a value out (transformers' _compute_yarn_parameters)
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def rope_inv_freq(head_dim: int, theta: float = 10000.0, rope_type: str = "default", factor: float | None = None,
                  low_freq_factor: float | None = None, high_freq_factor: float | None = None,
                  original_max_positions: int | None = None, device: torch.device | None = None,
                  beta_fast: float | None = None, beta_slow: float | None = None,
                  truncate: bool | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) in float32: theta^(-2j / head_dim), and for rope_type
    "llama3" Llama 3.1's scaling, as transformers' `_compute_llama3_parameters` computes it (same
    operations in the same order, so the tables are bit-identical): wavelengths longer than
    original_max_positions / low_freq_factor are divided by `factor`, shorter than
    original_max_positions / high_freq_factor kept, those between interpolated smoothly; for "yarn"
    YaRN's (`yarn_inv_freq`). Written here rather than imported: transformers is an optional extra
    (usp[hf]) that usp/models never imports, and `import transformers.modeling_rope_utils` alone costs
    1.5 s (measured, CPU)."""
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r}: usp implements {', '.join(ROPE_TYPES)}")
    if rope_type == "yarn":
        if factor is None or original_max_positions is None:
            raise ValueError("rope_type='yarn' needs factor and original_max_positions")
        return yarn_inv_freq(head_dim, theta, factor, original_max_positions, beta_fast, beta_slow, truncate, device)
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


def yarn_inv_freq(head_dim: int, theta: float, factor: float, original_max_positions: int,
                  beta_fast: float | None = None, beta_slow: float | None = None, truncate: bool | None = None,
                  device: torch.device | None = None) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023, arXiv 2309.00071, "NTK-by-parts"): a channel that turns more
    than beta_fast times over original_max_positions keeps its frequency, one that turns less than
    beta_slow times is interpolated (divided by `factor`), those between ramp linearly; the bounds are
    rounded outwards unless truncate is false. transformers' `_compute_yarn_parameters`, same operations."""
    beta_fast, beta_slow = beta_fast or YARN_BETA_FAST, beta_slow or YARN_BETA_SLOW

    def channel(rotations: float) -> float:  # the channel index that turns `rotations` times
        return head_dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel(beta_fast), channel(beta_slow)
    if truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high += 0.001 if low == high else 0  # no division by zero
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp.to(device=device, dtype=torch.float)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 mscale ln(factor) + 1 (the paper's eq. 21; 1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None,
                          attention_factor: float | None = None) -> float:
    """What YaRN multiplies cos and sin by (so q . k over the rotated channels by its square):
    `attention_factor` when given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
    both are set (DeepSeek: 1 at mscale = mscale_all_dim), else mscale(factor), as transformers."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


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
