"""The catalogue's Llama 3.1 / 3.2 and Qwen3 / Qwen3-MoE model groups against the published config.json
files (torch-free: composing and the config.json checks are the planner's); model types usp can't
build refused by name."""
from __future__ import annotations

import json

import pytest

from usp.errors import PlanError

# Meta's published config.json of Llama 3.1 8B and Llama 3.2 1B (the fields usp reads, as released).
META = {"llama3_1_8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
        "llama3_2_1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True)}
META_COMMON = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", attention_bias=False,
                   mlp_bias=False, max_position_embeddings=131072, rms_norm_eps=1e-05, rope_theta=500000.0)
META_SCALING = {"llama3_1_8b": 8.0, "llama3_2_1b": 32.0}


# the DeepSeek-V3 keys a group of another family leaves to config.json: off
DEEPSEEK_OFF = dict(n_shared_experts=1, router_score="softmax", router_groups=1, router_topk_groups=1, router_scale=1.0,
                    n_dense_layers=0, kv_lora_rank=0, q_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0,
                    v_head_dim=0, rope_interleave=False)
# YaRN's values, which a llama3-scaled config.json leaves unset
YARN_OFF = {f"rope_{k}": None for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                                        "truncate")}


@pytest.mark.parametrize("group", sorted(META))
def test_catalogue_llama3_groups_are_metas_config(tmp_path, group):
    """The catalogue's Llama 3.1 / 3.2 groups agree with Meta's config.json, RoPE scaling included: an
    import of the real checkpoint under the group plans, and without it takes the group's values."""
    from usp.config.compose import compose_config
    from usp.contract.hf_shape import CHECKPOINT_KEYS
    from usp.plan.hf_config import adopt_hf_shape, check_hf_config, read_hf_config

    rope_scaling = {"factor": META_SCALING[group], "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    (tmp_path / "config.json").write_text(json.dumps({**META_COMMON, **META[group], "rope_scaling": rope_scaling}))
    config = read_hf_config(tmp_path)
    explicit, _ = compose_config(None, [f"model={group}", f"model.init_from={tmp_path}"])
    # the group sets every key but the MoE ones (a dense Llama: no experts) and the Qwen3 ones
    assert adopt_hf_shape(explicit.model) == {"n_experts": 0, "top_k": 2, "moe_ffn_dim": 0, "shared_expert": False,
                                              "router_norm_topk": True, "qk_norm": False,
                                              "head_dim": META[group].get("head_dim"), **DEEPSEEK_OFF, **YARN_OFF}
    check_hf_config(config, explicit.model, 128256, str(tmp_path))  # raises on any disagreement
    alone, _ = compose_config(None, [f"model.init_from={tmp_path}"])
    adopt_hf_shape(alone.model)
    assert {k: alone.model[k] for k in CHECKPOINT_KEYS if k != "name"} == \
        {k: explicit.model[k] for k in CHECKPOINT_KEYS if k != "name"}


@pytest.mark.parametrize("field,value,says", [("head_dim", 31, "a positive even integer"),
                                              ("num_hidden_layers", -2, "a positive integer"),
                                              ("vocab_size", True, "a positive integer")])
def test_a_config_json_at_odds_with_itself_is_blamed_on_config_json(tmp_path, field, value, says):
    """Values that came from config.json are not blamed on "the command line, the recipe or the model
    group" (which set none of them)."""
    from usp.config.compose import compose_config
    from usp.plan.hf_config import adopt_hf_shape

    fields = {**META_COMMON, **META["llama3_2_1b"], "num_attention_heads": 32, "hidden_size": 512, field: value}
    if field != "head_dim":
        del fields["head_dim"]  # 1B's 64 would disagree with 512 / 32
    (tmp_path / "config.json").write_text(json.dumps(fields))
    alone, _ = compose_config(None, [f"model.init_from={tmp_path}"])
    with pytest.raises(PlanError) as err:
        adopt_hf_shape(alone.model)
    message = str(err.value)
    assert f"config.json has {field}={value!r}" in message and says in message
    assert "command line" not in message


# Qwen's published config.json files (Qwen/Qwen3-0.6B, -8B, -30B-A3B, -235B-A22B on the Hugging Face Hub), as released
QWEN_COMMON = dict(attention_bias=False, attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645, head_dim=128,
                   hidden_act="silu", initializer_range=0.02, max_position_embeddings=40960, rms_norm_eps=1e-06,
                   rope_scaling=None, rope_theta=1000000, sliding_window=None, torch_dtype="bfloat16",
                   use_cache=True, use_sliding_window=False, vocab_size=151936)
QWEN_MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], decoder_sparse_step=1,
                mlp_only_layers=[], norm_topk_prob=True, num_experts=128, num_experts_per_tok=8,
                output_router_logits=False, router_aux_loss_coef=0.001, tie_word_embeddings=False)
