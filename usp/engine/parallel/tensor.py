"""Tensor + sequence parallelism (Megatron-style) with DTensor's `parallelize_module`.

Per block: attention wq/wk/wv and MLP w1/w3 are column-parallel (each TP rank holds a slice of
the heads / hidden units), wo and w2 row-parallel; the norms run sequence-parallel (activations
between blocks are sharded along the sequence, Shard(1)), so the all-reduces of plain TP become
all-gather + reduce-scatter pairs. The embedding is row-parallel over the vocabulary; the LM head
is column-parallel and keeps its logits sharded over the vocabulary for `loss_parallel`.

A vocabulary that does not divide by tp is padded (the plan says by how much); the padded
logits are masked to -inf so the loss, and every gradient, is the unpadded model's.
A MoE layer is not tensor-parallel (`_moe_plan`: no expert TP).

QK-norm (model.qk_norm, Qwen3): q_norm and k_norm normalise each head over head_dim, after wq / wk,
so they run on this rank's heads. Their weights (head_dim) are replicated; each rank's gradient is
its heads' part of the whole, so it must be summed over the TP ranks. As torchtitan's Qwen3 plan
does: SequenceParallel over dim 2 (the heads of (b, s, heads, head_dim)) makes the local q / k a
DTensor sharded over the heads, the weight a Replicate DTensor, and DTensor's RMSNorm backward
gives the weight a Partial gradient that it all-reduces.

Latent attention (model.kv_lora_rank > 0, DeepSeek-V3, usp/models/mla.py) is tensor-parallel over its
heads as torchtitan's DeepSeek-V3 plan is: wq (or wq_b) and wkv_b column-parallel, wo row-parallel; the
low-rank projections wq_a, wkv_a and their norms stay whole on every rank, as plain tensors (like a MoE
layer's). Their gradients are the whole model's on every rank: the column-parallel layers after them
sum their inputs' gradients over tp, and the RoPE key, which this rank's heads alone use, passes through
`rope_key_grad`, an identity whose backward sums over tp."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from usp.models.mla import LatentAttention
from usp.models.moe import MoE


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, real_vocab: int) -> None:
    """Shard `model` (a Llama or a pipeline stage of one) over `tp_mesh` in place."""
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    tied = model.tok_embeddings is not None and model.output is not None and \
        model.output.weight is model.tok_embeddings.weight
    parallelize_module(model, tp_mesh, top)
    if tied:  # each style distributed its own copy; share the (identically sharded) one again
        model.output.weight = model.tok_embeddings.weight

    for block in model.layers.values():
        mla = isinstance(block.attention, LatentAttention)
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),  # (MLA's low-rank layers: local)
                                            desired_input_layouts=(Replicate(), None, None), use_local_output=mla),
            **(_mla_plan(block.attention, tp_mesh) if mla else {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
            }),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            **_qk_norm_plan(block.attention),
            "ffn_norm": SequenceParallel(),
            **(_moe_plan() if isinstance(block.feed_forward, MoE) else _mlp_plan()),
        })

    if str(model.args.n_layers) in model.layers:  # the MTP block's input projection and norms act per
        # position: replicated, on the sequence shards
        parallelize_module(model.layers[str(model.args.n_layers)], tp_mesh,
                           {name: SequenceParallel(use_local_output=True)
                            for name in ("enorm", "hnorm", "eh_proj", "head_norm")})
    model.sequence_shards = tp_mesh.size()  # hidden states between blocks are sequence-sharded
    if model.output is not None and model.output.weight.shape[0] > real_vocab:
        _mask_padded_logits(model.output, tp_mesh, real_vocab)


def _qk_norm_plan(attention: nn.Module) -> dict:
    """q_norm and k_norm on this rank's heads (dim 2 of q and k), weights replicated, gradients summed
    over tp (module docstring); nothing without QK-norm."""
    if getattr(attention, "q_norm", None) is None:
        return {}
    style = SequenceParallel(sequence_dim=2, use_local_output=True)
    return {"attention.q_norm": style, "attention.k_norm": style}


def _mla_plan(attention: LatentAttention, tp_mesh: DeviceMesh) -> dict:
    """Latent attention's head-sharded projections (module docstring); installs its RoPE key's gradient sum."""
    attention.rope_key_grad = partial(_sum_grad_over, tp_mesh)
    return {f"attention.{name}": ColwiseParallel() for name in ("wq", "wq_b", "wkv_b")
            if getattr(attention, name) is not None}


def _sum_grad_over(mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
    """x itself, whose gradient is summed over `mesh` in the backward (each rank holds a part of it)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _mlp_plan() -> dict:
    return {
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def _moe_plan() -> dict:
    """A MoE layer is not tensor-parallel (no expert TP): its input is all-gathered over the
    sequence, every TP rank runs the same router, experts (expert parallelism, if any, exchanges
    tokens within its own TP slice) and shared expert on plain local tensors, and keeps its
    sequence shard of the output (Replicate -> Shard(1) is a local slice). The backward is exact
    because the TP ranks compute identical gradients; the MoE's work is repeated tp times."""
    return {"feed_forward": PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)}


def _mask_padded_logits(output: nn.Module, tp_mesh: DeviceMesh, real_vocab: int) -> None:
    total = output.weight.shape[0]
    mask = torch.zeros(total, device="cpu")  # not the weight's device: that is meta while the model is built
    mask[real_vocab:] = float("-inf")
    mask = distribute_tensor(mask, tp_mesh, [Shard(0)])  # on the mesh's device, sharded like the logits' last dim
    output.register_forward_hook(lambda module, inputs, logits: logits + mask)
