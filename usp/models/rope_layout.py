"""Which channels RoPE pairs, and the rows of q/k weights written under usp's former pairing.

usp rotates channel j of a head with channel j + head_dim/2 ("rotate_half", transformers' Llama):
ROPE_LAYOUT. Checkpoints written before that change paired interleaved channels (x[2j], x[2j+1]), as
Meta's original Llama code does: LEGACY_ROPE_LAYOUT. The same function then has the rows of each head
of wq and wk in another order: the new row j of a head is the old row 2j, the new row j + head_dim/2
the old row 2j + 1 (transformers' convert_llama_weights_to_hf.py permutes Meta's weights the same
way). q . k is unchanged because q and k are permuted alike; wv and wo are not rotated.

A usp checkpoint records its layout (usp/engine/checkpoint.py writes ROPE_LAYOUT into
trainer_state.json); one without that record is legacy, and its wq/wk rows, and their optimizer
states (Adam's moments are per element), are converted with `interleaved_to_halves` as it loads."""
from __future__ import annotations

import re

import torch

ROPE_LAYOUT = "rotate_half"
LEGACY_ROPE_LAYOUT = "interleaved"
# wq / wk in a parameter name or a flattened optimizer-state key ("state.layers.0.attention.wq.weight.exp_avg")
_QK = re.compile(r"(?:^|\.)attention\.(wq|wk)\.weight(?:\.|$)")


def qk_heads(key: str, n_heads: int, n_kv_heads: int) -> int | None:
    """How many heads' rows the tensor under `key` holds (wq: n_heads, wk: n_kv_heads), or None when
    it is no q/k projection (nor an optimizer state of one)."""
    found = _QK.search(key)
    if found is None:
        return None
    return n_heads if found.group(1) == "wq" else n_kv_heads


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k weight (n_heads * head_dim, dim), or of a state of the same shape, from the
    interleaved layout to rotate_half: a new tensor."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).clone()
