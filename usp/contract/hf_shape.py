"""A usp model's shape in Hugging Face's terms (pure Python: no torch, no transformers): the
config.json fields of usp's architectures, and the config.json transformers reads for a usp model.
The planner checks a `model.init_from` checkpoint's config.json against them (usp/plan/hf_config.py);
`usp export --format hf` writes hf_config's. Five HF architectures map onto usp's Llama:

  model_type "llama"      LlamaForCausalLM      the dense model (model.n_experts = 0)
  model_type "mixtral"    MixtralForCausalLM    top-k routed SwiGLU experts (model.n_experts > 0)
  model_type "qwen3"      Qwen3ForCausalLM      the dense model with QK-norm (model.qk_norm)
  model_type "qwen3_moe"  Qwen3MoeForCausalLM   QK-norm and routed experts (router_norm_topk: norm_topk_prob)
  model_type "deepseek_v3" DeepseekV3ForCausalLM multi-head latent attention (model.kv_lora_rank > 0), its MoE
                                                 layers after n_dense_layers dense ones (docs/models.md)

Field by field (HF -> usp): hidden_size -> dim, num_hidden_layers -> n_layers,
num_attention_heads -> n_heads, num_key_value_heads -> n_kv_heads, head_dim -> head_dim (null when it
is hidden_size / num_attention_heads and config.json leaves it out), intermediate_size -> ffn_dim
(Mixtral: the expert's hidden size, moe_ffn_dim or ffn_dim; Qwen3-MoE: moe_intermediate_size is the
expert's), vocab_size -> the model's vocabulary, tie_word_embeddings -> tie_embeddings, rope_theta (or
rope_parameters.rope_theta) -> rope_theta, rope_scaling / rope_parameters (rope_type and the values of
HF_ROPE that the type reads, ROPE_VALUES: llama3's factor, low_freq_factor, high_freq_factor,
original_max_position_embeddings; yarn's factor, original_max_position_embeddings, beta_fast, beta_slow,
mscale, mscale_all_dim, attention_factor, truncate) -> rope_type, rope_<usp name>, rms_norm_eps -> norm_eps,
num_local_experts (Qwen3-MoE: num_experts) -> n_experts, num_experts_per_tok -> top_k, norm_topk_prob ->
router_norm_topk (Mixtral always renormalises); the model type -> qk_norm (the Qwen3 types have it);
a field config.json leaves out has transformers' default for that model type. DeepSeek-V3's own
(`DEEPSEEK_FIELDS`): n_routed_experts -> n_experts, moe_intermediate_size -> moe_ffn_dim, n_shared_experts
-> shared_expert (> 0) and n_shared_experts, n_group / topk_group -> router_groups / router_topk_groups,
routed_scaling_factor -> router_scale, first_k_dense_replace -> n_dense_layers, q_lora_rank (null: 0),
kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim (also its head_dim), v_head_dim, rope_interleave as
they are; its router scores are sigmoid (router_score)."""
from __future__ import annotations

from typing import Any

CONFIG = "config.json"
# The model keys a checkpoint's config.json decides: a model.init_from run leaves the ones no recipe or
# command line set MISSING (usp/config/init_from.py), and the planner fills them (usp/plan/hf_config.py).
CHECKPOINT_KEYS = ("name", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "qk_norm", "ffn_dim", "moe_ffn_dim",
                   "vocab_size", "tie_embeddings", "rope_theta", "rope_type", "rope_factor", "rope_low_freq_factor",
                   "rope_high_freq_factor", "rope_original_max_positions", "rope_beta_fast", "rope_beta_slow",
                   "rope_mscale", "rope_mscale_all_dim", "rope_attention_factor", "rope_truncate", "norm_eps",
                   "n_experts", "top_k",
                   "shared_expert", "router_norm_topk", "n_shared_experts", "router_score", "router_groups",
                   "router_topk_groups", "router_scale", "n_dense_layers", "kv_lora_rank", "q_lora_rank",
                   "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
# DeepSeek-V3's config.json field -> usp's model key, for those that are the same value
DEEPSEEK_FIELDS = {"n_routed_experts": "n_experts", "moe_intermediate_size": "moe_ffn_dim", "n_group": "router_groups",
                   "topk_group": "router_topk_groups", "routed_scaling_factor": "router_scale",
                   "first_k_dense_replace": "n_dense_layers", "kv_lora_rank": "kv_lora_rank",
                   "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
                   "v_head_dim": "v_head_dim", "rope_interleave": "rope_interleave",
                   "norm_topk_prob": "router_norm_topk"}
MOE_TYPES = ("mixtral", "qwen3_moe")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
# transformers' config defaults (LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig) for the fields a
# config.json may leave out; a Qwen3-MoE without head_dim has hidden_size / num_attention_heads
HF_DEFAULTS = {"llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
               "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2},
               "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 128},
               "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_experts": 128, "num_experts_per_tok": 8,
                             "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1},
               "deepseek_v3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "n_routed_experts": 256,
                               "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
                               "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
                               "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                               "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_interleave": True,
                               "norm_topk_prob": True, "num_nextn_predict_layers": 1}}
# config.json's name of each RoPE scaling value (model.rope_<usp name>)
HF_ROPE = {"factor": "factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
           "original_max_positions": "original_max_position_embeddings", "beta_fast": "beta_fast",
           "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim",
           "attention_factor": "attention_factor", "truncate": "truncate"}
# The RoPE types usp implements (transformers' rope_type names; usp/models/layers.py rope_inv_freq), the
# scaling values each reads (usp names), and those of them it can't do without (the others: transformers' defaults)
ROPE_VALUES = {"default": (), "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_positions"),
               "yarn": ("factor", "original_max_positions", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                        "attention_factor", "truncate")}
