"""Pipeline-parallel parity checks, all in one torchrun launch (nproc = pp = 2).

Every case trains a 4-layer untied tiny Llama for 3 AdamW steps with one schedule, through the
trainer's own step (`usp.engine.parallel.pipeline.pipeline_step` on the ModelParts and
DistContext the trainer would hold), and compares,
on every step, the pipeline's loss with a single-process run over the same batch (computed on
every rank: the model is tiny), and at the end each stage's parameters with the single-process
model's same-named parameters. Rank 0 reports the max errors over all ranks.

A second single-process reference accumulates the same micro batches (mean / n each): in
float32 the pipeline matches it bit for bit. Against the full-batch reference, float32 differs
by summation-order rounding that AdamW amplifies on near-zero gradients (g / (|g| + eps)):
single-process micro-batching alone moves parameters by 1e-6..2e-5 after 3 steps depending on
the data seed. So each schedule also runs in float64, where the full-batch parity is exact to
~1e-12 and the 1e-5 tolerance is meaningful whatever the seed or CPU."""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from usp.engine.startup_gc import pause  # noqa: E402

pause()  # the imports below run without collections; run_cases freezes what they made

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from tests.dist.harness import run_cases  # noqa: E402
from usp.engine.loss import lm_loss  # noqa: E402
from usp.engine.parallel.build import ModelParts  # noqa: E402
from usp.engine.parallel.mesh import DistContext  # noqa: E402
from usp.engine.parallel.pipeline import build_pipeline, build_stage_module, pipeline_step  # noqa: E402
from usp.models.llama import Llama, LlamaArgs  # noqa: E402
from usp.perf.pipeline_split import last_stage_rank, split_layers, stage_ranks, validate_schedule  # noqa: E402

ARGS = LlamaArgs(dim=64, n_layers=4, n_heads=4, vocab_size=256, tie_embeddings=False)
BATCH, SEQ, STEPS, LR = 8, 16, 3, 1e-3


def factory(dtype: torch.dtype = torch.float32) -> Llama:
    return Llama(ARGS, max_seq_len=SEQ).to(dtype)


def batches():
    g = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        t = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=g)
        yield t[:, :-1], t[:, 1:]


def stage_split(n_stages: int):
    m = factory()
    layer = sum(p.numel() for p in m.layers["0"].parameters())
    head = m.norm.weight.numel() + m.output.weight.numel()
    return split_layers(ARGS.n_layers, n_stages, m.tok_embeddings.weight.numel(), head, layer)


@functools.cache
def pp_context() -> DistContext:
    """The trainer's context for a pp-only layout over every process (make_context's mesh)."""
    pp, rank = dist.get_world_size(), dist.get_rank()
    dims = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    shape = (pp, 1, 1, 1, 1)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    coords = {d: (rank if d == "pp" else 0) for d in dims}
    return DistContext(rank, pp, 0, torch.device("cpu"), dict(zip(dims, shape)), coords, mesh)


def pipeline_parts(schedule_name: str, n_mb: int, virtual: int, dtype: torch.dtype, ctx: DistContext):
    """(ModelParts as usp.engine.parallel.build makes them, stage split) without a plan."""
    pp = ctx.degrees["pp"]
    n_stages = pp * virtual
    split = stage_split(n_stages)
    mine = stage_ranks(pp, virtual, schedule_name)[ctx.coords["pp"]]
    schedule, modules = build_pipeline(lambda: factory(dtype), split, mine, ctx.group("pp"), ctx.device, n_mb,
                                       schedule_name, lm_loss)
    parts = ModelParts(modules=modules, raw=None, schedule=schedule, is_first_stage=0 in mine,
                       is_last_stage=n_stages - 1 in mine, stage_modules=modules,
                       last_pp_rank=last_stage_rank(pp, virtual, schedule_name), stage_indices=list(mine))
    return parts, split


