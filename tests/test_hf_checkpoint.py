"""Hugging Face checkpoints in (`model.init_from`) and out (`usp export --format hf`), against the real
`transformers`: tiny random Llama / Mixtral models made on the fly with save_pretrained (nothing
downloaded). Logits must equal transformers' within 1e-5, with and without Llama 3's RoPE scaling;
`model.init_from=<dir>` alone takes the model's shape from config.json; an import trained under
FSDP2 x TP2 (4 processes) follows a single process; a tied model keeps its tie both ways; a key set
on the command line, in a recipe or by a picked model group that disagrees with config.json is
refused before launch; the catalogue's Llama 3.1 / 3.2 groups are Meta's published config.json."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_usp, usp_cli
from data_builders import WORDS, trained_tiktoken_file, word_corpus

from usp.engine.observe.metrics import read_metrics
from usp.rundir import read_plan

DIMS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.1)
USP_DIMS = ["model.dim=64", "model.ffn_dim=96", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"]
QUIET = ["logging.console=plain", "train.sample_tokens=0", "train.log_interval=1", "train.eval_interval=0",
         "checkpoint.enabled=true", "train.steps=3", "train.global_batch=8", "train.seq_len=64"]
TOL = 1e-5
# Llama 3's RoPE scaling with a short original context: at head_dim 16 its wavelengths fall in all three
# bands (kept, interpolated, divided by the factor), so the scaling shows in the logits.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
USP_LLAMA3 = dict(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                  rope_original_max_positions=32)


def make_hf(directory: Path, kind: str, vocab: int, tied: bool, **dims) -> Path:
    """A random tiny LlamaForCausalLM (kind "llama", or "llama3": with Llama 3's RoPE scaling) or
    MixtralForCausalLM saved with save_pretrained; `dims` replace DIMS' values."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    dims = {**DIMS, **dims}
    if kind == "llama3":
        dims["rope_parameters"] = {**LLAMA3_ROPE, "rope_theta": dims.pop("rope_theta")}
    if kind in ("llama", "llama3"):
        model = LlamaForCausalLM(LlamaConfig(**dims, vocab_size=vocab, tie_word_embeddings=tied))
    else:
        model = MixtralForCausalLM(MixtralConfig(**dims, vocab_size=vocab, tie_word_embeddings=tied,
                                                 num_local_experts=4, num_experts_per_tok=2))
    model.save_pretrained(directory)
    return directory


def usp_model(kind: str, vocab: int, tied: bool):
    from usp.models.llama import Llama, LlamaArgs

    extra = dict(n_experts=4, top_k=2) if kind == "mixtral" else USP_LLAMA3 if kind == "llama3" else {}
    return Llama(LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=vocab,
                           tie_embeddings=tied, **extra), max_seq_len=64)


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("llama3", False), ("mixtral", False)])
def test_import_matches_transformers_logits(tmp_path, kind, tied):
    """An HF checkpoint loaded into usp's model gives transformers' logits (q/k as they are: the same
    RoPE layout; Llama 3's frequency scaling; experts stacked and transposed), and usp's own export of
    it loads back identically."""
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
           "top_k": 2, "moe_ffn_dim": 0, **(USP_LLAMA3 if kind == "llama3" else {})}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    write_hf(state, cfg, plan, tmp_path / "ckpt", 0, tmp_path / "back", max_shard_mb=0.1)
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    original, back = read_hf_tensors(src), read_hf_tensors(tmp_path / "back")
    assert set(back) == set(index["weight_map"]) == set(original) - ({"lm_head.weight"} if tied else set())
    assert all(torch.equal(original[k], back[k]) for k in back)
    assert torch.allclose(hf_logits(tmp_path / "back", tokens), expected, rtol=0, atol=TOL)
    if kind == "llama3":  # the scaling is in the export's config.json, and it matters
        assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"] == \
            {**LLAMA3_ROPE, "rope_theta": 10000.0}
        plain = usp_model("llama", 100, tied)
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
    for rope, says in [({"rope_type": "yarn", "factor": 4.0}, "rope_parameters.rope_type='yarn'"),
                       ({"rope_type": "llama3", "factor": 8.0}, "rope_parameters.low_freq_factor=None")]:
        (src / "config.json").write_text(json.dumps({**config, "rope_parameters": {**rope, "rope_theta": 10000.0}}))
        proc = usp_cli("plan", *base, cwd=tmp_path)
        assert proc.returncode == 2 and says in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    proc = usp_cli("plan", *base[:-1], f"model.init_from={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2 and "no config.json" in proc.stdout + proc.stderr


# A checkpoint whose every shape value differs from the default model group's (tiny: dim 128, 2 layers,
# MHA, ffn 384, tied, rope_theta 1e4, norm_eps 1e-5): what `model.init_from` alone must take from it.
OWN_SHAPE = dict(num_hidden_layers=3, rms_norm_eps=1e-6, rope_theta=500000.0)


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama3", True), ("mixtral", False)])
def test_init_from_alone_takes_the_shape_from_config_json(tmp_path, shakespeare, kind, tied):
    """`usp train model.init_from=<dir>` and no other model key: the run has the checkpoint's shape
    (dims, layers, heads, kv heads, ffn, vocab, tie, rope theta and scaling, norm eps, experts), its
    first loss is transformers' on the same batch, and usp's model built from the run's plan gives
    transformers' logits within 1e-5."""
    from transformers import AutoConfig

    from usp.engine.hf_checkpoint import load_hf_weights
    from usp.models.llama import Llama, LlamaArgs

    vocab = int(shakespeare[1]["vocab_size"])
    src = make_hf(tmp_path / f"hf_{kind}", kind, vocab, tied, **OWN_SHAPE)
    run = _train(tmp_path, "run", f"model.init_from={src}")
    model = read_plan(run / "plan.yaml")["config"]["model"]
    hf = AutoConfig.from_pretrained(src)
    rope = hf.rope_parameters
    assert (model["name"], model["dim"], model["n_layers"], model["n_heads"], model["n_kv_heads"], model["ffn_dim"],
            model["vocab_size"], model["tie_embeddings"], model["rope_theta"], model["norm_eps"], model["rope_type"]) \
        == (f"hf_{kind}", hf.hidden_size, 3, hf.num_attention_heads, hf.num_key_value_heads, hf.intermediate_size,
            vocab, tied, 500000.0, 1e-6, rope["rope_type"])
    assert (model["n_experts"], model["top_k"]) == ((4, 2) if kind == "mixtral" else (0, 2))
    if kind == "llama3":
        assert [model[f"rope_{k}"] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                            "original_max_positions")] == [8.0, 1.0, 4.0, 32]
    first = _first_batch_loss(run, src)
    assert abs(_losses(run)[0] - first) <= TOL * first, (_losses(run), first)
    ours = Llama(LlamaArgs.from_config(_Attrs(model), vocab), max_seq_len=64)
    load_hf_weights(ours, src)
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = ours(tokens)
    expected = hf_logits(src, tokens)
    assert logits.abs().max() > 0.1 and torch.allclose(logits, expected, rtol=0, atol=TOL), \
        (logits - expected).abs().max()


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
    model = read_plan(tmp_path / "runs" / "ok" / "plan.yaml")["config"]["model"]
    assert (model["dim"], model["n_layers"], model["tie_embeddings"], model["vocab_size"]) == (64, 3, False, 512)


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
    from usp.config.init_from import CHECKPOINT_KEYS
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


