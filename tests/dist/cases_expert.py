"""Expert-parallel checks, run under torchrun (2 processes, ep = dp = 2) by tests/e2e/test_moe.py.

Every rank feeds DIFFERENT data: rank r takes batch r of a fixed global batch. Each rank also
builds the single-process reference itself (same seed, all experts) and compares; the
reported errors are maximised over ranks. The load-balancing loss is the global batch's
(usp/engine/parallel/balance.py), or DeepSeek-V3's per sequence: the reference computes it in one forward
on the whole batch."""
from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from usp.engine.startup_gc import pause  # noqa: E402

pause()  # the imports below run without collections; run_cases freezes what they made

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # noqa: E402

from tests.dist.harness import run_cases  # noqa: E402
from usp.engine.parallel.balance import apply_moe_balancing  # noqa: E402
from usp.engine.parallel.expert import apply_expert_parallel  # noqa: E402
from usp.models.llama import Llama, LlamaArgs  # noqa: E402
from usp.models.moe import MoE, expert_params, moe_aux_loss, moe_layers  # noqa: E402

dist.init_process_group("gloo")
WORLD, RANK = dist.get_world_size(), dist.get_rank()
EP = dist.group.WORLD  # ep = dp = world: the edp group has one rank


def expert_param_names(model: nn.Module) -> list[str]:
    """FQNs (as model.named_parameters() spells them) of the expert-sharded parameters."""
    ids = {id(p) for p in expert_params(model)}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _sum_then_scale(params: Iterable[torch.Tensor], group, scale: float) -> None:
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    for p in params:  # an expert that got no tokens anywhere has no grad: reduce zeros
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    if _group_size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat.mul_(scale)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


@torch.no_grad()
def reduce_gradients(model: nn.Module, dp_group, ep_group=None, edp_group=None) -> None:
    """After backward of each rank's own mean loss, make every gradient the gradient of the mean
    of the dp ranks' losses (usp/engine/parallel/expert.py's docstring): non-expert grads SUM over
    dp_group / dp, expert grads SUM over edp_group / dp. A group of None means a group of one rank (no
    communication). ep_group is only used to check dp = ep * edp."""
    dp, ep, edp = _group_size(dp_group), _group_size(ep_group), _group_size(edp_group)
    if dp != ep * edp:
        raise ValueError(f"dp size {dp} != ep size {ep} x edp size {edp}")
    experts = {id(p) for p in expert_params(model)}
    dense = [p for p in model.parameters() if id(p) not in experts]
    expert = [p for p in model.parameters() if id(p) in experts]
    _sum_then_scale(dense, dp_group, 1.0 / dp)
    _sum_then_scale(expert, edp_group, 1.0 / dp)
torch.set_num_threads(1)

# moe_tiny's shape (conf/model/moe_tiny.yaml) with a small vocabulary.
TINY = dict(dim=128, n_layers=2, n_heads=4, ffn_dim=256, vocab_size=256, tie_embeddings=True,
            n_experts=4, top_k=2)
B_LOCAL, SEQ, AUX_COEF = 2, 16, 0.01


