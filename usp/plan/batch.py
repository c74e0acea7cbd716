"""Batch math: global batch = micro batch x grad-accum steps x data-parallel degree."""
from __future__ import annotations

import math

from usp.contract.run_plan import BatchPlan
from usp.errors import PlanError


def plan_batch(train, dp: int) -> BatchPlan:
    seq_len, micro = int(train.seq_len), int(train.micro_batch)
    if seq_len < 2:
        raise PlanError("must be at least 2", key="train.seq_len", value=seq_len, fix="train.seq_len=128")
    global_batch = int(train.global_batch)
    if train.global_batch_tokens is not None:
        tokens = int(train.global_batch_tokens)
        if tokens % seq_len:
            raise PlanError(f"is not a multiple of train.seq_len={seq_len}", key="train.global_batch_tokens",
                            value=tokens, fix=f"train.global_batch_tokens={max(1, round(tokens / seq_len)) * seq_len}")
        global_batch = tokens // seq_len
    if global_batch < 1:
        key = "train.global_batch_tokens" if train.global_batch_tokens is not None else "train.global_batch"
        raise PlanError("the global batch must hold at least one sequence", key=key,
                        value=getattr(train, key.split(".")[1]), fix=f"{key}=<a positive number>")
    accum = int(train.grad_accum)
    if micro == -1:  # derive: the largest micro batch the global batch allows
        micro = global_batch // (dp * (accum if accum > 0 else 1))
        if micro < 1:
            raise PlanError(f"the global batch of {global_batch} sequences is smaller than the data-parallel "
                            f"degree x grad-accum ({dp} x {max(accum, 1)})", key="train.global_batch",
                            value=global_batch, fix=f"train.global_batch={dp * max(accum, 1)} or more, "
                            f"{fewer_data_parallel(global_batch, dp)}")
    elif micro < 1:
        raise PlanError("must be a positive integer or -1 (derive)", key="train.micro_batch", value=micro,
                        fix="train.micro_batch=-1")
    per_step = micro * dp
    if accum == -1:
        if global_batch % per_step:
            lower = max(per_step, global_batch // per_step * per_step)
            raise PlanError("is not divisible by train.micro_batch x data-parallel degree = "
                            f"{micro} x {dp} = {per_step}",
                            key="train.global_batch", value=global_batch,
                            fix=f"train.global_batch={lower} or {lower + per_step}, " + (
                                f"or a micro batch that divides {global_batch // dp}" if global_batch % dp == 0
                                else fewer_data_parallel(global_batch, dp)))
        accum = global_batch // per_step
    elif accum < 1:
        raise PlanError("must be a positive integer or -1 (derive)", key="train.grad_accum", value=accum,
                        fix="train.grad_accum=-1")
    elif micro * accum * dp != global_batch:
        raise PlanError(f"micro batch x grad-accum x dp = {micro} x {accum} x {dp} = {micro * accum * dp} "
                        f"!= train.global_batch={global_batch}", key="train.grad_accum", value=accum,
                        fix="train.grad_accum=-1 to derive it, or change train.global_batch")
    return BatchPlan(seq_len, micro, accum, dp, global_batch)


def fewer_data_parallel(global_batch: int, dp: int) -> str:
    """The other fix of a global batch that doesn't split over `dp` data-parallel ranks: the same
    devices with more model parallelism, so that the data-parallel degree divides the batch."""
    fits = math.gcd(dp, global_batch)  # the largest data-parallel degree both allow
    return (f"or {dp // fits}x more model parallelism on the same devices (parallelism.tp / pp / cp: "
            f"data-parallel degree {dp} -> {fits}, which divides {global_batch}); `usp plan --search` ranks "
            "the layouts that fit this batch")
