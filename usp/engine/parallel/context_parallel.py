"""Context parallelism (CP): ring attention over a zigzag-sharded sequence.

Each of the `cp` ranks of a CP group holds a slice of every sequence in the batch. A causal
mask makes the late tokens far more expensive than the early ones, so the sequence is cut
into 2*cp chunks and rank r keeps chunks r and 2*cp-1-r ("zigzag"): every rank then does the
same amount of attention work. The local tokens' global positions are `zigzag_indices(...)`,
which are also the positions to pass to `Llama.forward` so RoPE rotates them correctly.

Attention itself (`ring_attention`) is exact causal attention computed blockwise:

* forward: K/V blocks travel around the CP group with point-to-point send/recv (rank r sends
  to r+1 and receives from r-1, overlapped with the compute of the current block). Each
  query chunk meets each key chunk once; by global chunk index the pair is either fully
  visible, diagonal (causal within the chunk) or invisible (skipped). Partial results are
  merged with the log-sum-exp (online softmax) trick, in fp32.
* backward: the same ring again. The K/V blocks travel together with dK/dV accumulators;
  every rank adds the gradient of its own queries w.r.t. the visiting block, and after a
  full turn each accumulator is back at the rank that owns the block.

Why a P2P ring rather than all-gather: it is the playbook's design, the per-step message is
one K/V block (memory stays O(s/cp) instead of O(s)), and communication overlaps compute.
An explicit autograd.Function keeps the gradients exact (no reliance on collectives that
carry autograd, see docs/parallelism.md, "PyTorch distributed on CPU"). Plain matmuls, no flash kernels.

`apply_context_parallel(model, group, positions)` routes every Llama `Attention` through
`ring_attention` via the model's `core_attention` hook and, for a pipeline stage (which the
schedule calls with its input alone), makes the shard's positions the default ones.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn

# ------------------------------------------------------------------------ sharding


def zigzag_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by `rank`: chunks `rank` and `2*cp-1-rank` of 2*cp equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2*cp={2 * cp} for context parallelism")
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} out of range for cp={cp}")
    c = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])


cp_positions = zigzag_indices  # RoPE positions of the local tokens, for the trainer


def shard_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag shard of `t` along `dim`."""
    return t.index_select(dim, zigzag_indices(t.shape[dim], cp, rank).to(t.device))


# ------------------------------------------------------------------ block kernels

FULL, DIAG = "full", "diag"


def _visibility(q_chunk: int, k_chunk: int) -> str | None:
    """How a query chunk sees a key chunk under the causal mask (by global chunk index)."""
    if k_chunk < q_chunk:
        return FULL
    return DIAG if k_chunk == q_chunk else None


def _chunk_ids(cp: int, rank: int) -> tuple:
    return rank, 2 * cp - 1 - rank


