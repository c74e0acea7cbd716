"""Hugging Face checkpoints through real runs, against the real `transformers`: `model.init_from=<dir>`
alone takes the model's shape from config.json (a Llama, one with Llama 3's RoPE scaling, a Mixtral, a
Qwen3, a Qwen3-MoE, a DeepSeek-V3 in several files); an HF Llama, Qwen3, Qwen3-MoE and DeepSeek-V3 imported
and trained under FSDP2 x TP2 (x EP2 for the MoE; 4 processes) follow a single process and export
(`usp export --format hf`) keeping the tie and the architecture; an HF Mixtral likewise on one process; a
tiktoken run exports the tokenizer transformers loads (loading and the config checks in this process:
tests/engine/test_hf_checkpoint.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.data_builders import WORDS, trained_tiktoken_file, word_corpus
from tests.engine.test_hf_checkpoint import OWN_SHAPE, TOL, USP_DEEPSEEK, USP_DIMS, hf_logits, make_hf
from tests.helpers import hf_tensors, losses, run_usp, usp_cli
from usp.contract.hf_shape import ARCHITECTURES
from usp.contract.plan_file import read_plan

QUIET = ["logging.console=plain", "train.sample_tokens=0", "train.log_interval=1", "train.eval_interval=0",
         "checkpoint.enabled=true", "train.steps=3", "train.global_batch=8", "train.seq_len=64"]


def _train(tmp_path: Path, name: str, *overrides: str) -> Path:
    proc = run_usp("train", f"train.runs_dir={tmp_path}", f"train.name={name}", *QUIET, *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # under FSDP2 x TP2 every rank once printed DTensor's notice about the grad norm's two all-reduces
    assert "sequential all_reduce" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    return tmp_path / name


def _first_batch_loss(run_dir: Path, hf_dir: Path) -> float:
    """transformers' loss on the run's first global batch (the data sampler is layout-independent)."""
    from transformers import AutoModelForCausalLM

    from usp.data.sampler import BatchSampler, TokenFile, get_batch

    plan = read_plan(run_dir / "plan.yaml")
    seq, batch = int(plan.batch.seq_len), int(plan.batch.global_batch)
    tokens = TokenFile(Path(plan.dataset_dir) / plan.data_meta["train_bin"])
    starts = BatchSampler(len(tokens), seq, batch, batch, 0, 1, int(plan.config.train.seed)).micro_batches(0)
    x, y = (torch.from_numpy(a) for a in get_batch(tokens, np.concatenate(starts), seq))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(hf_dir)(x).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))


def _usp_logits(run_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The trained model's logits, from its last usp checkpoint, in one process."""
    from usp.engine.export import load_model_state
    from usp.models.llama import Llama, LlamaArgs
    from usp.run.files import list_checkpoints

    plan = read_plan(run_dir / "plan.yaml")
    ckpt = [c for c in list_checkpoints(run_dir / "checkpoints") if c.complete][-1].path
    model = Llama(LlamaArgs.from_config(plan.config.model, int(plan.model.vocab_size)),
                  max_seq_len=64)
    model.load_state_dict(load_model_state(ckpt), strict=False)  # a tied head is stored once
    with torch.no_grad():
        return model(tokens)


