"""Hugging Face checkpoints out (`usp export --format hf`) and in (`model.init_from=<HF directory>`).

Out: a directory that transformers.AutoModelForCausalLM.from_pretrained loads (LlamaForCausalLM, or
MixtralForCausalLM for a MoE model): config.json (usp/plan/hf_config.py), safetensors shards with
model.safetensors.index.json, and the dataset's tokenizer files when it has an HF tokenizer. Names
are converted in usp/models/hf_convert.py (the tensors themselves are HF's: same RoPE layout).
usp/engine/export.py writes it into a temporary directory beside the target and swaps it into
place: a crash never leaves half an export.

In: every rank reads the full HF tensors (safetensors, memory-mapped: only the tensors asked for are
read) into the full model it has just built, before any parallelism is applied; tensor parallelism,
FSDP2 and pipeline cutting then keep only this rank's part, exactly as they do with usp's own
initialisation (build.py builds the same full model on every rank). Transformers is not imported."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from usp.data.tiktoken_file import TIKTOKEN_FILE, TIKTOKEN_META, hf_tokenizer_json, read_ranks
from usp.errors import UspError
from usp.models.hf_convert import from_hf, to_hf
from usp.plan.hf_config import hf_config

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Tokenizer files transformers' AutoTokenizer reads, copied from the dataset directory when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
DEFAULT_SHARD_MB = 5000  # transformers' own default max_shard_size ("5GB")


@dataclass
class HFExportResult:
    path: Path
    checkpoint: Path
    step: int
    shards: list[str]
    n_params: int
    architecture: str
    tied: bool
    tokenizer_files: list[str]

    def describe(self) -> str:
        lines = [f"exported step {self.step} ({self.n_params:,} parameters) from {self.checkpoint}",
                 f"  hf:      {self.path} ({self.architecture}, {len(self.shards)} safetensors shard(s) + {INDEX})"]
        if self.tied:
            lines.append("  tied:    lm_head.weight = model.embed_tokens.weight (tie_word_embeddings)")
        lines.append(f"  tokenizer: {', '.join(self.tokenizer_files)}" if self.tokenizer_files
                     else "  tokenizer: none (the dataset has no Hugging Face tokenizer)")
        lines.append(f"  load:    transformers.AutoModelForCausalLM.from_pretrained({str(self.path)!r})")
        return "\n".join(lines)


# ------------------------------------------------------------------------------- out

def write_hf(state: dict[str, torch.Tensor], model_cfg: dict, plan: dict, ckpt: Path, step: int, out: Path,
             max_shard_mb: float = DEFAULT_SHARD_MB) -> HFExportResult:
    """Write `state` (usp FQNs, full tensors, vocabulary padding removed) as the new HF directory `out`
    (usp export writes it under a temporary name and swaps it into place)."""
    tied = bool(model_cfg.get("tie_embeddings"))
    if tied:
        state.pop("output.weight", None)  # stored once, as the embedding (transformers re-ties it)
    hf_state = to_hf(state)
    dtype = str(next(iter(hf_state.values())).dtype).replace("torch.", "")
    config = hf_config(model_cfg, int(model_cfg["vocab_size"]), int(plan["batch"]["seq_len"]), dtype)
    out.mkdir(parents=True)
    shards = _write_shards(hf_state, out, max_shard_mb)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copied = _copy_tokenizer(Path(plan.get("dataset_dir", "")), out)
    n_params = sum(t.numel() for t in hf_state.values())
    return HFExportResult(out, ckpt, step, shards, n_params, config["architectures"][0], tied, copied)


def _write_shards(hf_state: dict[str, torch.Tensor], directory: Path, max_shard_mb: float) -> list[str]:
    """Greedy shards of at most max_shard_mb (a bigger single tensor gets a shard of its own), and
    the index transformers reads (weight_map: name -> shard file)."""
    from safetensors.torch import save_file

    limit = max_shard_mb * 2 ** 20
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in hf_state.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    n = len(groups)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)] if n > 1 else [SINGLE]
    weight_map = {}
    for file, group in zip(names, groups):
        save_file({k: hf_state[k].contiguous() for k in group}, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    total = sum(t.numel() * t.element_size() for t in hf_state.values())
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2) + "\n")
    return names


def _copy_tokenizer(dataset_dir: Path, directory: Path) -> list[str]:
    """The dataset's HF tokenizer files (usp's byte tokenizer is no HF tokenizer: skipped); a
    tiktoken file is written as the tokenizer.json transformers reads, the file copied beside it."""
    if (dataset_dir / TIKTOKEN_META).is_file():
        return _write_tiktoken(dataset_dir, directory)
    main = dataset_dir / "tokenizer.json"
    if not main.is_file() or json.loads(main.read_text()).get("kind") == "bytes":
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (dataset_dir / name).is_file():
            shutil.copyfile(dataset_dir / name, directory / name)
            copied.append(name)
    if "tokenizer_config.json" not in copied:  # tells AutoTokenizer which class reads tokenizer.json
        (directory / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
        copied.append("tokenizer_config.json")
    return copied


def _write_tiktoken(dataset_dir: Path, directory: Path) -> list[str]:
    meta = json.loads((dataset_dir / TIKTOKEN_META).read_text())
    source = dataset_dir / meta.get("file", TIKTOKEN_FILE)
    (directory / "tokenizer.json").write_text(hf_tokenizer_json(read_ranks(source)))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": meta["bos_token"],
              "eos_token": meta["eos_token"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(source, directory / TIKTOKEN_FILE)
    return ["tokenizer.json", "tokenizer_config.json", TIKTOKEN_FILE]


# -------------------------------------------------------------------------------- in

class HFLoadError(UspError):
    """The Hugging Face checkpoint can't be loaded into this model."""


