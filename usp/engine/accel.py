"""Choices that matter on an accelerator (CUDA, ROCm - which PyTorch exposes as device type
"cuda" over RCCL - and Intel XPU), each a small function of the plan so CPU tests can check
what a GPU run would pick. train.dtype=auto is bf16 on an accelerator and fp32 on CPU; an
explicit train.dtype=bf16 takes the GPU's precision recipe on CPU too, so the CPU tests run it.

| choice           | GPU (train.dtype=auto or bf16); CPU with bf16           | CPU (auto / fp32)  |
|------------------|---------------------------------------------------------|--------------------|
| FSDP2 layouts    | MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), no autocast | fp32 |
| other layouts    | torch.autocast(bf16) around forward and loss            | fp32               |
| AdamW            | fused=True on GPU (one kernel per parameter group)      | for-each (default) |
| attention        | SDPA, flash backend first; or the flash-attn package    | SDPA               |

The FSDP2 policy is a choice of the parallel wrappers, so it lives with them in
usp/engine/parallel/precision.py; what the training loop itself picks (autocast, determinism,
the AdamW kernel) and what the model builder installs (the attention kernel) stays here, at the
engine's top level, beside the trainer that uses it. Autocast asks precision.py whether FSDP2
already computes in bf16.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from usp.contract.run_plan import RunPlan

FUSED_ADAMW_DEVICES = ("cuda", "xpu")  # PyTorch's fused AdamW kernels; CPU keeps the default (parity with past runs)


def autocast_context(plan: RunPlan, device: torch.device):
    """Around forward + loss: bf16 autocast where the plan decided so (not under fp32, nor where FSDP2
    already computes in bf16)."""
    if not plan.decisions.autocast:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                          cache_enabled=plan.decisions.autocast_weight_cache)


def apply_determinism(plan: RunPlan) -> None:
    """Deterministic algorithms as the plan decided (warn, not fail, where an op has none)."""
    torch.use_deterministic_algorithms(plan.decisions.deterministic, warn_only=True)


def fused_adamw(device_type: str) -> bool:
    return device_type in FUSED_ADAMW_DEVICES


# -- attention ---------------------------------------------------------------------------------

def sdpa_backends(device_type: str):
    """SDPA kernels on CUDA: flash first, then memory-efficient and math as fallbacks (e.g. fp32
    or odd head sizes). None elsewhere: PyTorch's own choice. cuDNN attention is left out:
    measured on an H200 with torch 2.11, the checkpointed forward of recompute=full ran cuDNN's
    kernel despite flash's priority and the recomputation ran flash's, so backward refused the
    mismatched saved tensors."""
    if device_type != "cuda":
        return None
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_core(name: str, device_type: str):
    """The (q, k, v) -> o function for Attention.core_attention ((b, heads, s, head_dim), causal),
    or None for the model's built-in SDPA call."""
    if name == "flash_attn":
        return _flash_attn_core()
    backends = sdpa_backends(device_type)
    if backends is None:
        return None
    from torch.nn.attention import sdpa_kernel

    def sdpa(q, k, v):
        with sdpa_kernel(backends, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

    return sdpa


def _flash_attn_core():
    try:
        from flash_attn import flash_attn_func
    except ImportError as exc:
        raise ImportError("model.attention=flash_attn needs the flash-attn package (CUDA only): "
                          "pip install 'usp[gpu]', or set model.attention=sdpa") from exc

    def flash(q, k, v):  # flash-attn takes (b, s, heads, head_dim) and handles GQA itself
        o = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return o.transpose(1, 2)

    return flash


def set_attention(model: nn.Module, name: str, device_type: str) -> None:
    """Install the attention kernel in every block (context parallelism may replace it later)."""
    core = attention_core(name, device_type)
    if core is None:
        return
    for block in model.layers.values():
        block.attention.core_attention = core
