"""Mixture-of-Experts feed-forward layer (token-choice top-k routing, SwiGLU experts).

Layout (FQNs under a block's `feed_forward`):
  router.weight  (E, dim)            softmax gate, no bias
  experts.w1/w3  (E, dim, hidden)    stacked per-expert SwiGLU weights, so expert parallelism
  experts.w2     (E, hidden, dim)    can slice dim 0 (expert parallelism)
  shared_expert.*                    optional always-on `FeedForward` (hidden = expert hidden x n_shared_experts)

Routing: p = softmax(router(x)) in fp32; each token picks its top_k experts and their
weights are renormalised to sum to 1. DeepSeek-V3's router (router_score "sigmoid"): p = sigmoid(router(x));
with router_groups > 1 a token picks among the experts of its best router_topk_groups groups (a group ranked
by its two best biased scores); the weights renormalised (+1e-20) and multiplied by router_scale.
With capacity_factor > 0 an expert takes at most
C = ceil(cf * T * top_k / E) of the T local tokens' assignments; assignments are ranked in
token order (token 0 slot 0, token 0 slot 1, token 1 slot 0, ...) and the overflow is dropped
(the token keeps its residual, no renormalisation). capacity_factor = 0 is dropless.

Load balancing (docs/moe.md has the formulas and their sources):
- the load-balancing loss (Switch Transformer's, over the global batch as Qiu et al. 2025
  recommend): aux = E * sum_e f_e * P_e, f_e = share of the micro-batch step's top-k assignments
  (before capacity drops) that chose e, P_e = mean router probability of e. f_e counts the tokens
  of every rank that shares the step's batch: `reduce_stats`, installed by the engine, sums the
  counts over the data-parallel and context-parallel ranks; P_e stays this rank's mean. The mean
  over ranks of the per-rank losses is then the global-batch loss, and since f_e carries no
  gradient, so are its gradients, with no collective in the backward. 1 for uniform routing.
  Each forward stores it in `self.aux_loss`; with `aux_loss_scale` > 0 (coef / micro batches per
  step, set by the engine) the layer attaches its gradient to its own output (`AttachAuxLoss`),
  so no caller adds it to the loss.
- DeepSeek-V3's complementary sequence-wise balance loss (aux_loss_scope "sequence"; technical report,
  arXiv 2412.19437, eqs. 17-20): the same E * sum_e f_e * P_e per sequence, f_e and P_e over that
  sequence's tokens alone, averaged over the sequences. A sequence split over ranks (context
  parallelism) has its counts summed over them by `reduce_sequence_stats`; P_e stays this rank's
  mean over its part, so the mean over those ranks' losses is the sequence's, as for the global form.
- auxiliary-loss-free balancing (DeepSeek-V3), `router_bias_update_rate` > 0: a per-expert bias
  (buffer `expert_bias`, saved in checkpoints) is added to the router probabilities for the
  top-k choice only (the gate weights stay the probabilities); after each optimizer step
  `update_expert_bias` moves it by rate * sign(mean load - load) from the step's global token
  counts, centred to sum 0 (as torchtitan).
Training forwards add the step's global tokens per expert to `step_tokens` (not again when
activation recomputation re-runs the forward in the backward); `take_step_tokens` reads and
clears them once per step.

Expert dispatch is a hook, as attention is for context parallelism: `MoE.expert_dispatch` is
None (every expert is local: run them on the routed tokens) or a function
(experts, routed, counts) -> outputs that a parallelism installs, e.g. expert parallelism's
all_to_all exchange. This module knows nothing of process groups.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from usp.models.layers import FeedForward

ROUTER_SCORES = ("softmax", "sigmoid")  # model.router_score
AUX_LOSS_SCOPES = ("batch", "sequence")  # model.aux_loss_scope: f_e and P_e over the global batch, or per sequence


class AttachAuxLoss(torch.autograd.Function):
    """Identity on the MoE layer's output whose backward also sends `scale` as the gradient of the
    layer's load-balancing loss (Megatron's MoEAuxLossAutoScaler): the aux loss then trains the
    router inside the stage's own backward, without being added to the final loss (which a
    pipeline only has on its last stage)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights. Under expert parallelism this module holds only the
    experts [expert_start, expert_start + n_local) of `n_experts`."""

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.n_experts, self.expert_start = n_experts, 0
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        for p in (self.w1, self.w2, self.w3):
            nn.init.normal_(p, std=0.02)  # placeholder; Llama.init_weights sets the real values

    @property
    def n_local(self) -> int:
        return self.w1.shape[0]

    def expert(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert j on tokens x (n, dim)."""
        return (F.silu(x @ self.w1[j]) * (x @ self.w3[j])) @ self.w2[j]

    def forward(self, x: torch.Tensor, counts: list) -> torch.Tensor:
        """x (n, dim) sorted by local expert, counts[j] tokens for local expert j."""
        outs = [self.expert(j, chunk) for j, chunk in enumerate(torch.split(x, counts)) if counts[j] > 0]
        return torch.cat(outs) if outs else x.new_zeros(0, self.w2.shape[-1]) + 0 * x.sum()


