"""MoE load-balancing loss under pipeline parallelism (nproc = pp = 2), by tests/e2e/test_moe.py.

No stage but the last sees the loss, so each MoE layer attaches its aux loss's gradient to its
own output (usp.models.moe.AttachAuxLoss, scale = aux_loss_coef / n_microbatches, as
usp/engine/parallel/balance.py sets it). Each case runs one batch through a pipeline schedule and
compares every stage's gradients with a single process that adds the aux loss to the loss of the
same micro batches: sum_k (CE_k + coef * aux_k) / n. The aux loss is a per-micro-batch statistic
(f_e and P_e are means over the micro batch's tokens), so the reference must use the same micro
batches, not the full batch. float64, so the comparison is exact to rounding. The same gradients
without the aux loss are reported too, to show the aux term is not negligible."""
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

from tests.dist.harness import run_cases  # noqa: E402
from usp.engine.loss import lm_loss  # noqa: E402
from usp.engine.parallel.balance import apply_moe_balancing  # noqa: E402
from usp.engine.parallel.build import ModelParts  # noqa: E402
from usp.engine.parallel.pipeline import build_pipeline, pipeline_step  # noqa: E402
from usp.models.llama import Llama, LlamaArgs  # noqa: E402
from usp.models.moe import moe_aux_loss  # noqa: E402
from usp.perf.pipeline_split import last_stage_rank, stage_ranks  # noqa: E402

ARGS = LlamaArgs(dim=64, n_layers=4, n_heads=4, ffn_dim=128, vocab_size=256, tie_embeddings=False, n_experts=4,
                 top_k=2)
BATCH, SEQ, COEF = 8, 16, 0.1
SPLITS = {1: [[0, 1], [2, 3]], 2: [[0], [1], [2], [3]]}  # virtual stages per rank -> layers per stage


def factory() -> Llama:
    model = Llama(ARGS, max_seq_len=SEQ)
    model.init_weights(0)
    return model.to(torch.float64)


def batch():
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:]


@functools.cache
def pp_group():
    return dist.new_group(list(range(dist.get_world_size())))


class _Ctx:  # the two things pipeline_step reads from a DistContext
    device = torch.device("cpu")

    def group(self, *dims):
        return pp_group()


def _reference_grads(n_mb: int, coef: float) -> dict:
    ref = factory()
    x, y = batch()
    for xs, ys in zip(x.chunk(n_mb), y.chunk(n_mb)):
        ((lm_loss(ref(xs), ys) + coef * moe_aux_loss(ref)) / n_mb).backward()
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in ref.named_parameters()}


def aux_parity(schedule: str, n_mb: int, virtual: int) -> dict:
    pp, rank = dist.get_world_size(), dist.get_rank()
    split = SPLITS[virtual]
    mine = stage_ranks(pp, virtual, schedule)[rank]
    sched, modules = build_pipeline(factory, split, mine, pp_group(), torch.device("cpu"), n_mb, schedule, lm_loss)
    for m in modules:  # what the engine's parallelize does to every stage (pp only: no rank shares its batch)
        apply_moe_balancing(m, None, COEF, n_mb)
    parts = ModelParts(modules=modules, raw=None, schedule=sched, is_first_stage=0 in mine,
                       is_last_stage=len(split) - 1 in mine, stage_modules=modules,
                       last_pp_rank=last_stage_rank(pp, virtual, schedule), stage_indices=list(mine))
    x, y = batch()
    pipeline_step(parts, _Ctx(), x, y)
    with_aux, without = _reference_grads(n_mb, COEF), _reference_grads(n_mb, 0.0)
    err, aux_effect, router_err = 0.0, 0.0, 0.0
    for m in modules:
        for name, p in m.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            diff = (grad - with_aux[name]).abs().max().item()
            err = max(err, diff)
            aux_effect = max(aux_effect, (with_aux[name] - without[name]).abs().max().item())
            router_err = max(router_err, diff if "router" in name else 0.0)
    stats = torch.tensor([err, aux_effect, router_err], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {"grad_max_abs_err": stats[0].item(), "aux_grad_effect": stats[1].item(),
            "router_grad_max_abs_err": stats[2].item()}


CASES = {
    "aux_pp_afab_mb4": lambda: aux_parity("afab", 4, 1),
    "aux_pp_1f1b_mb4": lambda: aux_parity("1f1b", 4, 1),
    "aux_pp_interleaved_1f1b_mb4": lambda: aux_parity("interleaved_1f1b", 4, 2),
    "aux_pp_zbv_mb4": lambda: aux_parity("zbv", 4, 2),
}

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    run_cases(CASES)
