"""Mixed precision as the parallel wrappers apply it: FSDP2's MixedPrecisionPolicy (bf16
compute and gathers, fp32 gradient reduction and master weights) where the plan decided so
(RunPlan.decisions); the trainer's autocast (usp/engine/accel.py) steps aside there."""
from __future__ import annotations

import torch

from usp.contract.run_plan import RunPlan


def fsdp_mp_policy(plan: RunPlan):
    """The policy for apply_fsdp, or None (fp32): bf16 through FSDP2's MixedPrecisionPolicy (parameters
    gathered in bf16, gradients reduced in fp32), as torchtitan, where the plan decided so
    (usp/contract/decide.py: FSDP/HSDP layouts under bf16, without pipeline or expert parallelism)."""
    if not plan.decisions.fsdp_mixed_precision:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