ROPE_REQUIRED = {"default": (), "llama3": ROPE_VALUES["llama3"], "yarn": ("factor", "original_max_positions")}


def model_type(model: Any) -> str:
    """The HF model type of a usp model: DeepSeek-V3's with latent attention, else Qwen3's with QK-norm,
    Llama's without; the MoE one of each with experts."""
    moe = int(model.n_experts or 0) > 0
    if int(getattr(model, "kv_lora_rank", 0) or 0) > 0:
        return "deepseek_v3"
    if getattr(model, "qk_norm", False):
        return "qwen3_moe" if moe else "qwen3"
    return "mixtral" if moe else "llama"


def usp_fields(model: Any, vocab: int) -> dict:
    """The architecture of a model group (a ModelConfig, or a composed config's model section) in HF's
    terms."""
    def get(key: str):
        return getattr(model, key)

    n_heads, kind = int(get("n_heads")), model_type(model)
    expert_ffn = int(get("moe_ffn_dim") or get("ffn_dim"))
    out = {
        "model_type": kind, "hidden_size": int(get("dim")), "num_hidden_layers": int(get("n_layers")),
        "num_attention_heads": n_heads, "num_key_value_heads": int(get("n_kv_heads") or n_heads),
        "head_dim": int(getattr(model, "head_dim", None) or int(get("dim")) // n_heads),
        "intermediate_size": expert_ffn if kind == "mixtral" else int(get("ffn_dim")),
        "vocab_size": int(vocab), "tie_word_embeddings": bool(get("tie_embeddings")),
        "rope_theta": float(get("rope_theta")), "rms_norm_eps": float(get("norm_eps")),
        "rope_parameters.rope_type": str(get("rope_type") or "default"),
    }
    out.update({f"rope_parameters.{HF_ROPE[k]}": get(f"rope_{k}")
                for k in ROPE_VALUES.get(str(out["rope_parameters.rope_type"]), ())})
    if kind == "mixtral":
        out.update(num_local_experts=int(get("n_experts")), num_experts_per_tok=int(get("top_k")))
    if kind == "qwen3_moe":
        out.update(num_experts=int(get("n_experts")), num_experts_per_tok=int(get("top_k")),
                   moe_intermediate_size=expert_ffn, norm_topk_prob=bool(getattr(model, "router_norm_topk", True)))
    if kind == "deepseek_v3":
        out.update(_deepseek_fields(model, n_heads))
    return out


def _deepseek_fields(model: Any, n_heads: int) -> dict:
    """DeepSeek-V3's own config.json fields of a usp model with latent attention (a dense one: no layer
    after first_k_dense_replace = n_layers is MoE)."""
    def get(key: str):
        return getattr(model, key)

    attention = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave")
    out = {hf: get(usp) for hf, usp in DEEPSEEK_FIELDS.items() if usp in attention}
    out.update(num_key_value_heads=n_heads, head_dim=int(get("qk_rope_head_dim")),
               q_lora_rank=int(get("q_lora_rank")) or None, rope_interleave=bool(get("rope_interleave")))
    if int(get("n_experts") or 0) == 0:
        return {**out, "first_k_dense_replace": int(get("n_layers"))}
    out.update({hf: get(usp) for hf, usp in DEEPSEEK_FIELDS.items() if usp not in attention})
    out.update(n_shared_experts=int(get("n_shared_experts")) if get("shared_expert") else 0,
               routed_scaling_factor=float(get("router_scale")), norm_topk_prob=bool(get("router_norm_topk")),
               num_experts_per_tok=int(get("top_k")), moe_intermediate_size=int(get("moe_ffn_dim") or get("ffn_dim")))
    return out


def hf_config(model: Any, vocab: int, max_seq_len: int, dtype: str, extra: dict | None = None) -> dict:
    """The config.json transformers reads for a usp model (the plan's model section)."""
    fields = usp_fields(model, vocab)
    kind = fields["model_type"]
    theta = fields.pop("rope_theta")
    # a value left unset (None) is left out: transformers' default for it is usp's
    rope = {k.split(".", 1)[1]: v for k in list(fields) if k.startswith("rope_parameters.")
            if (v := fields.pop(k)) is not None}
    config = {"architectures": [ARCHITECTURES[kind]], **fields, "hidden_act": "silu",
              "max_position_embeddings": int(max_seq_len),
              # transformers >= 5 reads rope_parameters; older versions the top-level rope_theta and
              # rope_scaling (which transformers 5 also reads, and prefers)
              "rope_parameters": {**rope, "rope_theta": theta}, "rope_theta": theta,
              "initializer_range": float(model.init_std), "dtype": dtype, "use_cache": True}
    if rope["rope_type"] != "default":
        config["rope_scaling"] = rope
    config.update(_type_fields(model, kind, int(fields["num_hidden_layers"])))
    config.update(extra or {})
    return config


def _type_fields(model: Any, kind: str, n_layers: int) -> dict:
    """The fields of one HF model type that say usp's choices (no biases, no sliding windows, every
    block's MLP a MoE layer, the router's loss weight)."""
    if kind == "llama":
        return {"attention_bias": False, "mlp_bias": False}
    moe = {"router_aux_loss_coef": float(model.aux_loss_coef or 0.0), "output_router_logits": False}
    if kind == "mixtral":
        return {"sliding_window": None, **moe}
    qwen = {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": n_layers, "layer_types": ["full_attention"] * n_layers}
    if kind == "qwen3":
        return qwen
    if kind == "deepseek_v3":  # the multi-token-prediction block, model.mtp_depth
        return {"attention_bias": False, "output_router_logits": False,
                "num_nextn_predict_layers": int(getattr(model, "mtp_depth", 0) or 0)}
    return {**qwen, **moe, "decoder_sparse_step": 1, "mlp_only_layers": []}
