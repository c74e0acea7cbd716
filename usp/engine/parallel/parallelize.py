"""Apply the parallelisms of the plan to one model (or one pipeline stage), always in the
same order (as torchtitan): FP8 conversion -> TP/SP -> CP -> EP (+ MoE balancing) -> activation
recomputation -> compile -> FSDP / ZeRO -> allocate + initialise -> DDP. Each step lives in its own
file beside this one in usp/engine/parallel/ (fp8.py, tensor.py, context.py, expert.py, balance.py,
recompute.py, data.py, materialize.py; the FSDP2 policy in precision.py); build.py calls this once
per model or pipeline stage, built on the meta device: every step up to FSDP works on shapes, then
each rank allocates only its own shards. DDP (and plain-DDP ZeRO-1) wraps real parameters: those
layouts replicate the whole model on every rank anyway, so it is allocated whole just before the wrap.
On the meta device (`usp plan --build-check`, usp/engine/meta_build.py) nothing is allocated and DDP
is left out."""
from __future__ import annotations

import torch
from torch import nn

from usp.contract.dims import FSDP_KINDS
from usp.contract.run_plan import RunPlan
from usp.engine.parallel.data import apply_ddp, apply_fsdp
from usp.engine.parallel.materialize import materialize
from usp.engine.parallel.mesh import DistContext
from usp.engine.parallel.precision import fsdp_mp_policy
from usp.engine.parallel.recompute import apply_recompute


def parallelize(model: nn.Module, plan: RunPlan, ctx: DistContext) -> nn.Module:
    """`model`: built on the meta device. Returns it parallelized (maybe wrapped), with this rank's
    part of every parameter allocated on ctx.device and initialised (materialize.py)."""
    deg, par, choose = ctx.degrees, plan.config.parallelism, plan.decisions
    if choose.fp8 != "off":  # torchtitan converts at model build, before any wrapper
        from usp.engine.parallel.fp8 import apply_fp8

        apply_fp8(model, choose.fp8)
    if deg["tp"] > 1:
        from usp.engine.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, ctx.submesh("tp"), plan.model.vocab_size)
    if deg["cp"] > 1:
        from usp.engine.parallel.context_parallel import apply_context_parallel, cp_positions

        positions = cp_positions(int(plan.batch.seq_len), deg["cp"], ctx.coords["cp"]).to(ctx.device)
        apply_context_parallel(model, ctx.group("cp"), positions)  # a pipeline stage's default positions
    ep = int(par.ep)
    if ep > 1:  # EP ranks are dp_shard x cp ranks, so the layout is always FSDP / HSDP below
        from usp.engine.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, ctx.expert_mesh(ep)["ep"].get_group())
    if choose.moe:  # routing statistics over the global batch
        from usp.engine.parallel.balance import BATCH_DIMS, apply_moe_balancing

        apply_moe_balancing(model, ctx.group(*BATCH_DIMS), float(plan.config.model.aux_loss_coef),
                            int(plan.batch.grad_accum), sequence_group=ctx.group("cp"))
    if int(plan.config.model.mtp_depth or 0):  # the MTP loss's gradient through the logits (Llama.forward)
        model.mtp_loss_scale = float(plan.config.model.mtp_loss_coef) / int(plan.batch.grad_accum)
    apply_recompute(model, choose.recompute)
    if choose.compile:  # train.compile=auto: on for CUDA
        for name, block in list(model.layers.named_children()):
            model.layers[name] = torch.compile(block)
    kind = choose.dp_kind
    if kind in FSDP_KINDS:
        reshard = bool(par.reshard_after_forward) and kind in ("fsdp", "hsdp")  # ZeRO-1/replication: never
        apply_fsdp(model, ctx, reshard_after_forward=reshard, mp_policy=fsdp_mp_policy(plan),
                   shard_replicas=kind == "zero1_fsdp", ep=ep)  # mp_policy: bf16 compute on GPU, None on CPU
    materialize(model, plan, ctx)  # this rank's TP / FSDP2 shards; the whole model where it is replicated
    if kind in ("ddp", "zero1") and ctx.device.type != "meta":  # meta: the build check, DDP's wrap takes real tensors
        return apply_ddp(model, ctx, int(par.ddp_bucket_mb), str(par.ddp_comm_hook), int(par.powersgd_rank))
    return model