def _scores(q, k, scale, kind):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if kind == DIAG:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _block_forward(q, k, v, scale, kind):
    """Softmax attention of one (query chunk, key chunk) pair: (out, lse), fp32."""
    s = _scores(q, k, scale, kind)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _merge(out, lse, blk_out, blk_lse):
    """Combine two partial softmax results over disjoint key sets (in place)."""
    new_lse = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(blk_out * torch.exp(blk_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


# ------------------------------------------------------------------------- ring


class _Ring:
    """Send a tensor to the next rank of the group while receiving the previous rank's."""

    def __init__(self, group) -> None:
        self.group, self.rank, self.size = group, dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self._reqs: list = []
        self._keep = None

    def start(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group), dist.P2POp(dist.irecv, buf, self.prev, self.group)]
        self._reqs, self._keep = dist.batch_isend_irecv(ops), (t, buf)  # keep buffers alive
        return buf

    def wait(self) -> None:
        for r in self._reqs:
            r.wait()
        self._reqs, self._keep = [], None


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group):
        ring = _Ring(group)
        cp, rank = ring.size, ring.rank
        qf, kv = q.float(), torch.stack([k.float(), v.float()])
        scale = 1.0 / math.sqrt(q.shape[-1])
        c = q.shape[-2] // 2
        out = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        q_ids = _chunk_ids(cp, rank)
        for step in range(cp):
            nxt = ring.start(kv) if step < cp - 1 else None
            k_ids = _chunk_ids(cp, (rank - step) % cp)  # this block came from rank - step
            for i, qi in enumerate(q_ids):
                for j, kj in enumerate(k_ids):
                    kind = _visibility(qi, kj)
                    if kind is None:
                        continue
                    qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                    o_blk, l_blk = _block_forward(qf[..., qs, :], kv[0, ..., ks, :], kv[1, ..., ks, :], scale, kind)
                    _merge(out[..., qs, :], lse[..., qs], o_blk, l_blk)
            if nxt is not None:
                ring.wait()
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        cp, rank = ring.size, ring.rank
        qf, do = q.float(), dout.float()
        kv = torch.stack([k.float(), v.float()])
        dkv = torch.zeros_like(kv)
        scale = 1.0 / math.sqrt(q.shape[-1])
        c = q.shape[-2] // 2
        delta = (do * out).sum(-1)  # D_i = sum_j dO_ij * O_ij
        dq = torch.zeros_like(qf)
        q_ids = _chunk_ids(cp, rank)
        for step in range(cp):
            nxt = ring.start(kv) if step < cp - 1 else None
            k_ids = _chunk_ids(cp, (rank - step) % cp)
            for i, qi in enumerate(q_ids):
                for j, kj in enumerate(k_ids):
                    kind = _visibility(qi, kj)
                    if kind is None:
                        continue
                    qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                    q_b, k_b, v_b, do_b = qf[..., qs, :], kv[0, ..., ks, :], kv[1, ..., ks, :], do[..., qs, :]
                    p = torch.exp(_scores(q_b, k_b, scale, kind) - lse[..., qs].unsqueeze(-1))
                    dkv[1, ..., ks, :] += torch.matmul(p.transpose(-1, -2), do_b)
                    ds = p * (torch.matmul(do_b, v_b.transpose(-1, -2)) - delta[..., qs].unsqueeze(-1))
                    dq[..., qs, :] += torch.matmul(ds, k_b) * scale
                    dkv[0, ..., ks, :] += torch.matmul(ds.transpose(-1, -2), q_b) * scale
            if nxt is not None:
                ring.wait()
                kv = nxt
            # The accumulator follows its block: after cp hops it is back at the owner.
            nxt_dkv = ring.start(dkv)
            ring.wait()
            dkv = nxt_dkv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None) -> torch.Tensor:
    """Exact causal attention over a zigzag-sharded sequence (see module docstring).

    q (b, heads, s_local, d), k/v (b, kv_heads, s_local, d): this rank's zigzag shard, already
    rotated by RoPE at the global positions. Returns (b, heads, s_local, d) in q's dtype.
    """
    group = group if group is not None else dist.group.WORLD
    if q.shape[-2] % 2:
        raise ValueError(f"local sequence length {q.shape[-2]} must be even (two zigzag chunks)")
    if k.shape[1] != q.shape[1]:  # GQA: expand KV heads; autograd sums their gradients back
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if dist.get_world_size(group) == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    narrow = q.shape[-1] - v.shape[-1]  # latent attention: values narrower than q / k (DeepSeek-V3: 128 vs 192)
    if narrow < 0:
        raise ValueError(f"ring attention needs values at most q's width, got {v.shape[-1]} > {q.shape[-1]}")
    if narrow:  # zero columns travel the ring with K: the output's are zero, and dropped
        return _RingAttention.apply(q, k, torch.nn.functional.pad(v, (0, narrow)), group)[..., :v.shape[-1]]
    return _RingAttention.apply(q, k, v, group)


def apply_context_parallel(model: nn.Module, cp_group, positions: torch.Tensor | None = None) -> nn.Module:
    """Make every Llama `Attention` in `model` use ring attention over `cp_group`.

    The caller feeds each rank its zigzag shard of the tokens and averages gradients over the CP
    group. `positions` (this rank's `cp_positions`), when given, becomes the model's default
    `positions` argument (a forward pre-hook): a pipeline stage is called by the schedule with
    its input alone, yet its RoPE must rotate the shard's global positions.
    """
    from usp.models.llama import Attention
    from usp.models.mla import LatentAttention

    n = 0
    for m in model.modules():
        if isinstance(m, Attention | LatentAttention):
            m.core_attention = functools.partial(ring_attention, group=cp_group)
            n += 1
    if n == 0:
        raise ValueError("apply_context_parallel: the model has no Attention modules")
    if positions is not None:
        model.register_forward_pre_hook(functools.partial(_default_positions, positions=positions), with_kwargs=True)
    return model


def _default_positions(module: nn.Module, args: tuple, kwargs: dict, positions: torch.Tensor):
    """Forward pre-hook: pass `positions` unless the caller gave them (Llama.forward(tokens, positions))."""
    if len(args) < 2 and kwargs.get("positions") is None:
        kwargs = {**kwargs, "positions": positions}
    return args, kwargs