def _train(tmp_path: Path, name: str, *overrides: str) -> Path:
    proc = run_usp("train", f"train.runs_dir={tmp_path}", f"train.name={name}", *QUIET, *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / name


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]


def _first_batch_loss(run_dir: Path, hf_dir: Path) -> float:
    """transformers' loss on the run's first global batch (the data sampler is layout-independent)."""
    from transformers import AutoModelForCausalLM

    from usp.data.sampler import BatchSampler, TokenFile, get_batch

    plan = read_plan(run_dir / "plan.yaml")
    seq, batch = int(plan["batch"]["seq_len"]), int(plan["batch"]["global_batch"])
    tokens = TokenFile(Path(plan["dataset_dir"]) / plan["data_meta"]["train_bin"])
    starts = BatchSampler(len(tokens), seq, batch, batch, 0, 1, int(plan["config"]["train"]["seed"])).micro_batches(0)
    x, y = (torch.from_numpy(a) for a in get_batch(tokens, np.concatenate(starts), seq))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(hf_dir)(x).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))


def _usp_logits(run_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The trained model's logits, from its last usp checkpoint, in one process."""
    from usp.engine.export import load_model_state
    from usp.models.llama import Llama, LlamaArgs
    from usp.rundir import list_checkpoints

    plan = read_plan(run_dir / "plan.yaml")
    ckpt = [c for c in list_checkpoints(run_dir / "checkpoints") if c.complete][-1].path
    model = Llama(LlamaArgs.from_config(_Attrs(plan["config"]["model"]), int(plan["model"]["vocab_size"])),
                  max_seq_len=64)
    model.load_state_dict(load_model_state(ckpt), strict=False)  # a tied head is stored once
    with torch.no_grad():
        return model(tokens)


class _Attrs(dict):
    __getattr__ = dict.__getitem__


def _check_export(tmp_path: Path, run_dir: Path, tied: bool, kind: str) -> None:
    """usp export --format hf of the run: transformers loads it (and its tokenizer), with usp's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from usp.data.tokenizer import load_tokenizer
    from usp.engine.hf_checkpoint import read_hf_tensors

    proc = usp_cli("export", str(run_dir), "--format", "hf", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = run_dir / "export" / "hf_step00000003"
    assert str(out) in proc.stdout
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == ("MixtralForCausalLM" if kind == "mixtral" else "LlamaForCausalLM")
    assert hf.config.tie_word_embeddings == tied
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == tied
    assert ("lm_head.weight" in read_hf_tensors(out)) != tied  # a tied head is stored once
    tokens = torch.randint(0, hf.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = _usp_logits(run_dir, tokens)
    assert torch.allclose(ours, theirs, rtol=0, atol=TOL), (ours - theirs).abs().max()
    plan = read_plan(run_dir / "plan.yaml")
    text = "To be, or not to be: that is the question."
    assert AutoTokenizer.from_pretrained(out).encode(text) == load_tokenizer(plan["dataset_dir"]).encode(text)


@pytest.mark.distributed
def test_llama_import_trains_under_fsdp2_tp2_and_exports(tmp_path, shakespeare):
    """A tied HF Llama as model.init_from under FSDP2 x TP2 (4 processes, each loading its shards from
    the full tensors): its first loss is transformers' loss on the same batch, the 3 steps follow one
    process within 1e-5, and the export loads in transformers with usp's logits and its tie intact."""
    vocab = int(shakespeare[1]["vocab_size"])
    src = make_hf(tmp_path / "hf_llama", "llama", vocab, tied=True)
    common = [*USP_DIMS, "model.tie_embeddings=true", f"model.init_from={src}"]
    sharded = _train(tmp_path, "fsdp2_tp2", *common, "cluster.procs_per_node=4", "parallelism.dp_shard=2",
                     "parallelism.tp=2", "parallelism.dp_replicate=1")
    single = _train(tmp_path, "single", *common)
    first = _first_batch_loss(single, src)
    for run in (sharded, single):
        losses = _losses(run)
        assert len(losses) == 3 and abs(losses[0] - first) <= TOL * first, (run.name, losses, first)
    assert np.allclose(_losses(sharded), _losses(single), rtol=TOL, atol=0), (_losses(sharded), _losses(single))
    _check_export(tmp_path, sharded, tied=True, kind="llama")


def test_mixtral_import_trains_and_exports(tmp_path, shakespeare):
    """An untied HF Mixtral as model.init_from (one process): first loss = transformers' loss, and the
    trained model exports to a MixtralForCausalLM with usp's logits."""
    vocab = int(shakespeare[1]["vocab_size"])
    src = make_hf(tmp_path / "hf_mixtral", "mixtral", vocab, tied=False)
    run = _train(tmp_path, "moe", "model=moe_tiny", *USP_DIMS, "model.tie_embeddings=false", f"model.init_from={src}")
    first = _first_batch_loss(run, src)
    assert abs(_losses(run)[0] - first) <= TOL * first, (_losses(run), first)
    _check_export(tmp_path, run, tied=False, kind="mixtral")


MIXED_TEXT = ["naïve café — 東京 🚀 don't I'll 12345 67", "  two  spaces\n\nand\ttabs  ", "<|end_of_text  |> a<b>"]


def test_a_tiktoken_run_exports_the_tokenizer_transformers_loads(tmp_path):
    """A run tokenized with a tiktoken file (Llama 3's format) exports a tokenizer.json: transformers'
    AutoTokenizer gives the run's token ids for prose, unicode, digits and whitespace, and the
    special tokens keep their ids."""
    from transformers import AutoTokenizer

    from usp.data.tokenizer import load_tokenizer

    texts = [word_corpus(30_000, WORDS, seed=i) + "\n" + "\n".join(MIXED_TEXT) for i in range(2)]
    for i, text in enumerate(texts):
        (tmp_path / f"corpus{i}.txt").write_text(text)
    model_file = trained_tiktoken_file(tmp_path / "tokenizer.model", texts)
    run = _train(tmp_path, "tiktoken", "data=text_files", f"data.paths=[{tmp_path}/corpus*.txt]",
                 "data.tokenizer=tiktoken", f"data.tokenizer_path={model_file}", "data.val_fraction=0.3", *USP_DIMS)
    _check_export(tmp_path, run, tied=True, kind="llama")
    out = run / "export" / "hf_step00000003"
    ours = load_tokenizer(read_plan(run / "plan.yaml")["dataset_dir"])
    theirs = AutoTokenizer.from_pretrained(out)
    for text in [*MIXED_TEXT, texts[0][:2000]]:
        ids = ours.encode(text)
        assert theirs.encode(text, add_special_tokens=False) == ids, text
        assert theirs.decode(ids) == text
    assert theirs.convert_tokens_to_ids([ours.bos, ours.eos]) == [ours.bos_id, ours.eos_id]
    # As Llama 3's own tokenizer.json: special-token text in a prompt is that token (usp's data pipeline
    # encodes it as plain text, so no document can fake an end of document).
    assert theirs.encode(f"{ours.eos} x", add_special_tokens=False) == [ours.eos_id, *ours.encode(" x")]
    assert len(theirs) == ours.vocab_size
    assert (out / "tokenizer.model").read_bytes() == model_file.read_bytes()
