"""Hugging Face `config.json` <-> usp's model group, in pure Python (no torch, no transformers).

Used at plan time to check a `model.init_from` checkpoint against the model group (`usp plan` and
`usp train` refuse the same mismatch, before launch), and by `usp export --format hf` to write
the config.json that transformers reads. Two HF architectures map onto usp's Llama:

  model_type "llama"    LlamaForCausalLM     the dense model (model.n_experts = 0)
  model_type "mixtral"  MixtralForCausalLM   top-k routed SwiGLU experts (model.n_experts > 0)

Field by field (HF -> usp): hidden_size -> dim, num_hidden_layers -> n_layers,
num_attention_heads -> n_heads, num_key_value_heads -> n_kv_heads, intermediate_size -> ffn_dim
(Mixtral: the expert's hidden size, moe_ffn_dim or ffn_dim), vocab_size -> the model's
vocabulary, tie_word_embeddings -> tie_embeddings, rope_theta (or rope_parameters.rope_theta) ->
rope_theta, rms_norm_eps -> norm_eps, num_local_experts -> n_experts, num_experts_per_tok -> top_k.
What usp's model can't express (biases, another activation, RoPE scaling, sliding windows, a
shared expert) is refused by name."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from usp.errors import PlanError
from usp.perf.nodes import getter

CONFIG = "config.json"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}


def read_hf_config(path: str | Path, key: str = "model.init_from") -> dict:
    """The config.json of an HF checkpoint directory, or a PlanError naming `key`."""
    file = Path(path).expanduser() / CONFIG
    if not file.is_file():
        raise PlanError(f"no {CONFIG} in {path}: not a Hugging Face checkpoint directory", key=key, value=str(path),
                        fix="point it at a directory written by save_pretrained (config.json + *.safetensors)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"{file} is not readable JSON ({exc})", key=key, value=str(path)) from None
    if not isinstance(config, dict):
        raise PlanError(f"{file} is not a JSON object", key=key, value=str(path))
    return config


# bytes per value of the dtype a config.json names ("dtype" since transformers 4.56, "torch_dtype" before)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def checkpoint_value_bytes(config: dict) -> int:
    """Bytes per value of the checkpoint's tensors, as config.json names their dtype; 4 (fp32, the
    most a checkpoint usp loads holds) when it names none or another."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return DTYPE_BYTES.get(name, 4)


def hf_rope_theta(config: dict) -> float:
    """rope_theta from transformers >= 5 (rope_parameters) or older (top level); Llama's default."""
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def usp_fields(model: Any, vocab: int) -> dict:
    """The architecture of a model group (a ModelConfig, or the plan's dict) in HF's terms."""
    get = getter(model)
    n_heads, n_experts = int(get("n_heads")), int(get("n_experts") or 0)
    out = {
        "model_type": "mixtral" if n_experts > 0 else "llama",
        "hidden_size": int(get("dim")), "num_hidden_layers": int(get("n_layers")),
        "num_attention_heads": n_heads, "num_key_value_heads": int(get("n_kv_heads") or n_heads),
        "head_dim": int(get("dim")) // n_heads,
        "intermediate_size": int((get("moe_ffn_dim") or get("ffn_dim")) if n_experts else get("ffn_dim")),
        "vocab_size": int(vocab), "tie_word_embeddings": bool(get("tie_embeddings")),
        "rope_theta": float(get("rope_theta")), "rms_norm_eps": float(get("norm_eps")),
    }
    if n_experts:
        out.update(num_local_experts=n_experts, num_experts_per_tok=int(get("top_k")))
    return out


# HF field -> the usp key that sets it (what the error tells the user to change)
_USP_KEY = {"model_type": "model.n_experts", "hidden_size": "model.dim", "num_hidden_layers": "model.n_layers",
            "num_attention_heads": "model.n_heads", "num_key_value_heads": "model.n_kv_heads",
            "head_dim": "model.dim", "intermediate_size": "model.ffn_dim", "vocab_size": "model.vocab_size",
            "tie_word_embeddings": "model.tie_embeddings", "rope_theta": "model.rope_theta",
            "rms_norm_eps": "model.norm_eps", "num_local_experts": "model.n_experts",
            "num_experts_per_tok": "model.top_k"}


def check_hf_config(config: dict, model: Any, vocab: int, path: str) -> None:
    """Raise a PlanError naming the first config.json field that disagrees with the model group
    (or that usp's model can't express)."""
    _check_supported(config, model, path)
    want = usp_fields(model, vocab)
    hf = dict(config, rope_theta=hf_rope_theta(config))
    hf.setdefault("num_key_value_heads", hf.get("num_attention_heads"))
    if hf.get("head_dim") is None:
        hf["head_dim"] = want["head_dim"]  # derived from hidden_size / num_attention_heads
    hf.setdefault("tie_word_embeddings", False)  # transformers' default for Llama and Mixtral
    for field, value in want.items():
        have = hf.get(field)
        same = (isinstance(value, float) and isinstance(have, int | float) and abs(have - value) <= 1e-9 * abs(value)) \
            or have == value
        if not same:
            key = _USP_KEY[field]
            if field == "intermediate_size" and want["model_type"] == "mixtral":
                key = "model.moe_ffn_dim"
            fix = f"{key}={have}" if field not in ("model_type", "head_dim") else \
                "pick the model group that matches this checkpoint"
            raise PlanError(f"the Hugging Face checkpoint's config.json has {field}={have!r}, the model group gives "
                            f"{value!r}", key="model.init_from", value=path,
                            fix=f"{fix} (or another checkpoint)")


def _check_supported(config: dict, model: Any, path: str) -> None:
    """Features of config.json that usp's Llama has no equivalent for."""
    def refuse(field: str, value: Any, why: str) -> PlanError:
        return PlanError(f"config.json has {field}={value!r}: {why}", key="model.init_from", value=path,
                         fix="a Llama or Mixtral checkpoint without it")

    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise refuse("model_type", model_type, f"usp imports {' and '.join(ARCHITECTURES)} checkpoints")
    if config.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", config["hidden_act"], "usp's feed-forward is SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            raise refuse(field, config[field], "usp's linear layers have no bias")
    rope = config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default" or config.get("rope_scaling"):
        raise refuse("rope_parameters.rope_type", rope_type if rope_type != "default" else config["rope_scaling"],
                     "usp's RoPE has no frequency scaling (e.g. Llama 3.1's 'llama3')")
    if config.get("sliding_window") is not None:
        raise refuse("sliding_window", config["sliding_window"], "usp's attention is full causal attention")
    if model_type == "mixtral" and getter(model)("shared_expert"):
        raise PlanError("Mixtral has no shared expert", key="model.shared_expert", value=True,
                        fix="model.shared_expert=false")


def hf_config(model: dict, vocab: int, max_seq_len: int, dtype: str, extra: dict | None = None) -> dict:
    """The config.json transformers reads for a usp model (the plan's model section)."""
    fields = usp_fields(model, vocab)
    model_type = fields["model_type"]
    theta = fields.pop("rope_theta")
    config = {"architectures": [ARCHITECTURES[model_type]], **fields, "hidden_act": "silu",
              "max_position_embeddings": int(max_seq_len),
              # transformers >= 5 reads rope_parameters; older versions the top-level rope_theta
              "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_theta": theta,
              "initializer_range": float(model.get("init_std", 0.02)), "dtype": dtype, "use_cache": True}
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(sliding_window=None, router_aux_loss_coef=float(model.get("aux_loss_coef", 0.0) or 0.0),
                      output_router_logits=False)
    config.update(extra or {})
    return config