def parity(schedule_name: str, n_mb: int, virtual: int, dtype: torch.dtype = torch.float32) -> dict:
    ctx = pp_context()
    pp = ctx.degrees["pp"]
    validate_schedule(schedule_name, pp, virtual, n_mb)
    parts, split = pipeline_parts(schedule_name, n_mb, virtual, dtype, ctx)
    modules = parts.modules
    opt = torch.optim.AdamW(list(parts.parameters()), lr=LR)
    ref = factory(dtype)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_mb = factory(dtype)
    ref_mb_opt = torch.optim.AdamW(ref_mb.parameters(), lr=LR)
    loss_rel = []
    for x, y in batches():
        ref_opt.zero_grad()
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_mb_opt.zero_grad()
        for xs, ys in zip(x.chunk(n_mb), y.chunk(n_mb)):
            (lm_loss(ref_mb(xs), ys) / n_mb).backward()
        ref_mb_opt.step()
        opt.zero_grad()
        logged = pipeline_step(parts, ctx, x, y)  # the batch-mean loss, on every pp rank
        opt.step()
        loss_rel.append(abs(logged - ref_loss.item()) / abs(ref_loss.item()))
    ref_params, ref_mb_params = dict(ref.named_parameters()), dict(ref_mb.named_parameters())
    err, err_mb, names = 0.0, 0.0, 0
    for m in modules:
        for name, p in m.named_parameters():
            err = max(err, (p.detach() - ref_params[name].detach()).abs().max().item())
            err_mb = max(err_mb, (p.detach() - ref_mb_params[name].detach()).abs().max().item())
            names += 1
    stats = torch.tensor([err, err_mb, max(loss_rel)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    count = torch.tensor([names])
    dist.all_reduce(count)
    return {"param_max_abs_err": stats[0].item(), "param_max_abs_err_vs_microbatched": stats[1].item(),
            "loss_max_rel_err": stats[2].item(),
            "params_compared": int(count.item()), "n_params_ref": len(ref_params),
            "split": split, "stages_rank0": stage_ranks(pp, virtual, schedule_name)[0]}


def default_scale_grads_with_divided_loss() -> dict:
    """Evidence for the loss scaling rule: torch's default scale_grads=True on top of a loss
    already divided by n_microbatches gives gradients n_microbatches times too small."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    pp, rank, n_mb = dist.get_world_size(), dist.get_rank(), 4
    split = stage_split(pp)
    module = build_stage_module(factory(), split[rank], rank == 0, rank == pp - 1)
    stage = PipelineStage(module, rank, pp, torch.device("cpu"))
    sched = ScheduleGPipe(stage, n_microbatches=n_mb, loss_fn=lambda o, t: lm_loss(o, t) / n_mb)
    x, y = next(batches())
    sched.step(*((x,) if rank == 0 else ()), target=y if rank == pp - 1 else None)
    ref = factory()
    lm_loss(ref(x), y).backward()
    ref_grads = dict(ref.named_parameters())
    ratios = [(ref_grads[n].grad.norm() / p.grad.norm()).item() for n, p in module.named_parameters()]
    ratio = torch.tensor([min(ratios), max(ratios)])
    dist.all_reduce(ratio)
    return {"ref_over_pp_grad_ratio_min_max": (ratio / pp).tolist(), "n_microbatches": n_mb}


PARITY = {  # case: (schedule, n_microbatches, virtual stages per rank), pp = 2
    "afab_mb4": ("afab", 4, 1),
    "afab_mb2": ("afab", 2, 1),
    "1f1b_mb4": ("1f1b", 4, 1),
    "interleaved_1f1b_mb4": ("interleaved_1f1b", 4, 2),
    "interleaved_zb_mb4": ("interleaved_zb", 4, 2),
    "zbv_mb4": ("zbv", 4, 2),
}
CASES = {
    **{f"{name}_{dname}": (lambda a=args, d=dtype: parity(*a, dtype=d))
       for name, args in PARITY.items() for dname, dtype in (("fp32", torch.float32), ("fp64", torch.float64))},
    "torch_default_scale_grads": default_scale_grads_with_divided_loss,
}

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    run_cases(CASES)
