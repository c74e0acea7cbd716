"""Context parallelism in one process: zigzag sharding, positions, the attention hook (ring attention
under torchrun: tests/e2e/test_context_parallel.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from usp.engine.parallel.context_parallel import cp_positions, zigzag_indices
from usp.models.llama import Llama, LlamaArgs


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("chunk", [1, 3])
def test_zigzag_covers_every_position_once(cp, chunk):
    seq = 2 * cp * chunk
    idx = torch.cat([zigzag_indices(seq, cp, r) for r in range(cp)])
    assert idx.dtype == torch.long
    assert sorted(idx.tolist()) == list(range(seq))
    assert all(len(zigzag_indices(seq, cp, r)) == seq // cp for r in range(cp))
    assert torch.equal(cp_positions(seq, cp, 0), zigzag_indices(seq, cp, 0))


def test_zigzag_layout_and_errors():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="divisible"):
        zigzag_indices(10, 2, 0)
    with pytest.raises(ValueError, match="out of range"):
        zigzag_indices(8, 2, 2)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_causal_work(cp):
    """Causal attention work of a query at position p is p+1 keys: equal on every rank."""
    seq = 2 * cp * 16
    work = [int((zigzag_indices(seq, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1
    # Contiguous sharding would be unbalanced: the last rank does ~2cp-1 times the first's work.
    contiguous = [int((torch.arange(r * seq // cp, (r + 1) * seq // cp) + 1).sum()) for r in range(cp)]
    assert contiguous[-1] > 2 * contiguous[0]


def test_core_attention_hook_defaults_to_sdpa():
    torch.manual_seed(0)
    model = Llama(LlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64), max_seq_len=16)
    tokens = torch.randint(0, 64, (2, 16))
    base = model(tokens)
    attn = model.layers["0"].attention
    assert attn.core_attention is None
    attn.core_attention = lambda q, k, v: F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True)
    torch.testing.assert_close(model(tokens), base, atol=1e-6, rtol=1e-5)