QWEN = {"qwen3_0_6b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024,
                           intermediate_size=3072, max_window_layers=28, num_attention_heads=16, num_hidden_layers=28,
                           num_key_value_heads=8, tie_word_embeddings=True),
        "qwen3_8b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=4096,
                         intermediate_size=12288, max_window_layers=36, num_attention_heads=32, num_hidden_layers=36,
                         num_key_value_heads=8, tie_word_embeddings=False),
        "qwen3_30b_a3b": dict(QWEN_MOE, hidden_size=2048, intermediate_size=6144, max_window_layers=48,
                              moe_intermediate_size=768, num_attention_heads=32, num_hidden_layers=48,
                              num_key_value_heads=4),
        "qwen3_235b_a22b": dict(QWEN_MOE, hidden_size=4096, intermediate_size=12288, max_window_layers=94,
                                moe_intermediate_size=1536, num_attention_heads=64, num_hidden_layers=94,
                                num_key_value_heads=4)}
# (total, active per token) parameters, Qwen's model cards: 0.6B, 8.2B, 30.5B / 3.3B, 235B / 22B; and the
# non-embedding counts the cards give (0.44B, 6.95B, 29.9B, 234B: without the embedding and an untied LM head)
QWEN_PARAMS = {"qwen3_0_6b": (0.6e9, 0.6e9, 0.44e9), "qwen3_8b": (8.2e9, 8.2e9, 6.95e9),
               "qwen3_30b_a3b": (30.5e9, 3.3e9, 29.9e9), "qwen3_235b_a22b": (235e9, 22e9, 234e9)}


@pytest.mark.parametrize("group", sorted(QWEN))
def test_catalogue_qwen3_groups_are_qwens_config(tmp_path, group):
    """Each Qwen3 group agrees with Qwen's config.json: an import of the released checkpoint under the
    group plans (head_dim 128 beside dim / heads, QK-norm, the experts and norm_topk_prob), and
    `model.init_from` alone takes the same values from the file."""
    from usp.config.compose import compose_config
    from usp.contract.hf_shape import CHECKPOINT_KEYS
    from usp.plan.hf_config import adopt_hf_shape, check_hf_config, read_hf_config

    (tmp_path / "config.json").write_text(json.dumps({**QWEN_COMMON, **QWEN[group]}))
    config = read_hf_config(tmp_path)
    explicit, _ = compose_config(None, [f"model={group}", f"model.init_from={tmp_path}"])
    filled = adopt_hf_shape(explicit.model)
    assert not {"dim", "n_heads", "head_dim", "qk_norm"} & set(filled), filled  # the group sets them
    check_hf_config(config, explicit.model, 151936, str(tmp_path))  # raises on any disagreement
    alone, _ = compose_config(None, [f"model.init_from={tmp_path}"])
    adopt_hf_shape(alone.model)
    assert {k: alone.model[k] for k in CHECKPOINT_KEYS if k != "name"} == \
        {k: explicit.model[k] for k in CHECKPOINT_KEYS if k != "name"}
    assert alone.model.head_dim == 128 and alone.model.qk_norm is True and alone.model.norm_eps == 1e-6
    assert alone.model.n_experts == QWEN[group].get("num_experts", 0)