class MoE(nn.Module):
    def __init__(self, args: Any) -> None:
        super().__init__()
        dim, self.n_experts, self.top_k = args.dim, args.n_experts, args.top_k
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"model.top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        hidden = args.moe_ffn_dim or args.ffn_dim
        self.capacity_factor = float(args.capacity_factor)
        # True: the top-k probabilities renormalised to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob);
        # False: the softmax's own probabilities weight the experts
        self.norm_topk = bool(getattr(args, "router_norm_topk", True))
        self.router = nn.Linear(dim, self.n_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, self.n_experts)
        shared_hidden = hidden * int(getattr(args, "n_shared_experts", 1) or 1)  # DeepSeek: n_shared_experts wide
        self.shared_expert: nn.Module | None = FeedForward(dim, shared_hidden) if args.shared_expert else None
        # DeepSeek-V3's router: sigmoid scores, the experts in groups of which a token picks among the
        # best router_topk_groups (a group ranked by its two best scores), the weights scaled
        self.score = str(getattr(args, "router_score", "softmax"))
        if self.score not in ROUTER_SCORES:
            raise ValueError(f"router_score={self.score!r}: usp implements {', '.join(ROUTER_SCORES)}")
        self.groups = int(getattr(args, "router_groups", 1) or 1)
        self.topk_groups = int(getattr(args, "router_topk_groups", 1) or 1)
        self.scale = float(getattr(args, "router_scale", 1.0))
        if self.groups > 1 and (self.n_experts % self.groups or self.n_experts // self.groups < 2
                                or not 1 <= self.topk_groups <= self.groups
                                or self.topk_groups * self.n_experts // self.groups < self.top_k):
            raise ValueError(f"router_groups={self.groups} must divide n_experts={self.n_experts} into groups of at "
                             f"least 2, and router_topk_groups={self.topk_groups} groups hold top_k={self.top_k}")
        # optional (experts, routed (N, dim), counts (E,) int64) -> outputs (N, dim), replacing the
        # local experts (expert parallelism installs its token exchange here)
        self.expert_dispatch = None
        # optional stats (..., E) -> their sum over the ranks that share the global batch (the engine's)
        self.reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.aux_loss_scope = str(getattr(args, "aux_loss_scope", "batch"))
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            raise ValueError(f"aux_loss_scope={self.aux_loss_scope!r}: usp implements {', '.join(AUX_LOSS_SCOPES)}")
        # optional per-sequence stats (B, E) -> their sum over the ranks holding parts of the same sequences
        # (context parallelism's), for the sequence-wise loss
        self.reduce_sequence_stats: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.tokens_dropped = 0  # assignments dropped by the capacity limit in the last forward
        # > 0: the aux loss gets this gradient through the output (AttachAuxLoss): aux_loss_coef /
        # micro batches per step, set by the engine; 0: the aux loss only trains if a caller adds it
        self.aux_loss_scale = 0.0
        self.bias_update_rate = float(getattr(args, "router_bias_update_rate", 0.0) or 0.0)
        # aux-loss-free balancing: a buffer, so checkpoints keep it (None: not registered)
        # (sigmoid scoring always has it: DeepSeek-V3's e_score_correction_bias, which a checkpoint may set)
        biased = self.bias_update_rate > 0 or self.score == "sigmoid"
        self.register_buffer("expert_bias", torch.zeros(self.n_experts) if biased else None)
        self.step_tokens: torch.Tensor | None = None  # global tokens per expert, this step so far

    # ------------------------------------------------------------------ routing

    def capacity(self, n_tokens: int) -> int:
        """Max assignments per expert for n_tokens local tokens; 0 = unlimited (dropless)."""
        if self.capacity_factor <= 0:
            return 0
        return max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts))

    def route(self, x: torch.Tensor, sequences: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, dim), `sequences` sequences of T / sequences tokens one after the other -> top-k weights (T, k)
        (renormalised unless norm_topk is off, x's dtype), expert ids (T, k), router probabilities (T, E)
        fp32. Also sets self.aux_loss."""
        logits = self.router(x).float()
        scores = logits.sigmoid() if self.score == "sigmoid" else F.softmax(logits, dim=-1)
        choice = scores if self.expert_bias is None else scores + self.expert_bias  # the bias only picks
        if self.groups > 1:
            choice = self.mask_groups(choice)
        top_e = choice.topk(self.top_k, dim=-1).indices
        top_w = scores.gather(-1, top_e)
        if self.norm_topk:  # (+1e-20 for sigmoid scores, as DeepSeek's; softmax top-k sums are never 0)
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + (1e-20 if self.score == "sigmoid" else 0.0))
        if self.scale != 1.0:
            top_w = top_w * self.scale
        # the balance loss on probabilities: sigmoid scores normalised per token (DeepSeek-V3's)
        probs = scores if self.score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        self.aux_loss = self.balance_loss(probs, top_e, sequences)
        return top_w.to(x.dtype), top_e, probs

    def mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` (T, E) with the experts outside each token's best router_topk_groups groups at -inf; a
        group's rank is the sum of its two best choice scores (DeepSeek-V3's group-limited routing)."""
        T = choice.shape[0]
        grouped = choice.view(T, self.groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (T, groups)
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_groups, dim=-1).indices, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, -1)

    def balance_loss(self, probs: torch.Tensor, top_e: torch.Tensor, sequences: int = 1) -> torch.Tensor:
        """E * sum_e f_e * P_e with f_e over the global batch of this micro-batch step (the counts
        summed by `reduce_stats`) and P_e this rank's mean probability, or per sequence
        (`sequence_balance_loss`); records the step's load."""
        counts = torch.bincount(top_e.flatten(), minlength=self.n_experts)  # int64: exact when summed
        if self.training and self.reduce_stats is not None:
            counts = self.reduce_stats(counts)
        if self.training and torch._C._current_graph_task_id() == -1:  # -1: not a recompute in backward
            self.step_tokens = counts if self.step_tokens is None else self.step_tokens + counts
        if self.aux_loss_scope == "sequence":
            return self.sequence_balance_loss(probs, top_e, sequences)
        f = counts.to(probs.dtype) / counts.sum()
        return self.n_experts * (f * probs.mean(dim=0)).sum()

    def sequence_balance_loss(self, probs: torch.Tensor, top_e: torch.Tensor, sequences: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss (eqs. 17-20 of its report), averaged over the sequences:
        per sequence, sum_e f_e P_e with f_e = E / (k T) x the assignments to e among the sequence's T tokens
        (the experts the router picked) and P_e the mean over those tokens of the probabilities (sigmoid
        scores normalised per token). The counts of a sequence split over ranks are summed over them."""
        E = self.n_experts
        picked = top_e.reshape(sequences, -1)
        counts = torch.zeros(sequences, E, dtype=torch.int64, device=top_e.device)
        counts.scatter_add_(1, picked, torch.ones_like(picked))
        if self.training and self.reduce_sequence_stats is not None:
            counts = self.reduce_sequence_stats(counts)
        f = counts.to(probs.dtype) / counts.sum(dim=1, keepdim=True)  # E x this = E / (k T) x the count
        return E * (f * probs.reshape(sequences, -1, E).mean(dim=1)).sum(dim=1).mean()

    def take_step_tokens(self) -> torch.Tensor | None:
        """This step's global tokens per expert (int64 (E,); None before any training forward),
        cleared for the next step."""
        tokens, self.step_tokens = self.step_tokens, None
        return tokens

    @torch.no_grad()
    def update_expert_bias(self, tokens: torch.Tensor) -> None:
        """DeepSeek-V3's bias update from a step's global tokens per expert: overloaded experts
        down by the rate, underloaded up, centred (torchtitan) so only the ranking moves."""
        if self.expert_bias is None:
            return
        load = tokens.to(self.expert_bias)
        delta = self.bias_update_rate * torch.sign(load.mean() - load)
        self.expert_bias.add_(delta - delta.mean())

    def dispatch_plan(self, top_e: torch.Tensor):
        """Flattened assignments sorted (stably) by expert, capacity applied.
        Returns (token index, slot index into top_k-flattened weights, expert id), each (N,),
        sorted by expert with token order kept inside an expert, and counts per expert (E,)."""
        T = top_e.shape[0]
        flat_e = top_e.flatten()
        order = torch.argsort(flat_e, stable=True)
        e_sorted = flat_e[order]
        counts = torch.bincount(flat_e, minlength=self.n_experts)
        cap = self.capacity(T)
        if cap:
            starts = torch.cumsum(counts, 0) - counts
            pos = torch.arange(order.numel(), device=order.device) - starts[e_sorted]
            keep = pos < cap
            self.tokens_dropped = int((~keep).sum())
            order, e_sorted = order[keep], e_sorted[keep]
            counts = counts.clamp(max=cap)
        else:
            self.tokens_dropped = 0
        return order // self.top_k, order, e_sorted, counts

    # ----------------------------------------------------------------- forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_w, top_e, _ = self.route(x, shape[0] if len(shape) == 3 else 1)  # (b, s, dim): b sequences
        tok, slot, _, counts = self.dispatch_plan(top_e)
        routed = x[tok]
        if self.expert_dispatch is None:
            y = self.experts(routed, counts.tolist())
        else:
            y = self.expert_dispatch(self.experts, routed, counts)
        y = y * top_w.flatten()[slot].unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, tok, y)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        if self.aux_loss_scale and torch.is_grad_enabled():
            out = AttachAuxLoss.apply(out, self.aux_loss, self.aux_loss_scale)
        return out.reshape(shape)

    def dense_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Slow, obviously-correct forward (single process, all experts present): every expert
        runs on every token, then a (T, E) combine matrix built token by token selects and
        weights them. Same result as forward, up to float rounding."""
        E, k = self.n_experts, self.top_k
        if self.experts.n_local != E:
            raise RuntimeError("dense_reference needs all experts (not expert-parallel)")
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T = x.shape[0]
        logits = x @ self.router.weight.t().float()
        probs = logits.sigmoid() if self.score == "sigmoid" else torch.softmax(logits, dim=-1)
        p_val = probs.detach().tolist()
        bias = [0.0] * E if self.expert_bias is None else self.expert_bias.tolist()
        size = E // self.groups
        cap = self.capacity(T) or T * k
        taken = [0] * E
        zero = probs.new_zeros(())
        rows = []
        for t in range(T):
            def group_rank(g: int, t: int = t) -> float:  # its two best biased scores
                return sum(sorted(p_val[t][e] + bias[e] for e in range(g * size, (g + 1) * size))[-2:])
            groups = sorted(range(self.groups), key=lambda g: -group_rank(g))[:self.topk_groups] \
                if self.groups > 1 else [0]
            allowed = [e for e in range(E) if e // size in groups]
            ranked = sorted(allowed, key=lambda e: -(p_val[t][e] + bias[e]))[:k]
            total = sum(probs[t, e] for e in ranked) if self.norm_topk else 1.0
            row = [zero] * E
            for e in ranked:
                if taken[e] < cap:
                    taken[e] += 1
                    row[e] = probs[t, e] / total * self.scale
            rows.append(torch.stack(row))
        combine = torch.stack(rows).to(x.dtype)  # (T, E) gate weight of every (token, expert)
        all_out = torch.stack([self.experts.expert(e, x) for e in range(E)], dim=1)  # (T, E, dim)
        out = (combine.unsqueeze(-1) * all_out).sum(dim=1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.reshape(shape)


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The stacked expert weights of every MoE layer (what expert parallelism splits)."""
    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]


def moe_layers(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum over MoE layers of the load-balancing losses of the last forward (0 for a dense model).
    Multiply by model.aux_loss_coef and add to the training loss."""
    losses = [m.aux_loss for m in moe_layers(model)]
    return torch.stack(losses).sum() if losses else torch.zeros(())
