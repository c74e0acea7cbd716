"""Hugging Face checkpoints against the real `transformers`, in this process: tiny random Llama /
Mixtral / Qwen3 / Qwen3-MoE models made on the fly with save_pretrained (nothing downloaded) load with
logits equal within 1e-5, with and without Llama 3's RoPE scaling, and export back; a config.json that doesn't
match the model group, or a key set on the command line, in a recipe or by a picked model group
that disagrees with it, is refused before launch (training on an import, `model.init_from` alone
taking the shape from config.json, and exporting: tests/e2e/test_hf_checkpoint.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import hf_tensors, usp_cli
from usp.contract.config_schema import ModelConfig
from usp.contract.plan_file import read_plan

DIMS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.1)
USP_DIMS = ["model.dim=64", "model.ffn_dim=96", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"]
TOL = 1e-5
# Llama 3's RoPE scaling with a short original context: at head_dim 16 its wavelengths fall in all three
# bands (kept, interpolated, divided by the factor), so the scaling shows in the logits.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
USP_LLAMA3 = dict(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                  rope_original_max_positions=32)
# YaRN over a 16-token original context (48-token inputs reach past it): Qwen3's form (no mscale: cos and sin
# x 0.1 ln 4 + 1) and DeepSeek-V3's (beta 32 / 1, mscale = mscale_all_dim = 1: the softmax scale x mscale^2)
YARN = {"qwen3": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        "deepseek_v3": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
USP_YARN = {kind: {f"rope_{k}": v for k, v in (("type", "yarn"), ("factor", 4.0), ("original_max_positions", 16),
                                               *((k, rope[k]) for k in ("beta_fast", "beta_slow", "mscale",
                                                                        "mscale_all_dim") if k in rope))}
            for kind, rope in YARN.items()}


# Qwen3's attention: heads of head_dim 24, not hidden_size / heads = 16 (Qwen3-0.6B: 128, not 64), QK-norm;
# Qwen3-MoE's experts of their own hidden size (moe_intermediate_size), top-2 of 4, renormalised or not
QWEN3 = dict(head_dim=24)
QWEN3_MOE = dict(head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
# DeepSeek-V3: latent attention (a low-rank q or none, KV latent 32, RoPE part 8 shared by the heads, interleaved
# or not), a dense first layer, 8 sigmoid-scored experts in 4 groups of which 2 are picked, top-2, scaled by 2.5,
# a shared expert twice an expert's width; usp's values of the same (USP_KIND)
DEEPSEEK = dict(num_key_value_heads=4, moe_intermediate_size=32, n_shared_experts=2, n_routed_experts=8,
                routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
                qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                norm_topk_prob=True)
DEEPSEEK_PLAIN = dict(DEEPSEEK, q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False, rope_interleave=False,
                      routed_scaling_factor=1.0)
USP_DEEPSEEK = dict(kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                    rope_interleave=True, n_experts=8, top_k=2, moe_ffn_dim=32, shared_expert=True, n_shared_experts=2,
                    router_score="sigmoid", router_groups=4, router_topk_groups=2, router_scale=2.5, n_dense_layers=1)
# usp's model options of each kind (LlamaArgs / ModelConfig fields beside the shape of DIMS)
USP_KIND = {"llama": {}, "llama3": USP_LLAMA3, "mixtral": dict(n_experts=4, top_k=2),
            "qwen3": dict(head_dim=24, qk_norm=True),
            "qwen3_moe": dict(head_dim=24, qk_norm=True, n_experts=4, top_k=2, moe_ffn_dim=48),
            "qwen3_moe_unnormalised": dict(head_dim=24, qk_norm=True, n_experts=4, top_k=2, moe_ffn_dim=48,
                                           router_norm_topk=False),
            "deepseek_v3": USP_DEEPSEEK,
            "deepseek_v3_plain": dict(USP_DEEPSEEK, q_lora_rank=0, router_groups=1, router_topk_groups=1,
                                      router_norm_topk=False, rope_interleave=False, router_scale=1.0)}
USP_KIND.update({f"{kind}_yarn": {**USP_KIND[kind], **USP_YARN[kind]} for kind in YARN})


def make_hf(directory: Path, kind: str, vocab: int, tied: bool, **dims) -> Path:
    """A random tiny LlamaForCausalLM (kind "llama", or "llama3": with Llama 3's RoPE scaling),
    MixtralForCausalLM, Qwen3ForCausalLM or Qwen3MoeForCausalLM ("qwen3_moe"; "qwen3_moe_unnormalised":
    norm_topk_prob false) or DeepseekV3ForCausalLM (a kind ending "_yarn": with YaRN's scaling, YARN), saved
    with save_pretrained; `dims` replace DIMS' values. Every RMSNorm weight is drawn around 1 (transformers
    initialises them to 1, which would hide a norm read as another)."""
    import transformers as tf

    torch.manual_seed(0)
    dims = {**DIMS, **dims}
    if kind == "llama3":
        dims["rope_parameters"] = {**LLAMA3_ROPE, "rope_theta": dims.pop("rope_theta")}
    if kind.endswith("_yarn"):
        kind = kind.removesuffix("_yarn")
        dims["rope_parameters"] = {**YARN[kind], "rope_theta": dims.pop("rope_theta")}
    common = dict(vocab_size=vocab, tie_word_embeddings=tied)
    if kind in ("llama", "llama3"):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**dims, **common))
    elif kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**dims, **common, num_local_experts=4, num_experts_per_tok=2))
    elif kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**{**dims, **QWEN3}, **common))
    elif kind.startswith("deepseek_v3"):
        shape = DEEPSEEK if kind == "deepseek_v3" else DEEPSEEK_PLAIN
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**{**dims, **shape}, **common))
    else:
        topk = {"norm_topk_prob": kind == "qwen3_moe"}
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**{**dims, **QWEN3_MOE, **topk}, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias, which picks the experts
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.2, 0.2)
    # DeepSeek-V3 in several files (each rank reads its parts from whichever holds them)
    model.save_pretrained(directory, **({"max_shard_size": "100KB"} if kind.startswith("deepseek") else {}))
    return directory


def usp_model(kind: str, vocab: int, tied: bool):
    from usp.models.llama import Llama, LlamaArgs

    return Llama(LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=vocab,
                           tie_embeddings=tied, **USP_KIND[kind]), max_seq_len=64)


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("llama3", False), ("mixtral", False),
                                       ("qwen3", True), ("qwen3", False), ("qwen3_moe", False),
                                       ("qwen3_moe_unnormalised", False), ("deepseek_v3", False),
                                       ("deepseek_v3_plain", True), ("qwen3_yarn", False),
                                       ("deepseek_v3_yarn", False)])
def test_import_matches_transformers_logits(tmp_path, kind, tied):
    """An HF checkpoint loaded into usp's model gives transformers' logits (q/k as they are: the same
    RoPE layout; Llama 3's frequency scaling; experts stacked and transposed; Qwen3's head_dim and
    QK-norm; Qwen3-MoE's router with and without norm_topk_prob), and usp's own export of it loads back
    identically, as the same architecture. DeepSeek-V3: latent attention with and without the low-rank q, RoPE
    on interleaved pairs or not, a dense first layer, sigmoid group routing with its correction bias (the
    aux-loss-free expert_bias), scaled weights, a wide shared expert; split into several files."""
    from usp.engine.hf_checkpoint import load_hf_weights, write_hf

    src = make_hf(tmp_path / "hf", kind, 100, tied)
    model = usp_model(kind, 100, tied)
    load_hf_weights(model, src)
    tokens = torch.randint(0, 100, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
    expected = hf_logits(src, tokens)
    assert ours.abs().max() > 0.1  # logits large enough for 1e-5 to say something
    assert torch.allclose(ours, expected, rtol=0, atol=TOL), (ours - expected).abs().max()
    assert (model.output.weight is model.tok_embeddings.weight) == tied

    # usp -> HF again, in two shards: the same tensors under the same names, the index naming each
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, tie_embeddings=tied, rope_theta=10000.0,
                      norm_eps=1e-5, **USP_KIND[kind])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    write_hf(state, cfg, 100, 64, str(tmp_path / "no-dataset"), tmp_path / "ckpt", 0, tmp_path / "back",
             max_shard_mb=0.1)
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    original, back = hf_tensors(src), hf_tensors(tmp_path / "back")
    assert set(back) == set(index["weight_map"]) == set(original) - ({"lm_head.weight"} if tied else set())
    assert all(torch.equal(original[k], back[k]) for k in back)
    assert torch.allclose(hf_logits(tmp_path / "back", tokens), expected, rtol=0, atol=TOL)
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["architectures"] == json.loads((src / "config.json").read_text())["architectures"]
    scaled = {"llama3": LLAMA3_ROPE, **{f"{k}_yarn": v for k, v in YARN.items()}}.get(kind)
    if scaled is not None:  # the scaling is in the export's config.json, and it matters
        assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"] == \
            {**scaled, "rope_theta": 10000.0}
        plain = usp_model(kind.removesuffix("_yarn") if kind.endswith("_yarn") else "llama", 100, tied)
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (plain(tokens) - expected).abs().max() > 100 * TOL


def test_config_mismatch_is_refused_before_launch(tmp_path):
    """`usp plan` and `usp train` refuse an init_from whose config.json isn't the model group, naming the
    field and the key to change; a matching one plans."""
    src = make_hf(tmp_path / "hf", "llama", 512, tied=True)
    base = ["data.tokenizer=bytes", "model.vocab_size=512", *USP_DIMS, f"model.init_from={src}"]
    proc = usp_cli("plan", "--save", *base[:-1], "model.init_from=hf", f"train.runs_dir={tmp_path / 'saved'}",
                   "train.name=p", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # relative to where `usp plan` ran; the plan holds it absolute (ranks may start elsewhere)
    assert read_plan(tmp_path / "saved" / "p" / "plan.yaml").config.model.init_from == str(src.resolve())
    cases = [(["model.n_heads=8"], "num_attention_heads=4", "model.n_heads=4"),
             (["model.ffn_dim=128"], "intermediate_size=96", "model.ffn_dim=96"),
             (["model.vocab_size=1024"], "vocab_size=512", "model.vocab_size=512"),
             (["model.tie_embeddings=false"], "tie_word_embeddings=True", "model.tie_embeddings=True"),
             (["model.n_experts=4"], "model_type='llama'", "model group")]
    for i, (extra, field, fix) in enumerate(cases):
        for command in ("plan", "train") if i == 0 else ("plan",):
            proc = usp_cli(command, *base, *extra, f"train.runs_dir={tmp_path / 'runs'}", cwd=tmp_path)
            out = proc.stdout + proc.stderr
            assert proc.returncode == 2, (extra, command, out)
            assert "model.init_from=" in out and field in out and fix in out, (extra, out)
    assert not (tmp_path / "runs").exists()  # nothing launched, nothing written
    config = json.loads((src / "config.json").read_text())
    for rope, says in [({"rope_type": "longrope", "factor": 4.0}, "rope_parameters.rope_type='longrope'"),
                       ({"rope_type": "llama3", "factor": 8.0}, "rope_parameters.low_freq_factor=None")]:
        (src / "config.json").write_text(json.dumps({**config, "rope_parameters": {**rope, "rope_theta": 10000.0}}))
        proc = usp_cli("plan", *base, cwd=tmp_path)
        assert proc.returncode == 2 and says in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    proc = usp_cli("plan", *base[:-1], f"model.init_from={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2 and "no config.json" in proc.stdout + proc.stderr


# A checkpoint whose every shape value differs from the default model group's (tiny: dim 128, 2 layers,
# MHA, ffn 384, tied, rope_theta 1e4, norm_eps 1e-5): what `model.init_from` alone must take from it.
OWN_SHAPE = dict(num_hidden_layers=3, rms_norm_eps=1e-6, rope_theta=500000.0)


def test_an_explicit_key_that_disagrees_is_refused(tmp_path):
    """With model.init_from, a model key the command line or a recipe sets, or a model group either
    picks, must agree with config.json: `usp train` refuses it before launch, naming the field and the
    key; the same keys unset plan with config.json's values."""
    src = make_hf(tmp_path / "hf", "llama3", 512, False, **OWN_SHAPE)
    base = ["data.tokenizer=bytes", f"model.init_from={src}", f"train.runs_dir={tmp_path / 'runs'}"]
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults:\n  - config\n  - _self_\nmodel:\n  norm_eps: 1.0e-5\n")
    picked = tmp_path / "picks.yaml"
    picked.write_text("defaults:\n  - config\n  - override model: llama3_2_1b\n  - _self_\n")
    cases = [(["model.n_layers=2"], "num_hidden_layers=3", "model.n_layers"),
             (["model.rope_factor=32"], "rope_parameters.factor=8.0", "model.rope_factor"),
             (["model.rope_type=default"], "rope_parameters.rope_type='llama3'", "model.rope_type"),
             ([f"conf={recipe}"], "rms_norm_eps=1e-06", "model.norm_eps"),
             (["model=moe_tiny"], "model_type='llama'", "model.n_experts"),
             ([f"conf={picked}"], "hidden_size=64", "model.dim")]
    for extra, field, key in cases:
        proc = usp_cli("train", *base, *extra, cwd=tmp_path)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and field in out and key in out and "config.json" in out, (extra, out)
    assert not (tmp_path / "runs").exists()  # refused before anything was written
    agreeing = ["model.n_layers=3", "model.rope_factor=8.0", "model.norm_eps=1e-6", "model.n_kv_heads=2"]
    proc = usp_cli("plan", "--save", *base, *agreeing, "train.name=ok", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model = read_plan(tmp_path / "runs" / "ok" / "plan.yaml").config.model
    assert (model.dim, model.n_layers, model.tie_embeddings, model.vocab_size) == (64, 3, False, 512)


def test_deepseek_multi_token_prediction_is_said_skipped(tmp_path):
    """DeepSeek-V3's multi-token-prediction module (transformers' configs have num_nextn_predict_layers 1) is
    not usp's: `usp plan` says its weights are skipped, and plans the model without it."""
    src = make_hf(tmp_path / "hf", "deepseek_v3", 512, tied=False)
    assert json.loads((src / "config.json").read_text())["num_nextn_predict_layers"] == 1
    proc = usp_cli("plan", "data.tokenizer=bytes", f"model.init_from={src}", f"train.runs_dir={tmp_path / 'runs'}",
                   cwd=tmp_path, columns=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "multi-token-prediction module (num_nextn_predict_layers=1, model.layers.2.*) is skipped" in out, out


def test_deepseek_multi_token_prediction_in_and_out(tmp_path):
    """model.mtp_depth=1 on a transformers checkpoint (which has no MTP module): the main model loads with
    transformers' logits and the MTP block keeps its initialisation; the export writes it as DeepSeek's files
    do (model.layers.{n}: enorm, hnorm, eh_proj, shared_head.norm and a layer's tensors, num_nextn_predict_layers
    1), transformers still loads it with the same logits, and usp reads the block back from it."""
    from usp.engine.hf_checkpoint import load_hf_weights, write_hf
    from usp.models.llama import Llama, LlamaArgs

    src = make_hf(tmp_path / "hf", "deepseek_v3", 100, tied=False)
    args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=96, vocab_size=100, tie_embeddings=False,
                norm_eps=1e-5, mtp_depth=1, **USP_DEEPSEEK)
    model = Llama(LlamaArgs(**args), max_seq_len=64)
    model.init_weights(3)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("layers.2.")}
    load_hf_weights(model, src)
    assert all(torch.equal(p, initial[n]) for n, p in model.named_parameters() if n in initial)
    tokens = torch.randint(0, 100, (2, 48), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(src, tokens)
    with torch.no_grad():
        assert torch.allclose(model(tokens), expected, rtol=0, atol=TOL)
    cfg = ModelConfig(**{k: v for k, v in args.items() if k != "vocab_size"}, rope_theta=10000.0)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    write_hf(state, cfg, 100, 64, str(tmp_path / "no-dataset"), tmp_path / "ckpt", 0, tmp_path / "back")
    back = hf_tensors(tmp_path / "back")
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_b_proj.weight", "mlp.experts.7.down_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert f"model.layers.2.{name}" in back, name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert torch.allclose(hf_logits(tmp_path / "back", tokens), expected, rtol=0, atol=TOL)
    again = Llama(LlamaArgs(**args), max_seq_len=64)
    load_hf_weights(again, tmp_path / "back")
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in again.named_parameters())