def _max_over(*vals: float) -> list:
    t = torch.tensor(vals, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _models(seed: int = 0, **kw):
    """The one-process reference and its EP copy, which sums the routing statistics over the
    ranks and attaches its aux loss (coef AUX_COEF) to each MoE layer's output, as the engine does."""
    ref = Llama(LlamaArgs(**{**TINY, **kw}), max_seq_len=SEQ)
    ref.init_weights(seed)
    ep = apply_expert_parallel(copy.deepcopy(ref), EP)
    apply_moe_balancing(ep, EP, AUX_COEF, 1)
    return ref, ep


def _ce_ep(model, x, y, with_aux: bool):
    """The EP model's loss on this rank's batch: the attached aux loss trains whatever this returns."""
    for m in moe_layers(model):
        m.aux_loss_scale = AUX_COEF if with_aux else 0.0
    return _ce(model, _local(x), _local(y))


def _global_batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, TINY["vocab_size"], (B_LOCAL * WORLD, SEQ + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t[RANK * B_LOCAL:(RANK + 1) * B_LOCAL]


def _ce(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _grad_errors(ref, ep) -> dict:
    """Max |grad_ep - grad_ref|; expert grads against the slice this rank owns."""
    ref_p, worst, n = dict(ref.named_parameters()), {"dense": 0.0, "expert": 0.0}, 0
    experts = set(expert_param_names(ep))
    for name, p in ep.named_parameters():
        g_ref = ref_p[name].grad
        kind = "expert" if name in experts else "dense"
        if kind == "expert":
            start = p._ep_shard[0]
            g_ref = g_ref[start:start + p.shape[0]]
        worst[kind] = max(worst[kind], (p.grad - g_ref).abs().max().item())
        n += 1
    return {**dict(zip(("dense", "expert"), _max_over(worst["dense"], worst["expert"]))), "n": n}


def layer_forward(capacity_factor: float, shared: bool) -> dict:
    """One MoE layer: EP output and input gradient on this rank's tokens vs single-process MoE."""
    ref, ep = _models(capacity_factor=capacity_factor, shared_expert=shared)
    m_ref, m_ep = ref.layers["0"].feed_forward, ep.layers["0"].feed_forward
    g = torch.Generator().manual_seed(2)
    xg = torch.randn(B_LOCAL * WORLD, SEQ, TINY["dim"], generator=g)
    dyg = torch.randn(B_LOCAL * WORLD, SEQ, TINY["dim"], generator=g)
    x_ref, x_ep = _local(xg).clone().requires_grad_(), _local(xg).clone().requires_grad_()
    m_ep.aux_loss_scale = 0.0
    y_ref, y_ep = m_ref(x_ref), m_ep(x_ep)
    dense = m_ref.dense_reference(x_ref.detach())
    y_ref.backward(_local(dyg))
    y_ep.backward(_local(dyg))
    with torch.no_grad():
        m_ref(xg)  # the global batch's aux loss
    aux_mean = m_ep.aux_loss.detach().clone()
    dist.all_reduce(aux_mean)
    fwd, vs_dense, dx, aux = _max_over((y_ep - y_ref).abs().max().item(), (y_ep - dense).abs().max().item(),
                                       (x_ep.grad - x_ref.grad).abs().max().item(),
                                       abs(aux_mean.item() / WORLD - m_ref.aux_loss.item()))
    dropped = torch.tensor([m_ep.tokens_dropped])
    dist.all_reduce(dropped)
    return {"fwd_err": fwd, "vs_dense_reference": vs_dense, "dx_err": dx, "aux_err": aux,
            "dropped": int(dropped), "n_local_experts": m_ep.experts.n_local}


def llama_grads(with_aux: bool, **kw) -> dict:
    """Full tiny MoE Llama: EP + reduce_gradients after backward of each rank's mean loss, vs one
    process: ONE forward on the whole global batch, loss CE (+ AUX_COEF x the aux loss, added).
    `kw`: model options (DeepSeek-V3's sequence-wise loss: each rank's sequences are its own)."""
    ref, ep = _models(**kw)
    x, y = _global_batch()
    loss_ref = _ce(ref, x, y)
    if with_aux:
        loss_ref = loss_ref + AUX_COEF * moe_aux_loss(ref)
    loss_ep = _ce_ep(ep, x, y, with_aux)
    loss_ref.backward()
    loss_ep.backward()
    reduce_gradients(ep, dp_group=dist.group.WORLD, ep_group=EP, edp_group=None)
    mean_loss = (loss_ep.detach() + (AUX_COEF * moe_aux_loss(ep).detach() if with_aux else 0)).clone()
    dist.all_reduce(mean_loss)
    mean_loss /= WORLD
    errs = _grad_errors(ref, ep)
    (loss_err,) = _max_over(abs(mean_loss.item() - loss_ref.item()))
    return {"dense_grad_err": errs["dense"], "expert_grad_err": errs["expert"], "loss_err": loss_err,
            "n_params": errs["n"], "n_expert_params": len(expert_param_names(ep))}


def adamw_steps() -> dict:
    """3 AdamW steps (loss = CE + aux of the global batch): EP losses (averaged over ranks) vs one process."""
    ref, ep = _models()
    x, y = _global_batch(3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    opt_ep = torch.optim.AdamW(ep.parameters(), lr=3e-3, weight_decay=0.1)
    rels, losses = [], []
    for _ in range(3):
        opt_ref.zero_grad()
        opt_ep.zero_grad()
        loss_ref = _ce(ref, x, y) + AUX_COEF * moe_aux_loss(ref)
        loss_ep = _ce_ep(ep, x, y, True)
        loss_ref.backward()
        loss_ep.backward()
        reduce_gradients(ep, dist.group.WORLD, EP, None)
        mean = loss_ep.detach() + AUX_COEF * moe_aux_loss(ep).detach()
        dist.all_reduce(mean)
        mean /= WORLD
        rels.append(abs(mean.item() - loss_ref.item()) / abs(loss_ref.item()))
        losses.append(loss_ref.item())
        opt_ref.step()
        opt_ep.step()
    ref_p = dict(ref.named_parameters())
    perr = 0.0
    for name, p in ep.named_parameters():
        r = ref_p[name].detach()
        if hasattr(p, "_ep_shard"):
            r = r[p._ep_shard[0]:p._ep_shard[0] + p.shape[0]]
        perr = max(perr, (p.detach() - r).abs().max().item())
    rel, perr = _max_over(max(rels), perr)
    return {"loss_max_rel_err": rel, "param_max_abs_err": perr, "losses": losses}


def init_after_ep() -> dict:
    """init_weights on an expert-parallel model gives this rank's slice of the full init."""
    ref, ep = _models(seed=0)
    ep.init_weights(seed=5)
    ref.init_weights(seed=5)
    err = 0.0
    for name, p in ep.named_parameters():
        r = ref.get_parameter(name).detach()
        if hasattr(p, "_ep_shard"):
            r = r[p._ep_shard[0]:p._ep_shard[0] + p.shape[0]]
        err = max(err, (p.detach() - r).abs().max().item())
    (err,) = _max_over(err)
    return {"err": err}


def balance_loss_collectives() -> dict:
    """The global-batch load-balancing loss three ways, each vs one process on the whole batch:
    its router-weight gradient, averaged over the ranks as data parallelism does.
      counts:  usp's (MoE.balance_loss): the counts summed by a plain all_reduce (no gradient
               flows through f), P this rank's mean; no collective in the backward;
      autograd: P summed with an all-reduce whose backward all-reduces the gradient
               (_AllReduceSum, what torch.distributed.nn.functional.all_reduce does: that one
               crashed 1 of 4 launches at process exit on gloo, "terminate called without an
               active exception", as noted in usp/engine/parallel/expert.py).
    (torch.distributed._functional_collectives.all_reduce, autograd registered in torch 2.13, is
    as exact, measured, but its first call took 10 s on gloo: left out.)
    Also the loss values: the mean over ranks (counts) or the reduced value (autograd)."""
    E, k, dim, tokens = 8, 2, 16, 64
    x = torch.randn(tokens * WORLD, dim, generator=torch.Generator().manual_seed(4))
    args = type("A", (), dict(dim=dim, n_experts=E, top_k=k, ffn_dim=8, moe_ffn_dim=0, shared_expert=False,
                              capacity_factor=0.0))
    torch.manual_seed(0)
    template = MoE(args)
    ref = copy.deepcopy(template)
    ref.route(x)
    ref.aux_loss.backward()
    mine = x[RANK * tokens:(RANK + 1) * tokens]
    out = {}
    for name in ("counts", "autograd"):
        m = copy.deepcopy(template)
        m.reduce_stats = functools.partial(_all_reduce_sum, group=EP)
        m.route(mine)
        aux = m.aux_loss
        if name != "counts":  # rebuild the loss from P summed with an autograd all-reduce
            probs = F.softmax(m.router(mine).float(), dim=-1)
            counts = torch.bincount(probs.topk(k, dim=-1).indices.flatten(), minlength=E)
            dist.all_reduce(counts)
            p_sum = _AllReduceSum.apply(probs.sum(0))
            aux = E * (counts.float() / counts.sum() * p_sum / (tokens * WORLD)).sum()
        aux.backward()
        out[name] = _errors_against(ref, m, aux)
    return {**out, "grad_size": ref.router.weight.grad.abs().max().item()}


def sequence_loss_over_cp() -> dict:
    """DeepSeek-V3's sequence-wise balance loss with each sequence split over the ranks (rank r holds
    tokens [r S/2, (r+1) S/2) of every sequence, as context parallelism does): the per-sequence counts
    summed over the ranks (reduce_sequence_stats), P this rank's mean over its part; the router gradient
    averaged over the ranks and the mean loss vs one process on the whole sequences. Without the sum
    ("unreduced") each rank's f is its half's: the check has teeth if that one differs."""
    E, k, dim, B, S = 8, 2, 16, 3, 32
    x = torch.randn(B, S, dim, generator=torch.Generator().manual_seed(6))
    args = type("A", (), dict(dim=dim, n_experts=E, top_k=k, ffn_dim=8, moe_ffn_dim=0, shared_expert=False,
                              capacity_factor=0.0, router_score="sigmoid", aux_loss_scope="sequence"))
    torch.manual_seed(0)
    template = MoE(args)
    ref = copy.deepcopy(template)
    ref.route(x.flatten(0, 1), sequences=B)
    ref.aux_loss.backward()
    mine = x[:, RANK * S // WORLD:(RANK + 1) * S // WORLD].flatten(0, 1)
    out = {}
    for name in ("reduced", "unreduced"):
        m = copy.deepcopy(template)
        if name == "reduced":
            m.reduce_sequence_stats = functools.partial(_all_reduce_sum, group=EP)
        m.route(mine, sequences=B)
        m.aux_loss.backward()
        out[name] = _errors_against(ref, m, m.aux_loss)
    return {**out, "grad_size": ref.router.weight.grad.abs().max().item()}


def _errors_against(ref, m, aux: torch.Tensor) -> dict:
    """The router gradient and the loss averaged over the ranks against one process's (`ref`), the largest
    error on any rank."""
    grad, value = m.router.weight.grad.clone(), aux.detach().clone()
    dist.all_reduce(grad)
    dist.all_reduce(value)
    grad_err, value_err = _max_over((grad / WORLD - ref.router.weight.grad).abs().max().item(),
                                    abs(value.item() / WORLD - ref.aux_loss.item()))
    return {"grad_err": grad_err, "value_err": value_err}


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks; the backward sums the gradients over the ranks (each rank's loss
    depends on every rank's input)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return _all_reduce_sum(t, None)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce_sum(grad, None)


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


CASES = {
    "layer_dropless": lambda: layer_forward(0.0, False),
    "layer_capacity": lambda: layer_forward(1.0, False),
    "layer_shared": lambda: layer_forward(0.0, True),
    "llama_grads_ce": lambda: llama_grads(False),
    "llama_grads_aux": lambda: llama_grads(True),
    "llama_grads_aux_sequence": lambda: llama_grads(True, router_score="sigmoid", aux_loss_scope="sequence"),
    "sequence_loss_over_cp": sequence_loss_over_cp,
    "adamw_3_steps": adamw_steps,
    "init_after_ep": init_after_ep,
    "balance_loss_collectives": balance_loss_collectives,
}

if __name__ == "__main__":
    run_cases(CASES)
