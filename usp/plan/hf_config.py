"""A Hugging Face checkpoint's `config.json` against usp's model group, at plan time (pure Python):
a `model.init_from` run takes the checkpoint's shape (the model keys no recipe or command line set,
left MISSING by usp/config/init_from.py, are filled from config.json), and a key that was set and
disagrees is refused before launch. The field mapping is usp/contract/hf_shape.py's; what usp's
model can't express (another model type, biases, another activation, a RoPE type other than default,
llama3 and yarn, sliding windows, dense layers between MoE layers, a shared expert) is refused by name."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from usp.contract.config_schema import ModelConfig
from usp.contract.hf_shape import (
    ARCHITECTURES,
    CHECKPOINT_KEYS,
    CONFIG,
    DEEPSEEK_FIELDS,
    HF_DEFAULTS,
    HF_ROPE,
    MOE_TYPES,
    QK_NORM_TYPES,
    ROPE_REQUIRED,
    ROPE_VALUES,
    usp_fields,
)
from usp.errors import PlanError
from usp.plan.rules import ROPE_TYPES
from usp.run.names import name_problem


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


def hf_rope(config: dict) -> dict:
    """RoPE as transformers reads a config.json: {"rope_type", "rope_theta"} and the scaling values its
    type reads (ROPE_VALUES) under config.json's names, None where absent. `rope_scaling` (transformers
    < 5, Meta's and DeepSeek's own files, whose `type` is rope_type's older name) wins over
    `rope_parameters` (transformers >= 5); rope_theta may sit at the top level (older files); an absent
    original_max_position_embeddings is the top-level one, else max_position_embeddings; YaRN without a
    factor has max_position_embeddings / original_max_position_embeddings (transformers' rule)."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    default_theta = HF_DEFAULTS.get(str(config.get("model_type")), HF_DEFAULTS["llama"])["rope_theta"]
    out = {"rope_type": params.get("rope_type", params.get("type", "default")),
           "rope_theta": float(params.get("rope_theta", config.get("rope_theta", default_theta)))}
    if out["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", config.get("original_max_position_embeddings",
                                                                         config.get("max_position_embeddings")))
    original, longest = params.get("original_max_position_embeddings"), config.get("max_position_embeddings")
    if out["rope_type"] == "yarn" and params.get("factor") is None and original and longest:
        params["factor"] = longest / original
    out.update({HF_ROPE[k]: params.get(HF_ROPE[k]) for k in ROPE_VALUES.get(str(out["rope_type"]), ())})
    return out




# HF field -> the usp key that sets it (what the error tells the user to change)
_USP_KEY = {"model_type": "model.n_experts", "hidden_size": "model.dim", "num_hidden_layers": "model.n_layers",
            "num_attention_heads": "model.n_heads", "num_key_value_heads": "model.n_kv_heads",
            "head_dim": "model.head_dim", "intermediate_size": "model.ffn_dim", "vocab_size": "model.vocab_size",
            "num_experts": "model.n_experts", "moe_intermediate_size": "model.moe_ffn_dim",
            "norm_topk_prob": "model.router_norm_topk",
            "tie_word_embeddings": "model.tie_embeddings", "rope_theta": "model.rope_theta",
            "rms_norm_eps": "model.norm_eps", "num_local_experts": "model.n_experts",
            "num_experts_per_tok": "model.top_k", "rope_parameters.rope_type": "model.rope_type",
            "q_lora_rank": "model.q_lora_rank", "n_shared_experts": "model.n_shared_experts",
            **{hf: f"model.{usp}" for hf, usp in DEEPSEEK_FIELDS.items()},
            **{f"rope_parameters.{hf}": f"model.rope_{k}" for k, hf in HF_ROPE.items()}}


def check_hf_config(config: dict, model: Any, vocab: int, path: str) -> None:
    """Raise a PlanError naming the first config.json field that disagrees with the model (a key a
    recipe or the command line set; the others were filled from config.json) or that usp's model
    can't express."""
    _check_supported(config, path)
    kind = config["model_type"]
    if kind in MOE_TYPES and model.shared_expert:
        raise PlanError(f"{ARCHITECTURES[kind]} has no shared expert", key="model.shared_expert", value=True,
                        fix="model.shared_expert=false")
    if kind == "mixtral" and not getattr(model, "router_norm_topk", True):
        raise PlanError("Mixtral renormalises the top-k router probabilities", key="model.router_norm_topk",
                        value=False, fix="model.router_norm_topk=true")
    _check_router(kind, model)
    want = usp_fields(model, vocab)
    rope = hf_rope(config)
    hf = {**HF_DEFAULTS[kind], **{k: v for k, v in config.items() if v is not None},
          "rope_theta": rope.pop("rope_theta"), **{f"rope_parameters.{k}": v for k, v in rope.items()},
          "head_dim": _head_dim(config)}
    hf.setdefault("num_key_value_heads", hf.get("num_attention_heads"))
    if "q_lora_rank" in config:  # null: DeepSeek's full q projection, not the default rank
        hf["q_lora_rank"] = config["q_lora_rank"]
    hf.setdefault("tie_word_embeddings", False)  # transformers' default for these four types
    if kind == "qwen3_moe":
        hf["num_experts"] = _n_experts(config)
    for field, value in want.items():
        have = hf.get(field)
        same = (isinstance(value, float) and isinstance(have, int | float) and abs(have - value) <= 1e-9 * abs(value)) \
            or have == value
        if not same:
            raise _disagrees(field, have, value, want["model_type"], path)


def _check_router(kind: str, model: Any) -> None:
    """DeepSeek-V3 routes by sigmoid scores; the other types by a softmax over one group of experts, their
    weights unscaled, with a MoE layer in every block."""
    deepseek = kind == "deepseek_v3"
    if deepseek and int(model.n_experts or 0) and str(model.router_score) != "sigmoid":
        raise PlanError("DeepSeek-V3's router scores are sigmoids", key="model.router_score", value=model.router_score,
                        fix="model.router_score=sigmoid")
    if deepseek:
        return
    for key, usp_has in (("router_score", "softmax"), ("router_groups", 1), ("router_topk_groups", 1),
                         ("router_scale", 1.0), ("n_dense_layers", 0)):
        if getattr(model, key) != usp_has:
            raise PlanError(f"{ARCHITECTURES[kind]} has no equivalent of model.{key}={getattr(model, key)!r} "
                            "(a DeepSeek-V3 option)", key=f"model.{key}", value=getattr(model, key),
                            fix=f"model.{key}={usp_has}")


def _disagrees(field: str, have: Any, value: Any, model_type: str, path: str) -> PlanError:
    key = _USP_KEY[field]
    if field == "intermediate_size" and model_type == "mixtral":
        key = "model.moe_ffn_dim"
    if field == "model_type" and (have in QK_NORM_TYPES) != (model_type in QK_NORM_TYPES):
        key = "model.qk_norm"
    fix = f"{key}={have}" if field != "model_type" else "pick the model group that matches this checkpoint"
    return PlanError(f"the Hugging Face checkpoint's config.json has {field}={have!r}, but the model has {value!r} "
                     f"({key}, set by the command line, the recipe or the model group it picks)",
                     key="model.init_from", value=path,
                     fix=f"{fix}, or leave {key} unset and config.json gives it (or another checkpoint)")


def _check_supported(config: dict, path: str) -> None:
    """Features of config.json that usp's Llama has no equivalent for."""
    def refuse(field: str, value: Any, why: str) -> PlanError:
        return PlanError(f"config.json has {field}={value!r}: {why}", key="model.init_from", value=path,
                         fix=f"a checkpoint of one of the model types {', '.join(ARCHITECTURES)} without it")

    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise refuse("model_type", model_type, f"usp imports the model types {', '.join(ARCHITECTURES)} "
                                               "(docs/models.md says what else is not supported)")
    if config.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", config["hidden_act"], "usp's feed-forward is SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            raise refuse(field, config[field], "usp's linear layers have no bias")
    rope = hf_rope(config)
    if rope["rope_type"] not in ROPE_TYPES:
        raise refuse("rope_parameters.rope_type", rope["rope_type"],
                     f"usp implements the RoPE types {' and '.join(ROPE_TYPES)}")
    for field in (HF_ROPE[k] for k in ROPE_REQUIRED.get(rope["rope_type"], ())):
        if rope[field] is None:
            raise refuse(f"rope_parameters.{field}", None, f"rope_type {rope['rope_type']} needs it")
    _check_attention_span(config, refuse)
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        value = config.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise refuse(field, value, "usp reads the model's shape from it: a positive integer")
    head_dim = _head_dim(config)
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 2 or head_dim % 2:
        raise refuse("head_dim", head_dim, "usp's attention heads are head_dim wide: a positive even integer "
                                           "(RoPE rotates pairs of channels)")
    if model_type == "qwen3_moe":
        for field, usp_has in (("decoder_sparse_step", 1), ("mlp_only_layers", [])):
            if (config.get(field) or usp_has) != usp_has:
                raise refuse(field, config[field], "usp's MoE model has a MoE layer in every block")


def _check_attention_span(config: dict, refuse) -> None:
    """Full causal attention in every layer: no sliding window (Qwen3's is off unless use_sliding_window,
    as transformers reads it), and layer_types, where given, all full_attention."""
    qwen = config.get("model_type") in QK_NORM_TYPES
    if qwen and config.get("use_sliding_window"):
        raise refuse("use_sliding_window", True, "usp's attention is full causal attention")
    if not qwen and config.get("sliding_window") is not None:
        raise refuse("sliding_window", config["sliding_window"], "usp's attention is full causal attention")
    other = sorted({str(t) for t in config.get("layer_types") or []} - {"full_attention"})
    if other:
        raise refuse("layer_types", other, "usp's attention is full causal attention in every layer")


def _head_dim(config: dict) -> Any:
    """config.json's head_dim as transformers reads it: its own, the model type's default (Qwen3: 128),
    else hidden_size / num_attention_heads."""
    if config.get("model_type") == "deepseek_v3":  # RoPE's part of a latent attention head (HF sets head_dim to it)
        return config.get("qk_rope_head_dim", HF_DEFAULTS["deepseek_v3"]["qk_rope_head_dim"])
    given = config.get("head_dim") or HF_DEFAULTS.get(str(config.get("model_type")), {}).get("head_dim")
    if given is not None:
        return given
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads))
    return hidden // heads if ok else None  # type: ignore[operator]


