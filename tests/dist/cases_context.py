"""Context-parallel checks, run under torchrun by tests/e2e/test_context_parallel.py (cp = world size,
plus cp=2 subgroups when the world has 4 ranks). Every case compares with a single-process
reference that each rank computes on the full sequence, and returns its worst errors
(maximised over ranks)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from usp.engine.startup_gc import pause  # noqa: E402

pause()  # the imports below run without collections; run_cases freezes what they made

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.dist.harness import run_cases  # noqa: E402
from usp.engine.parallel.context_parallel import apply_context_parallel, ring_attention, shard_sequence, zigzag_indices  # noqa: E402
from usp.models.llama import Llama, LlamaArgs  # noqa: E402

dist.init_process_group("gloo")
WORLD = dist.get_world_size()
torch.set_num_threads(1)


def _max_over(group, *vals: float) -> list:
    t = torch.tensor(vals, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _attention_errors(group, b, h, kv_h, s, d, seed) -> tuple:
    """Forward and gradient errors of ring attention vs full causal SDPA (same inputs on all ranks)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(seed)
    q, do = torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)
    k, v = torch.randn(b, kv_h, s, d, generator=g), torch.randn(b, kv_h, s, d, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=kv_h != h)
    ref.backward(do)
    local = [shard_sequence(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group=group)
    out.backward(shard_sequence(do, cp, rank, dim=2))
    fwd = (out - shard_sequence(ref.detach(), cp, rank, dim=2)).abs().max().item()
    grads = [(loc.grad - shard_sequence(f.grad, cp, rank, dim=2)).abs().max().item() for loc, f in zip(local, full)]
    return fwd, grads


SHAPES = [  # (batch, heads, kv_heads, head_dim)
    (1, 2, 2, 8), (2, 4, 4, 16), (2, 4, 2, 16), (1, 6, 1, 8),
]


def _attention_case(group, gqa: bool):
    cp = dist.get_world_size(group)
    fwd_err, grad_err, n = 0.0, [0.0, 0.0, 0.0], 0
    for b, h, kv_h, d in SHAPES:
        if (kv_h != h) != gqa:
            continue
        for s in (2 * cp, 6 * cp, 16 * cp):
            f, gs = _attention_errors(group, b, h, kv_h, s, d, seed=1000 * s + 10 * h + kv_h)
            fwd_err, grad_err, n = max(fwd_err, f), [max(a, x) for a, x in zip(grad_err, gs)], n + 1
    fwd_err, *grad_err = _max_over(None, fwd_err, *grad_err)  # whole world: all subgroups
    return {"cp": cp, "configs": n, "fwd_err": fwd_err, "dq_err": grad_err[0], "dk_err": grad_err[1],
            "dv_err": grad_err[2]}


def _llama_case(n_kv_heads=None, seq_len=64, batch=2):
    cp, rank = WORLD, dist.get_rank()
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=256)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=g)
    inputs, targets = data[:, :-1], data[:, 1:]

    ref = Llama(args, max_seq_len=seq_len)  # deterministic init: identical on all ranks
    ref_loss = F.cross_entropy(ref(inputs).flatten(0, 1), targets.flatten())
    ref_loss.backward()

    model = apply_context_parallel(Llama(args, max_seq_len=seq_len), dist.group.WORLD)
    pos = zigzag_indices(seq_len, cp, rank)
    logits = model(shard_sequence(inputs, cp, rank), positions=pos)
    loss = F.cross_entropy(logits.flatten(0, 1), shard_sequence(targets, cp, rank).flatten())
    loss.backward()
    cp_loss = loss.detach().clone()
    dist.all_reduce(cp_loss)
    cp_loss /= cp
    grad_abs, grad_rel = 0.0, 0.0
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        grad /= cp
        r = ref_params[name].grad
        err = (grad - r).abs().max().item()
        grad_abs, grad_rel = max(grad_abs, err), max(grad_rel, err / r.abs().max().clamp_min(1e-30).item())
    loss_rel = abs(cp_loss.item() - ref_loss.item()) / abs(ref_loss.item())
    loss_rel, grad_abs, grad_rel = _max_over(None, loss_rel, grad_abs, grad_rel)
    return {"cp": cp, "loss": ref_loss.item(), "loss_rel_err": loss_rel, "grad_abs_err": grad_abs,
            "grad_rel_err": grad_rel}


CASES = {
    "attention_mha": lambda: _attention_case(dist.group.WORLD, gqa=False),
    "attention_gqa": lambda: _attention_case(dist.group.WORLD, gqa=True),
    "llama_mha": lambda: _llama_case(),
    "llama_gqa": lambda: _llama_case(n_kv_heads=2),
}
if WORLD == 4:  # cp=2 inside two subgroups {0,1}, {2,3}: peers must map to global ranks
    SUBGROUP, _ = dist.new_subgroups(group_size=2)
    CASES["subgroup_attention_mha"] = lambda: _attention_case(SUBGROUP, gqa=False)
    CASES["subgroup_attention_gqa"] = lambda: _attention_case(SUBGROUP, gqa=True)

if __name__ == "__main__":
    run_cases(CASES)
