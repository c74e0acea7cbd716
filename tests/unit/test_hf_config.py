"""The catalogue's Llama 3.1 / 3.2 model groups against Meta's published config.json (torch-free:
composing and the config.json checks are the planner's)."""
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
    # the group sets every key but the MoE ones (a dense Llama: no experts)
    assert adopt_hf_shape(explicit.model) == {"n_experts": 0, "top_k": 2, "moe_ffn_dim": 0, "shared_expert": False}
    check_hf_config(config, explicit.model, 128256, str(tmp_path))  # raises on any disagreement
    alone, _ = compose_config(None, [f"model.init_from={tmp_path}"])
    adopt_hf_shape(alone.model)
    assert {k: alone.model[k] for k in CHECKPOINT_KEYS if k != "name"} == \
        {k: explicit.model[k] for k in CHECKPOINT_KEYS if k != "name"}


@pytest.mark.parametrize("field,value,says", [("head_dim", 32, "the file's own fields disagree"),
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
