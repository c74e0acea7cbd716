"""usp's Llama state dict <-> Hugging Face's LlamaForCausalLM / MixtralForCausalLM / Qwen3ForCausalLM /
Qwen3MoeForCausalLM, tensor by tensor (`model_type`: config.json's, which names the MoE tensors).

Names (usp -> HF; `layers.{i}` -> `model.layers.{i}`):

  tok_embeddings.weight                   model.embed_tokens.weight
  layers.{i}.attention_norm.weight        model.layers.{i}.input_layernorm.weight
  layers.{i}.attention.wq/wk/wv/wo        model.layers.{i}.self_attn.q_proj/k_proj/v_proj/o_proj
  layers.{i}.attention.q_norm/k_norm      model.layers.{i}.self_attn.q_norm/k_norm                  (Qwen3)
  layers.{i}.ffn_norm.weight              model.layers.{i}.post_attention_layernorm.weight
  layers.{i}.feed_forward.w1/w3/w2        model.layers.{i}.mlp.gate_proj/up_proj/down_proj          (dense)
  layers.{i}.feed_forward.router.weight   model.layers.{i}.block_sparse_moe.gate.weight             (Mixtral)
  layers.{i}.feed_forward.experts.w1[e]   model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight   (transposed)
  layers.{i}.feed_forward.experts.w3[e]   ... experts.{e}.w3.weight                                 (transposed)
  layers.{i}.feed_forward.experts.w2[e]   ... experts.{e}.w2.weight                                 (transposed)
  layers.{i}.feed_forward.router.weight   model.layers.{i}.mlp.gate.weight                          (Qwen3-MoE)
  layers.{i}.feed_forward.experts.w1/w3/w2[e]  model.layers.{i}.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
                                                                                          (Qwen3-MoE, transposed)
  DeepSeek-V3 (deepseek_v3): MLA (usp/models/mla.py) and its MoE layers, the dense ones as above:
  layers.{i}.attention.wq_a/q_a_norm/wq_b model.layers.{i}.self_attn.q_a_proj/q_a_layernorm/q_b_proj (wq: q_proj)
  layers.{i}.attention.wkv_a/kv_a_norm    model.layers.{i}.self_attn.kv_a_proj_with_mqa/kv_a_layernorm
  layers.{i}.attention.wkv_b              model.layers.{i}.self_attn.kv_b_proj
  layers.{i}.feed_forward.router.weight   model.layers.{i}.mlp.gate.weight
  layers.{i}.feed_forward.expert_bias     model.layers.{i}.mlp.gate.e_score_correction_bias (a buffer)
  layers.{i}.feed_forward.experts.w1/w3/w2[e]  model.layers.{i}.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
  layers.{i}.feed_forward.shared_expert.w1/w3/w2  model.layers.{i}.mlp.shared_experts.gate_proj/up_proj/down_proj
  layers.{n}.enorm/hnorm/eh_proj/head_norm  model.layers.{n}.enorm/hnorm/eh_proj/shared_head.norm (n = n_layers: the
                                          multi-token-prediction block, model.mtp_depth=1; its other tensors as a
                                          layer's. Without it, model.layers.{n}.* is skipped on import, as
                                          transformers skips it; its embed_tokens and shared_head.head, copies of
                                          the model's, are never read nor written)
  norm.weight                             model.norm.weight
  output.weight                           lm_head.weight    (absent when tied: tie_word_embeddings)

RoPE: usp rotates channel j with channel j + head_dim/2, as transformers' `rotate_half` does, so
q_proj and k_proj are usp's wq and wk row for row (no permutation: each tensor converts on its own,
and any shard of it is the same shard of HF's). usp checkpoints written before that layout change
(interleaved pairs) are converted on load: usp/models/rope_layout.py.

usp's stacked experts are (E, dim, hidden) for x @ w; HF's per-expert nn.Linear weights are
(hidden, dim) for x @ w.T: each expert's matrix is transposed. Pure tensor shuffling: no engine
code, no transformers import."""
from __future__ import annotations

import re
from collections.abc import Callable

