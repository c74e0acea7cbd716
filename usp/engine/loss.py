"""The training loss: mean next-token cross entropy, one definition for the trainer and the
pipeline schedules, compiled where the blocks are (train.compile).

Compiled, inductor fuses the upcast, the log-softmax and the NLL: it keeps only the logits in
their own dtype (bf16 under autocast) and one log-sum-exp per token for backward, and its
backward writes the logits' gradient in one pass, where eager keeps fp32 log-probabilities
(4 bytes per logit) and allocates two more fp32 logits-sized buffers while differentiating.
With Llama 3's 128k vocabulary that is most of a small model's peak (usp.perf.memory: the loss
terms). torchtitan compiles its loss the same way. Not under TP: loss_parallel's vocab-sharded
cross entropy runs on DTensors, which its own implementation handles eagerly."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from usp.contract.run_plan import RunPlan

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of one micro batch: logits (b, s, vocab), targets (b, s).
    Computed in at least float32 (bf16 logits are upcast, float64 stays float64)."""
    logits = logits.flatten(0, 1)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets.flatten())


def training_loss(plan: RunPlan) -> LossFn:
    """The plan's loss: lm_loss, compiled when the blocks are and the logits are plain tensors
    (not vocab-sharded under TP; module docstring): RunPlan.decisions.compiled_loss."""
    return torch.compile(lm_loss) if plan.decisions.compiled_loss else lm_loss
