"""Pipeline parallelism (PP) with `torch.distributed.pipelining`.

The model's layers are cut into `num_stages` contiguous stages (`usp.perf.pipeline_split`);
each pp rank holds one stage (afab, 1f1b) or several (interleaved: stages r, r+pp, ...;
zbv: stages r and 2pp-1-r). A stage is the full Llama with the layers it does not own deleted,
and without the embedding (all but the first stage) or the final norm + LM head (all but the
last): parameter names (FQNs) stay those of the full model, so checkpoints and per-name init
line up, and `Llama.forward` passes hidden states through the missing parts.

Loss scaling
------------
The schedule splits the batch into `n_microbatches` equal micro batches, calls `loss_fn` on
each micro batch's output on the last stage and backpropagates every micro-batch loss
separately; gradients add up in `.grad`. To get exactly the gradient of the single-process
mean loss over the whole batch, each micro-batch loss must be its mean divided by
n_microbatches: sum_k mean_k / n = mean over the batch (micro batches are equal-sized).

torch >= 2.6 can do this division itself: schedules take `scale_grads=True` (the default) and
then divide every `.grad` of the stage by n_microbatches after the backward. We turn that off
(`scale_grads=False`) and divide the loss instead, because (1) the per-micro-batch losses the
schedule reports then sum to the batch mean, and (2) `scale_grads` divides whatever is in
`.grad`, including gradients accumulated by an earlier `step()` before `zero_grad`.
Measured against a single process on the same batch (tests/dist/cases_pipeline.py, every
schedule): divided loss + scale_grads=False gives parameters bit-identical to a single process
that accumulates the same micro batches, and equal to a full-batch step to 2e-14 in float64;
divided loss + the default scale_grads=True gives gradients exactly n times too small. So
`build_pipeline` takes the plain per-micro-batch mean loss (e.g. cross entropy) and wraps it;
do not divide it yourself. (With ignore_index / padded tokens, micro-batch means
would weigh tokens unequally: pass a token-sum loss divided by the batch's token count.)

Zero-bubble schedules (interleaved_zb, zbv) split the backward into input- and weight-gradient
passes (`torch.autograd.grad` on the stage's graph); nothing special is needed for this model.

Running it: `pipeline_step` is the trainer's forward + backward of one batch through the
schedule, `pipeline_eval` its schedule-free forward for validation; both take the ModelParts
that usp/engine/parallel/build.py makes with `build_pipeline`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from usp.engine.loss import lm_loss
from usp.models.moe import moe_layers

if TYPE_CHECKING:  # parallel/build.py builds the parts with build_pipeline (below)
    from usp.engine.parallel.build import ModelParts
    from usp.engine.parallel.mesh import DistContext

SCHEDULE_CLASSES = {
    "afab": ScheduleGPipe,  # all forwards, then all backwards
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
SINGLE_STAGE = ("afab", "1f1b")


def build_stage_module(model: nn.Module, layer_ids: Sequence[int], is_first: bool, is_last: bool) -> nn.Module:
    """Cut a full Llama down to one stage, in place: keep `layer_ids`, the embedding only on the
    first stage, the final norm and LM head only on the last. FQNs are unchanged. A tied LM head
    on a last stage without the embedding stays as the embedding's copy (parallel/tied.py)."""
    keep = {str(i) for i in layer_ids}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if not is_first:
        model.tok_embeddings = None
    if not is_last:
        model.norm = None
        model.output = None
    return model


def _on_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