@pytest.mark.parametrize("group", sorted(QWEN))
def test_qwen3_parameter_counts_are_the_published_ones(group):
    """The planner's closed-form counts (head_dim 128 wide q / o projections, QK-norm weights, all
    experts, top-8 active) against Qwen's model cards, within their rounding (2 %)."""
    from usp.config.compose import compose_config
    from usp.perf.specs import Arch

    cfg, _ = compose_config(None, [f"model={group}"])
    arch = Arch.from_model(cfg.model)
    active = arch.embed_params + arch.n_layers * (arch.active_layer_matmul_params + arch.norm_params) \
        + arch.head_params
    non_embedding = arch.total_params - arch.embed_params - (0 if arch.tie_embeddings else arch.embed_params)
    total_card, active_card, non_embedding_card = QWEN_PARAMS[group]
    for ours, card in ((arch.total_params, total_card), (active, active_card), (non_embedding, non_embedding_card)):
        assert abs(ours - card) <= 0.02 * card, (group, ours, card)
    assert arch.q_dim == arch.n_heads * 128 and arch.norm_params == 2 * arch.dim + 2 * 128
    # FLOPs: 6N + 12·L·(n_heads·head_dim)·s, the attention term at the query width
    assert arch.flops_per_token(4096) == 6 * arch.matmul_params + 12 * arch.n_layers * arch.n_heads * 128 * 4096


@pytest.mark.parametrize("model_type", ["gemma3", "gpt_oss", "deepseek_v32", None])
def test_an_unsupported_model_type_is_refused_naming_the_supported_ones(tmp_path, model_type):
    from usp.config.compose import compose_config
    from usp.plan.hf_config import adopt_hf_shape

    (tmp_path / "config.json").write_text(json.dumps({**QWEN_COMMON, **QWEN["qwen3_8b"], "model_type": model_type}))
    alone, _ = compose_config(None, [f"model.init_from={tmp_path}"])
    with pytest.raises(PlanError) as err:
        adopt_hf_shape(alone.model)
    message = str(err.value)
    assert f"model_type={model_type!r}" in message, message
    assert "llama, mixtral, qwen3, qwen3_moe, deepseek_v3" in message, message