def _n_experts(config: dict) -> int:
    """Qwen3-MoE's experts: num_experts (num_local_experts is its alias in transformers), or the default."""
    value = config.get("num_experts", config.get("num_local_experts"))
    return int(HF_DEFAULTS["qwen3_moe"]["num_experts"] if value is None else value)


def usp_values(config: dict, path: str) -> dict:
    """The model keys config.json decides (usp/contract/hf_shape.py CHECKPOINT_KEYS) as usp values,
    transformers' defaults for the fields it leaves out; the model is named after its directory."""
    _check_supported(config, path)
    model_type = config["model_type"]
    hf = {**HF_DEFAULTS[model_type], **{k: v for k, v in config.items() if v is not None}}
    if "q_lora_rank" in config:  # null: DeepSeek's full q projection, not the default rank
        hf["q_lora_rank"] = config["q_lora_rank"]
    rope = hf_rope(config)
    n_heads = int(hf["num_attention_heads"])
    given_head_dim = config.get("head_dim") or HF_DEFAULTS[model_type].get("head_dim")
    values = {"name": _model_name(path), "dim": int(hf["hidden_size"]), "n_layers": int(hf["num_hidden_layers"]),
              "n_heads": n_heads, "n_kv_heads": int(hf.get("num_key_value_heads") or n_heads),
              "head_dim": None if given_head_dim is None else int(given_head_dim),
              "qk_norm": model_type in QK_NORM_TYPES, "ffn_dim": int(hf["intermediate_size"]), "moe_ffn_dim": 0,
              "vocab_size": int(hf["vocab_size"]), "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
              "rope_theta": rope["rope_theta"], "rope_type": rope["rope_type"], "norm_eps": float(hf["rms_norm_eps"]),
              "n_experts": 0, "top_k": ModelConfig.top_k, "shared_expert": False, "router_norm_topk": True,
              **{k: getattr(ModelConfig, k) for k in ("n_shared_experts", "router_score", "router_groups",
                                                      "router_topk_groups", "router_scale", "n_dense_layers",
                                                      "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                                      "qk_rope_head_dim", "v_head_dim", "rope_interleave")}}
    if model_type == "mixtral":
        values.update(n_experts=int(hf["num_local_experts"]), top_k=int(hf["num_experts_per_tok"]))
    if model_type == "qwen3_moe":
        values.update(n_experts=_n_experts(config), top_k=int(hf["num_experts_per_tok"]),
                      moe_ffn_dim=int(hf["moe_intermediate_size"]), router_norm_topk=bool(hf["norm_topk_prob"]))
    if model_type == "deepseek_v3":
        values.update(_deepseek_values(hf))
    values.update({f"rope_{k}": rope.get(hf) for k, hf in HF_ROPE.items()})
    assert set(values) == set(CHECKPOINT_KEYS), set(values) ^ set(CHECKPOINT_KEYS)
    return values


def _deepseek_values(hf: dict) -> dict:
    """A DeepSeek-V3 config.json's usp values (`hf`: with transformers' defaults): latent attention, sigmoid
    group routing, the shared experts, the dense first layers (all of them: a dense model). Its multi-token
    prediction module (num_nextn_predict_layers) is not usp's: its weights are skipped (docs/models.md)."""
    values = {usp: hf[field] for field, usp in DEEPSEEK_FIELDS.items()}
    shared = int(hf["n_shared_experts"] or 0)
    values.update(head_dim=None, n_kv_heads=int(hf["num_attention_heads"]), q_lora_rank=int(hf["q_lora_rank"] or 0),
                  top_k=int(hf["num_experts_per_tok"]), router_score="sigmoid",
                  router_scale=float(hf["routed_scaling_factor"]), shared_expert=shared > 0,
                  n_shared_experts=max(shared, 1), rope_interleave=bool(hf["rope_interleave"]),
                  router_norm_topk=bool(hf["norm_topk_prob"]))
    if int(hf["first_k_dense_replace"]) >= int(hf["num_hidden_layers"]):  # no MoE layer
        values.update(n_experts=0, n_dense_layers=0, moe_ffn_dim=0, router_groups=1, router_topk_groups=1,
                      router_scale=1.0, shared_expert=False, n_shared_experts=1, top_k=ModelConfig.top_k)
    return values


def _model_name(path: str) -> str:
    """The checkpoint directory's name as model.name (a run directory is named after it), made a valid
    name (usp.run.names) where it isn't one."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(path).expanduser().resolve().name).lstrip("._-")
    return name if name_problem(name) is None else "hf_model"


def adopt_hf_shape(model: Any) -> dict:
    """Fill the model keys left MISSING for model.init_from's checkpoint (usp/config/init_from.py:
    the keys no recipe or command line set) from its config.json, in place; returns what was filled.
    Idempotent: nothing is missing the second time."""
    if not isinstance(model, DictConfig):  # a typed config has every value
        return {}
    missing = [k for k in CHECKPOINT_KEYS if OmegaConf.is_missing(model, k)]  # left for config.json
    if not missing:
        return {}
    init_from = model.init_from
    values = usp_values(read_hf_config(init_from), str(init_from))
    for key in missing:
        model[key] = values[key]
    return {key: values[key] for key in missing}