import torch

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_DENSE = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
          "feed_forward.w2.weight": "mlp.down_proj.weight",
          "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
          "attention.wq_a.weight": "self_attn.q_a_proj.weight",
          "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
          "attention.wq_b.weight": "self_attn.q_b_proj.weight",
          "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
          "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
          "attention.wkv_b.weight": "self_attn.kv_b_proj.weight"}
# DeepSeek-V3's one-of-a-kind MoE tensors (the router as the others: mlp.gate.weight), and its multi-token-prediction
# block's own (usp's MTPBlock, layers.{n_layers})
_DEEPSEEK = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "head_norm.weight": "shared_head.norm.weight",
             "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
             "feed_forward.shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
             "feed_forward.shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight",
             "feed_forward.shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight"}
# model type -> (the MoE layer's module, usp's expert weight -> HF's per-expert module); the router is `<module>.gate`
_MOE = {"mixtral": ("block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"}),
        "qwen3_moe": ("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}),
        "deepseek_v3": ("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def hf_tensors(name: str, t: torch.Tensor, model_type: str) -> dict[str, torch.Tensor]:
    """The HF tensor(s) of one usp tensor (whole, vocabulary padding removed): one, or one per expert
    for stacked experts (each transposed). Works on meta tensors too (names and shapes only)."""
    names = hf_names(name, t.shape[0] if _is_experts(name) else 0, model_type)
    if _is_experts(name):
        return {n: t[e].t().contiguous() for e, n in enumerate(names)}
    return {names[0]: t.contiguous()}


def hf_names(name: str, n_experts: int, model_type: str) -> list[str]:
    """The HF tensors that make usp parameter `name` (one, or one per expert for stacked experts):
    what to read of a checkpoint to make that one parameter (`read_part`)."""
    if name in _TOP:
        return [_TOP[name]]
    layer, rest = _split(name, _LAYER)
    prefix = f"model.layers.{layer}."
    module, experts = _MOE.get(model_type, (None, {}))
    if module is not None and rest == "feed_forward.router.weight":
        return [f"{prefix}{module}.gate.weight"]
    if module is not None and _is_experts(name):
        which = experts[rest.rsplit(".", 1)[1]]
        return [f"{prefix}{module}.experts.{e}.{which}.weight" for e in range(n_experts)]
    if rest in _DENSE:
        return [prefix + _DENSE[rest]]
    if model_type == "deepseek_v3" and rest in _DEEPSEEK:
        return [prefix + _DEEPSEEK[rest]]
    raise KeyError(f"{name}: no Hugging Face {model_type} equivalent (e.g. a shared expert, a router bias)")


def usp_shape(name: str, hf_shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape of usp parameter `name` made of HF tensors of `hf_shapes` (in hf_names' order), or
    None when they can't make one (experts of different shapes)."""
    if not _is_experts(name):
        return tuple(hf_shapes[0])
    if len(set(map(tuple, hf_shapes))) != 1:
        return None
    return (len(hf_shapes), *reversed(hf_shapes[0]))


def read_part(name: str, index: tuple[slice, ...], n_experts: int, model_type: str,
              read: Callable[[str, tuple[slice, ...]], torch.Tensor]) -> torch.Tensor:
    """Part `index` (one slice per dimension of the whole usp tensor) of usp parameter `name`, made
    of what `read(hf_name, hf_index)` returns for the HF tensors it needs: a dense weight is HF's
    tensor itself (the same index of it), stacked experts are each expert's HF matrix transposed
    (the experts' slice picks the HF tensors, the other two index each one, swapped). A reader that
    fetches just `hf_index` reads just this part."""
    hf = hf_names(name, n_experts, model_type)
    if not _is_experts(name):
        return read(hf[0], index)
    experts, *rest = index
    return torch.stack([read(n, tuple(reversed(rest))).t() for n in hf[experts]])


def _is_experts(name: str) -> bool:
    m = _LAYER.match(name)
    return bool(m) and m.group(2).startswith("feed_forward.experts.")


def _split(name: str, pattern: re.Pattern) -> tuple[str, str]:
    m = pattern.match(name)
    if not m:
        raise KeyError(f"{name}: not a weight of usp's Llama usp knows")
    return m.group(1), m.group(2)
