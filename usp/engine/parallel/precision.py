"""Mixed precision as the parallel wrappers apply it: FSDP2's MixedPrecisionPolicy (bf16
compute and gathers, fp32 gradient reduction and master weights). Which layouts use it is
decided here; the trainer's autocast (usp/engine/accel.py) steps aside where it does."""
from __future__ import annotations

import torch

from usp.perf.layout import bf16_by_fsdp_policy, data_parallel_kind
from usp.perf.specs import uses_bf16


def fsdp_mixed_precision(plan: dict) -> bool:
    """bf16 through FSDP2's policy (parameters gathered in bf16, gradients reduced in fp32), as
    torchtitan: for FSDP/HSDP layouts whenever bf16 is in use (gloo runs it on CPU too).
    Pipelines and expert parallelism keep autocast: their stage boundaries and expert
    all-to-alls expect the fp32 parameters' dtype."""
    cfg, deg = plan["config"], plan["degrees"]
    par = cfg["parallelism"]
    return (uses_bf16(str(cfg["train"]["dtype"]), plan["device"])
            and bf16_by_fsdp_policy(data_parallel_kind(deg, bool(par["zero1"])), deg["pp"], int(par["ep"])))


def fsdp_mp_policy(plan: dict):
    """The policy for apply_fsdp, or None (fp32)."""
    if not fsdp_mixed_precision(plan):
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
