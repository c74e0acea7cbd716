"""Tied input/output embeddings under pipeline parallelism, as Megatron-LM does it.

The first stage holds the token embedding (`tok_embeddings.weight`), the last stage its own copy
as the LM head (`output.weight`). Both start identical: the head copy is initialised (or loaded)
under the embedding's name (Llama.canonical_name), and the init is a function of (seed, name). After the
backward, the two copies' gradients are summed over the *embedding group* (per (dp, cp, tp) slice:
the pp ranks holding the first and the last stage), so both hold the gradient of the shared
weight and AdamW moves them identically. The copies are summed after the data-parallel reduction
(DDP / FSDP2 have already averaged each copy over dp), shard by shard: both copies are sharded the
same way (TP: Shard(0) over the vocabulary; FSDP2: dim 0 over the same mesh), so the local shards
of one (dp, tp) slice hold the same rows.

With zbv the first and the last stage sit on the same pp rank: the two copies are still separate
parameters (each stage has its own wrapper and optimizer; one parameter in two optimizers would be
stepped twice), summed locally without communication.

The gradient norm counts the head copy not at all (it duplicates the embedding's gradient);
checkpoints store the weight once, under `tok_embeddings.weight` (`canonical_state`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from usp.contract.dims import RankInfo

EMB, HEAD = "tok_embeddings.weight", "output.weight"


@dataclass
class TiedEmbedding:
    copies: list[nn.Parameter]  # this rank's copies (0, 1 or 2 of them)
    head_copy: nn.Parameter | None  # the last stage's copy on this rank, left out of the grad norm
    group: object = None  # the embedding group, None when both copies are on this rank (or none is)


def _bare(module: nn.Module) -> nn.Module:
    return getattr(module, "module", module)  # DDP wraps; FSDP2 and TP work in place


def tied_embedding(ctx, stage_indices: list[int], modules: list[nn.Module], rank_stages: list[list[int]],
                   ranks: list[RankInfo]) -> TiedEmbedding:
    """This rank's copies and its embedding group. Every rank calls it (it creates process groups)."""
    last = sum(len(s) for s in rank_stages) - 1
    copies, head_copy = [], None
    for idx, module in zip(stage_indices, modules):
        if idx == 0:
            copies.append(_bare(module).tok_embeddings.weight)
        if idx == last:
            head_copy = _bare(module).output.weight
            copies.append(head_copy)
    owner = {s: r for r, stages in enumerate(rank_stages) for s in stages}
    return TiedEmbedding(copies, head_copy, _embedding_group(ctx, owner[0], owner[last], ranks))


def _embedding_group(ctx, first: int, last: int, ranks: list[RankInfo]):
    """The group of the pp ranks `first` and `last` of this rank's (dp, cp, tp) slice; all ranks
    create every slice's group in the same order, as torch.distributed requires."""
    if first == last:
        return None
    if {first, last} == set(range(ctx.degrees["pp"])):  # pp = 2: the pp group itself
        return ctx.group("pp")
    slices: dict[tuple, dict[int, int]] = {}
    for r in ranks:
        c = r.coords
        slices.setdefault(tuple(v for k, v in sorted(c.items()) if k != "pp"), {})[c["pp"]] = r.rank
    mine = None
    for by_pp in slices.values():
        members = [by_pp[first], by_pp[last]]
        group = dist.new_group(members)
        mine = group if ctx.rank in members else mine
    return mine


@torch.no_grad()
def sum_tied_grads(tied: TiedEmbedding) -> None:
    """Both copies' gradients := their sum (after the data-parallel reduction, before clipping)."""
    for p in tied.copies:
        if p.grad is None:
            raise RuntimeError("a tied embedding copy has no gradient after the backward")
        if hasattr(p.grad, "placements") and tuple(p.grad.placements) != tuple(p.placements):
            # TP: DTensor gives the row-parallel embedding a Replicate (full) gradient; shard it like
            # the parameter (a local slice) so both copies' local shards hold the same rows
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    grads = [p.grad for p in tied.copies]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if len(local) == 2:  # first and last stage on this rank
        local[0].add_(local[1])
        local[1].copy_(local[0])
    elif len(local) == 1 and tied.group is not None:
        dist.all_reduce(local[0], group=tied.group)


def canonical_state(model_sd: dict, optim_sd: dict, tie: bool) -> tuple[dict, dict]:
    """A part's (model, flattened optimizer) state dicts with the tied weight stored once, as
    `tok_embeddings.weight` whatever the layout: an unpipelined model drops its `output.weight`
    alias; a last stage without the embedding saves its copy under the embedding's key."""
    if not tie or HEAD not in model_sd:
        return model_sd, optim_sd
    if EMB in model_sd:  # one parameter under two names
        return {k: v for k, v in model_sd.items() if k != HEAD}, optim_sd
    return _rename(model_sd, HEAD, EMB), _rename(optim_sd, HEAD, EMB)


def is_head_copy(module: nn.Module, tie: bool) -> bool:
    """A last pipeline stage holding its copy of the tied embedding (not the embedding itself)."""
    bare = _bare(module)
    return tie and getattr(bare, "output", None) is not None and getattr(bare, "tok_embeddings", None) is None


def head_copy_state(model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
    """The inverse of canonical_state for a last stage: its own key names again (for set_state_dict)."""
    return _rename(model_sd, EMB, HEAD), _rename(optim_sd, EMB, HEAD)


def _rename(sd: dict, old: str, new: str) -> dict:
    """Keys `old`, `state.old.*`, `param_groups.old.*` (flattened optimizer state) renamed to `new`."""
    out = {}
    for key, value in sd.items():
        for prefix in ("", "state.", "param_groups."):
            if key == prefix + old or key.startswith(prefix + old + "."):
                key = prefix + new + key[len(prefix + old):]
                break
        out[key] = value
    return out
