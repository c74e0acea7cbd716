"""Hugging Face checkpoints against the real `transformers`, in this process: tiny random Llama /
Mixtral models made on the fly with save_pretrained (nothing downloaded) load with logits equal
within 1e-5 and export back; a config.json that doesn't match the model group is refused before
launch (training on an import and exporting it: tests/e2e/test_hf_checkpoint.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import usp_cli
from usp.run.files import read_plan

DIMS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.1)


USP_DIMS = ["model.dim=64", "model.ffn_dim=96", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"]


TOL = 1e-5


def make_hf(directory: Path, kind: str, vocab: int, tied: bool) -> Path:
    """A random tiny LlamaForCausalLM or MixtralForCausalLM saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**DIMS, vocab_size=vocab, tie_word_embeddings=tied))
    else:
        model = MixtralForCausalLM(MixtralConfig(**DIMS, vocab_size=vocab, tie_word_embeddings=tied,
                                                 num_local_experts=4, num_experts_per_tok=2))
    model.save_pretrained(directory)
    return directory


def usp_model(kind: str, vocab: int, tied: bool):
    from usp.models.llama import Llama, LlamaArgs

    moe = dict(n_experts=4, top_k=2) if kind == "mixtral" else {}
    return Llama(LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=vocab,
                           tie_embeddings=tied, **moe), max_seq_len=64)


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("mixtral", False)])
def test_import_matches_transformers_logits(tmp_path, kind, tied):
    """An HF checkpoint loaded into usp's model gives transformers' logits (the RoPE rows of q/k
    permuted, experts stacked and transposed), and usp's own export of it loads back identically."""
    from usp.engine.hf_checkpoint import load_hf_weights, read_hf_tensors, write_hf

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
    plan = {"batch": {"seq_len": 64}, "dataset_dir": str(tmp_path / "no-dataset")}
    cfg = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96, "vocab_size": 100,
           "tie_embeddings": tied, "rope_theta": 10000.0, "norm_eps": 1e-5, "n_experts": 4 if kind == "mixtral" else 0,
           "top_k": 2, "moe_ffn_dim": 0}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    write_hf(state, cfg, plan, tmp_path / "ckpt", 0, tmp_path / "back", max_shard_mb=0.1)
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    original, back = read_hf_tensors(src), read_hf_tensors(tmp_path / "back")
    assert set(back) == set(index["weight_map"]) == set(original) - ({"lm_head.weight"} if tied else set())
    assert all(torch.equal(original[k], back[k]) for k in back)
    assert torch.allclose(hf_logits(tmp_path / "back", tokens), expected, rtol=0, atol=TOL)


def test_config_mismatch_is_refused_before_launch(tmp_path):
    """`usp plan` and `usp train` refuse an init_from whose config.json isn't the model group, naming the
    field and the key to change; a matching one plans."""
    src = make_hf(tmp_path / "hf", "llama", 512, tied=True)
    base = ["data.tokenizer=bytes", "model.vocab_size=512", *USP_DIMS, f"model.init_from={src}"]
    proc = usp_cli("plan", "--save", *base[:-1], "model.init_from=hf", f"train.runs_dir={tmp_path / 'saved'}",
                   "train.name=p", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # relative to where `usp plan` ran; the plan holds it absolute (ranks may start elsewhere)
    assert read_plan(tmp_path / "saved" / "p" / "plan.yaml")["config"]["model"]["init_from"] == str(src.resolve())
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
    (src / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "llama3",
                                                                               "rope_theta": 10000.0}}))
    proc = usp_cli("plan", *base, cwd=tmp_path)
    assert proc.returncode == 2 and "rope_parameters.rope_type='llama3'" in proc.stdout + proc.stderr
    proc = usp_cli("plan", *base[:-1], f"model.init_from={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2 and "no config.json" in proc.stdout + proc.stderr
