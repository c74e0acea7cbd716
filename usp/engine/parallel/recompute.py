"""Activation recomputation (gradient checkpointing) per transformer block.

- none:      keep every activation.
- full:      keep only each block's input; re-run the whole block in backward.
- selective: keep the outputs of the expensive ops (matmuls, attention) and re-run only the
             cheap ones (norms, activations, RoPE, elementwise) — the Ultra-Scale Playbook's
             selective recomputation: most of the memory saving for a few % extra compute.

Blocks are wrapped in place in `model.layers` with PyTorch's `checkpoint_wrapper`
(non-reentrant). That inserts `_checkpoint_wrapped_module` into parameter names, but the
wrapper's state_dict hooks strip it again, so `model.state_dict()` keys are unchanged.
Apply recompute before FSDP/compile wrapping and after tensor-parallel sharding, as torchtitan does.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

RECOMPUTE_MODES = ("none", "selective", "full")


def _save_ops() -> frozenset[Any]:
    """Ops whose outputs selective recompute keeps. SDPA lowers to a backend-specific op
    (CPU: _scaled_dot_product_flash_attention_for_cpu); list every one this torch has."""
    aten = torch.ops.aten
    names = [
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    ]
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    ops.update(getattr(aten, n).default for n in names if hasattr(aten, n))
    return frozenset(ops)


SAVE_OPS = _save_ops()


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context_fn() -> Any:
    # Called once per checkpointed forward: each call needs fresh caching contexts.
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Wrap every block of `model.layers` (a ModuleDict) for recompute `mode`. Returns model."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(
            f"train.recompute={mode!r} is not supported; choose one of {', '.join(RECOMPUTE_MODES)}"
        )
    if mode == "none":
        return model
    if mode == "full":
        wrap = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                 preserve_rng_state=False)  # no dropout: nothing random to replay
    else:
        wrap = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                 preserve_rng_state=False, context_fn=_selective_context_fn)
    for name, block in list(model.layers.named_children()):
        model.layers[name] = wrap(block)
    return model