@pytest.mark.parametrize("change,says", [({"use_sliding_window": True}, "use_sliding_window=True"),
                                         ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
                                         ({"mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
                                         ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
                                         ({"attention_bias": True}, "attention_bias=True")])
def test_qwen3_features_usp_lacks_are_refused(tmp_path, change, says):
    from usp.config.compose import compose_config
    from usp.plan.hf_config import adopt_hf_shape

    (tmp_path / "config.json").write_text(json.dumps({**QWEN_COMMON, **QWEN["qwen3_30b_a3b"], **change}))
    alone, _ = compose_config(None, [f"model.init_from={tmp_path}"])
    with pytest.raises(PlanError) as err:
        adopt_hf_shape(alone.model)
    assert f"config.json has {says}" in str(err.value), str(err.value)


@pytest.mark.parametrize("override,key,fix", [("model.head_dim=64", "model.head_dim", "model.head_dim=128"),
                                              ("model.qk_norm=false", "model.qk_norm", "model group"),
                                              ("model.router_norm_topk=false", "model.router_norm_topk",
                                               "model.router_norm_topk=True")])
def test_a_qwen3_option_at_odds_with_config_json_is_refused(tmp_path, override, key, fix):
    """head_dim, qk_norm (the model type) and router_norm_topk (norm_topk_prob) set against the file."""
    from usp.config.compose import compose_config
    from usp.plan.hf_config import adopt_hf_shape, check_hf_config, read_hf_config

    (tmp_path / "config.json").write_text(json.dumps({**QWEN_COMMON, **QWEN["qwen3_30b_a3b"]}))
    cfg, _ = compose_config(None, ["model=qwen3_30b_a3b", override, f"model.init_from={tmp_path}"])
    adopt_hf_shape(cfg.model)
    with pytest.raises(PlanError) as err:
        check_hf_config(read_hf_config(tmp_path), cfg.model, 151936, str(tmp_path))
    message = str(err.value)
    assert key in message and fix in message, message


# deepseek-ai/DeepSeek-V3's config.json (the fields usp reads; its quantization_config left out)
DEEPSEEK_V3 = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_act="silu",
                   attention_bias=False, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                   n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                   qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
                   num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840,
                   rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False, vocab_size=129280,
                   num_nextn_predict_layers=1, topk_method="noaux_tc", scoring_func="sigmoid",
                   rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


def test_deepseek_v3_group_is_deepseeks_config(tmp_path):
    """deepseek_v3_671b agrees with DeepSeek's config.json, its YaRN RoPE scaling included (rope_scaling's
    older `type` name); the file alone gives the group's shape; the planner counts DeepSeek's published 671 B
    parameters (without the multi-token-prediction module), 37 B active per token."""
    from usp.config.compose import compose_config
    from usp.contract.hf_shape import CHECKPOINT_KEYS
    from usp.perf.specs import Arch
    from usp.plan.hf_config import adopt_hf_shape, check_hf_config, read_hf_config

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    explicit, _ = compose_config(None, ["model=deepseek_v3_671b", f"model.init_from={tmp_path}"])
    # the group sets every key config.json decides but the Qwen3 ones, llama3's and the yarn ones DeepSeek leaves out
    assert adopt_hf_shape(explicit.model) == {"head_dim": None, "qk_norm": False, "rope_low_freq_factor": None,
                                              "rope_high_freq_factor": None, "rope_attention_factor": None,
                                              "rope_truncate": None}
    check_hf_config(read_hf_config(tmp_path), explicit.model, 129280, str(tmp_path))
    alone, _ = compose_config(None, [f"model.init_from={tmp_path}"])
    adopt_hf_shape(alone.model)
    assert {k: alone.model[k] for k in CHECKPOINT_KEYS if k not in ("name", "head_dim")} == \
        {k: explicit.model[k] for k in CHECKPOINT_KEYS if k not in ("name", "head_dim")}
    assert (alone.model.rope_type, alone.model.rope_factor, alone.model.rope_mscale_all_dim) == ("yarn", 40.0, 1.0)
    plain = {k: v for k, v in DEEPSEEK_V3.items() if k != "rope_scaling"}  # plain RoPE: the group's YaRN disagrees
    (tmp_path / "config.json").write_text(json.dumps(plain))
    explicit, _ = compose_config(None, ["model=deepseek_v3_671b", f"model.init_from={tmp_path}"])
    adopt_hf_shape(explicit.model)
    with pytest.raises(PlanError) as err:
        check_hf_config(read_hf_config(tmp_path), explicit.model, 129280, str(tmp_path))
    assert "rope_parameters.rope_type='default'" in str(err.value) and "model.rope_type=default" in err.value.fix
    arch = Arch.from_model(explicit.model)
    active = arch.matmul_params + arch.embed_params + arch.n_layers * arch.norm_params + arch.dim
    assert abs(arch.total_params - 671e9) <= 0.005 * 671e9 and abs(active - 37e9) <= 0.02 * 37e9, \
        (arch.total_params, active)


@pytest.mark.parametrize("override,key", [("model.router_score=softmax", "model.router_score"),
                                          ("model.router_groups=4", "model.router_groups"),
                                          ("model.q_lora_rank=0", "model.q_lora_rank"),
                                          ("model.n_dense_layers=1", "model.n_dense_layers")])
def test_a_deepseek_option_at_odds_with_config_json_is_refused(tmp_path, override, key):
    from usp.config.compose import compose_config
    from usp.plan.hf_config import adopt_hf_shape, check_hf_config, read_hf_config

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    cfg, _ = compose_config(None, ["model=deepseek_v3_671b", override, f"model.init_from={tmp_path}"])
    adopt_hf_shape(cfg.model)
    with pytest.raises(PlanError) as err:
        check_hf_config(read_hf_config(tmp_path), cfg.model, 129280, str(tmp_path))
    assert key in str(err.value), str(err.value)