def _check_export(tmp_path: Path, run_dir: Path, tied: bool, kind: str) -> None:
    """usp export --format hf of the run: transformers loads it (and its tokenizer), with usp's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from usp.data.tokenizer import load_tokenizer

    proc = usp_cli("export", str(run_dir), "--format", "hf", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = run_dir / "export" / "hf_step00000003"
    assert str(out) in proc.stdout
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == ARCHITECTURES["llama" if kind == "llama3" else kind]
    assert hf.config.tie_word_embeddings == tied
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == tied
    assert ("lm_head.weight" in hf_tensors(out)) != tied  # a tied head is stored once
    tokens = torch.randint(0, hf.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = _usp_logits(run_dir, tokens)
    assert torch.allclose(ours, theirs, rtol=0, atol=TOL), (ours - theirs).abs().max()
    plan = read_plan(run_dir / "plan.yaml")
    text = "To be, or not to be: that is the question."
    assert AutoTokenizer.from_pretrained(out).encode(text) == load_tokenizer(plan.dataset_dir).encode(text)


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama3", True), ("mixtral", False), ("qwen3", True),
                                       ("qwen3_moe", False), ("deepseek_v3", False), ("qwen3_yarn", True)])
def test_init_from_alone_takes_the_shape_from_config_json(tmp_path, shakespeare, kind, tied):
    """`usp train model.init_from=<dir>` and no other model key: the run has the checkpoint's shape
    (dims, layers, heads, kv heads, ffn, vocab, tie, rope theta and scaling: llama3's, YaRN's, norm eps, experts), its
    first loss is transformers' on the same batch, and usp's model built from the run's plan gives
    transformers' logits within 1e-5."""
    from transformers import AutoConfig

    from usp.engine.hf_checkpoint import load_hf_weights
    from usp.models.llama import Llama, LlamaArgs

    vocab = int(shakespeare[1]["vocab_size"])
    src = make_hf(tmp_path / f"hf_{kind}", kind, vocab, tied, **OWN_SHAPE)
    run = _train(tmp_path, "run", f"model.init_from={src}")
    model = read_plan(run / "plan.yaml").config.model
    hf = AutoConfig.from_pretrained(src)
    rope = hf.rope_parameters
    assert (model.name, model.dim, model.n_layers, model.n_heads, model.n_kv_heads, model.ffn_dim,
            model.vocab_size, model.tie_embeddings, model.rope_theta, model.norm_eps, model.rope_type) \
        == (f"hf_{kind}", hf.hidden_size, 3, hf.num_attention_heads, hf.num_key_value_heads, hf.intermediate_size,
            vocab, tied, 500000.0, 1e-6, rope["rope_type"])
    experts = {"mixtral": (4, 2), "qwen3_moe": (4, 2), "deepseek_v3": (8, 2)}
    assert (model.n_experts, model.top_k) == experts.get(kind, (0, 2))
    qwen = kind.startswith("qwen3")
    if kind == "deepseek_v3":  # every DeepSeek-V3 option from config.json
        assert {k: getattr(model, k) for k in USP_DEEPSEEK} == USP_DEEPSEEK
    else:
        assert (model.head_dim, model.qk_norm) == (hf.head_dim, qwen) and (hf.head_dim == 24) == qwen  # not 64/4
        assert (model.moe_ffn_dim, model.router_norm_topk) == ((48 if kind == "qwen3_moe" else 0), True)
    if kind == "llama3":
        assert [getattr(model, f"rope_{k}") for k in ("factor", "low_freq_factor", "high_freq_factor",
                                            "original_max_positions")] == [8.0, 1.0, 4.0, 32]
    if kind == "qwen3_yarn":  # Qwen3's YaRN: the factor and the original context, the rest transformers' defaults
        assert (model.rope_factor, model.rope_original_max_positions, model.rope_beta_fast, model.rope_mscale) == \
            (4.0, 16, None, None)
    first = _first_batch_loss(run, src)
    assert abs(losses(run)[1] - first) <= TOL * first, (losses(run), first)
    ours = Llama(LlamaArgs.from_config(model, vocab), max_seq_len=64)
    load_hf_weights(ours, src)
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = ours(tokens)
    expected = hf_logits(src, tokens)
    assert logits.abs().max() > 0.1 and torch.allclose(logits, expected, rtol=0, atol=TOL), \
        (logits - expected).abs().max()


@pytest.mark.distributed
@pytest.mark.parametrize("kind,tied", [("llama", True), ("qwen3", True), ("qwen3_moe", False), ("deepseek_v3", False)])
def test_import_trains_under_fsdp2_tp2_and_exports(tmp_path, shakespeare, kind, tied):
    """An HF Llama, Qwen3 (QK-norm: its weights replicated over tp, their gradients summed), Qwen3-MoE or
    DeepSeek-V3 (latent attention's heads over tp, its shared RoPE key's gradient summed; sigmoid group
    routing with its correction bias; experts over ep 2 as well) as model.init_from under FSDP2 x TP2 (4
    processes, each loading its shards from the full tensors): its first loss is transformers' loss on the
    same batch, the 3 steps follow one process within 1e-5, and the export loads in transformers as the same
    architecture with usp's logits and its tie intact. (The logits of a DeepSeek-V3 checkpoint under
    FSDP2 x TP2 x EP2, gathered, against transformers': tests/e2e/test_build.py.) The Llama's run sets its
    shape as well; the others name nothing but the checkpoint (its balancing loss the default's)."""
    vocab = int(shakespeare[1]["vocab_size"])
    src = make_hf(tmp_path / f"hf_{kind}", kind, vocab, tied=tied)
    common = [*(USP_DIMS if kind == "llama" else []), f"model.tie_embeddings={str(tied).lower()}",
              f"model.init_from={src}"]
    ep = ["parallelism.ep=2"] if kind in ("qwen3_moe", "deepseek_v3") else []
    sharded = _train(tmp_path, "fsdp2_tp2", *common, "cluster.procs_per_node=4", "parallelism.dp_shard=2",
                     "parallelism.tp=2", "parallelism.dp_replicate=1", *ep)
    single = _train(tmp_path, "single", *common)
    first = _first_batch_loss(single, src)
    for run in (sharded, single):
        by_step = losses(run)
        assert sorted(by_step) == [1, 2, 3] and abs(by_step[1] - first) <= TOL * first, (run.name, by_step, first)
    assert np.allclose(list(losses(sharded).values()), list(losses(single).values()), rtol=TOL, atol=0), \
        (losses(sharded), losses(single))
    _check_export(tmp_path, sharded, tied=tied, kind=kind)


def test_mixtral_import_trains_and_exports(tmp_path, shakespeare):
    """An untied HF Mixtral as model.init_from (one process): first loss = transformers' loss, and the
    trained model exports to a MixtralForCausalLM with usp's logits."""
    vocab = int(shakespeare[1]["vocab_size"])
    src = make_hf(tmp_path / "hf_mixtral", "mixtral", vocab, tied=False)
    run = _train(tmp_path, "moe", "model=moe_tiny", *USP_DIMS, "model.tie_embeddings=false", f"model.init_from={src}")
    first = _first_batch_loss(run, src)
    assert abs(losses(run)[1] - first) <= TOL * first, (losses(run), first)
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
    ours = load_tokenizer(read_plan(run / "plan.yaml").dataset_dir)
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