class _Stage(PipelineStage):
    """A PipelineStage whose zero-bubble split backward works under ZeRO-3.

    torch's input-gradient pass (I) maps the stage's parameters, `submod.parameters()`, to the
    autograd graph's weight nodes, and the deferred weight-gradient pass (W) maps them back. FSDP2
    swaps a module's parameters between sharded DTensors and the unsharded tensors the graph
    holds, and with reshard_after_forward=true the stage is sharded again after each forward:
    at I its parameters are not in the graph, W computes no weight gradient and the blocks don't
    learn (8.7 % loss error after 5 steps on torch 2.13). Unsharding the stage (FSDP2's own
    `unshard()`) before I and W makes both see the graph's parameters; FSDP2 reshards them at
    the next forward and after the step."""

    def _forward_metadata_inference(self, *args, **kwargs):
        """torch 2.13 runs a stage once before its first micro batch to learn the shapes it sends
        (on the first micro batch's inputs, or on empty tensors). Not a training forward: the MoE
        layers' expert load of the step (and so the aux-loss-free bias update) leaves it out."""
        saved = [(m, m.step_tokens) for m in moe_layers(self.submod)]
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            for m, tokens in saved:
                m.step_tokens = tokens

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type in ("input", "weight"):
            for m in self.submod.modules():
                if isinstance(m, FSDPModule):
                    m.unshard()
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def build_pipeline(model_factory: Callable[[], nn.Module], stage_layer_ids: Sequence[Sequence[int]],
                   stage_indices: Sequence[int], pp_group: dist.ProcessGroup, device: torch.device,
                   n_microbatches: int, schedule_name: str,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   parallelize_fn: Callable[[nn.Module], nn.Module] = lambda m: m,
                   ) -> tuple[object, list[nn.Module]]:
    """Build this rank's stages and the schedule that runs them.

    model_factory: returns a full model, on the meta device (parallelize_fn then allocates and
      initialises the stage: a rank never holds more than its stages) or with the same weights on
      every rank (per-name seeded init); called once per local stage, then cut down
      (`build_stage_module`).
    stage_layer_ids: layer ids of every stage (`split_layers`), len = number of stages.
    stage_indices: the stages this rank holds (`stage_ranks(...)[pp_rank]`).
    loss_fn: the plain mean loss of one micro batch; it is divided by n_microbatches here (see
      the module docstring), so the schedule's micro-batch losses sum to the batch mean.
    parallelize_fn: applied to each cut-down stage before it becomes a PipelineStage (TP, FSDP,
      DDP, recompute...); it may return a wrapper (e.g. DDP).
    Returns (schedule, stage_modules) with stage_modules (as returned by parallelize_fn) in the
    order of stage_indices.
    """
    if schedule_name not in SCHEDULE_CLASSES:
        raise ValueError(f"unknown pipeline schedule {schedule_name!r}; choose from {list(SCHEDULE_CLASSES)}")
    num_stages = len(stage_layer_ids)
    modules, stages = [], []
    for idx in stage_indices:
        stage = build_stage_module(model_factory(), stage_layer_ids[idx], is_first=idx == 0,
                                   is_last=idx == num_stages - 1)
        module = parallelize_fn(stage if _on_meta(stage) else stage.to(device))
        modules.append(module)
        stages.append(_Stage(module, idx, num_stages, device, group=pp_group))

    def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target) / n_microbatches

    cls = SCHEDULE_CLASSES[schedule_name]
    if schedule_name in SINGLE_STAGE:
        if len(stages) != 1:
            raise ValueError(f"schedule {schedule_name!r} runs one stage per rank, got {len(stages)}")
        schedule = cls(stages[0], n_microbatches=n_microbatches, loss_fn=scaled_loss, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=scaled_loss, scale_grads=False)
    return schedule, modules


def pipeline_step(parts: ModelParts, ctx: DistContext, x: torch.Tensor, y: torch.Tensor) -> float:
    """The trainer's forward + backward of this rank's batch (x: tokens, y: targets, both (b, s);
    b must divide into the schedule's micro batches) through the pipeline schedule. Gradients
    accumulate into the stage modules' .grad; the caller zeroes them and steps the optimizer.
    Returns the batch-mean loss on every pp rank."""
    losses = [] if parts.is_last_stage else None
    args = (x,) if parts.is_first_stage else ()
    parts.schedule.step(*args, target=y if parts.is_last_stage else None, losses=losses, return_outputs=False)
    # micro-batch losses are mean / n_microbatches: their sum is the batch mean
    return _broadcast(parts, ctx, sum(_float(loss) for loss in losses) if parts.is_last_stage else 0.0)


@torch.no_grad()
def pipeline_eval(parts: ModelParts, ctx: DistContext, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward only, the whole batch through the stages in order, hidden states passed
    point-to-point between the ranks that own consecutive stages. Independent of the schedule
    (torch's forward-only `eval` of the zbv schedule hangs in 2.13)."""
    group, me, loss = ctx.group("pp"), ctx.coords["pp"], 0.0
    modules = dict(zip(parts.stage_indices, parts.modules))
    h = None
    n_stages = len(parts.stage_owner)
    for stage in range(n_stages):
        owner = parts.stage_owner[stage]
        prev = parts.stage_owner.get(stage - 1)
        if stage > 0 and owner != prev:  # hidden states cross ranks
            if me == prev:
                dist.send(h.contiguous(), dist.get_global_rank(group, owner), group=group)
            elif me == owner:
                s_local = x.shape[1] // ctx.degrees["tp"]  # sequence-parallel shard under TP
                h = torch.empty((x.shape[0], s_local, parts.hidden_dim), device=ctx.device)
                dist.recv(h, dist.get_global_rank(group, prev), group=group)
        if me == owner:
            h = modules[stage](x if stage == 0 else h)
            if stage == n_stages - 1:
                loss = _float(lm_loss(h, y))
    return _broadcast(parts, ctx, loss)


def _broadcast(parts: ModelParts, ctx: DistContext, loss: float) -> float:
    """The loss from the pp rank that holds the last stage, on every pp rank (for logging)."""
    value = torch.tensor(loss, dtype=torch.float64, device=ctx.device)
    group = ctx.group("pp")
    dist.broadcast(value, src=dist.get_global_rank(group, parts.last_pp_rank), group=group)
    return float(value)


def _float(loss) -> float:
    loss = loss.detach()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