def read_hf_tensors(path: str | Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of an HF checkpoint directory (single model.safetensors or an index of shards),
    only `names` when given; memory-mapped, so a tensor not asked for is never read."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE).is_file():
        files = [SINGLE]
    else:
        raise HFLoadError(f"no {SINGLE} or {INDEX} in {path}", key="model.init_from", value=str(path),
                          fix="save the model with save_pretrained(..., safe_serialization=True)")
    out = {}
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), not __iter__)
                if names is None or name in names:
                    out[name] = f.get_tensor(name)
    return out


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | Path) -> None:
    """Copy an HF Llama / Mixtral checkpoint into `model`, a full usp Llama (before parallelism).
    The architecture was checked at plan time (usp/plan/hf_config.py); the shapes are checked here.
    Rows beyond the checkpoint's vocabulary (tensor parallelism's padding) keep their init."""
    args = model.args
    usp_state = from_hf(read_hf_tensors(path))
    if args.tie_embeddings:
        usp_state.pop("output.weight", None)  # a tied checkpoint may still carry lm_head.weight
    params = dict(model.named_parameters())  # the tied head appears once, as tok_embeddings.weight
    missing = sorted(set(params) - set(usp_state))
    unexpected = sorted(set(usp_state) - set(params))
    if missing or unexpected:
        raise HFLoadError(f"{path} does not match the model: missing {missing[:4]}, unexpected {unexpected[:4]}",
                          key="model.init_from", value=str(path))
    for name, p in params.items():
        src = usp_state[name]
        rows = src.shape[0]
        if src.shape[1:] != p.shape[1:] or rows > p.shape[0] or (rows < p.shape[0] and not _vocab_row(name)):
            raise HFLoadError(f"{name}: the checkpoint's shape {tuple(src.shape)} does not fit the model's "
                              f"{tuple(p.shape)}", key="model.init_from", value=str(path))
        p[:rows].copy_(src.to(p.dtype))


def _vocab_row(name: str) -> bool:
    return name in ("tok_embeddings.weight", "output.weight")
