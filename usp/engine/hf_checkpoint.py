"""Hugging Face checkpoints out (`usp export --format hf`) and in (`model.init_from=<HF directory>`).

Out: a directory that transformers.AutoModelForCausalLM.from_pretrained loads (LlamaForCausalLM, or
MixtralForCausalLM for a MoE model; Qwen3ForCausalLM / Qwen3MoeForCausalLM with model.qk_norm):
config.json (usp/contract/hf_shape.py), safetensors shards with
model.safetensors.index.json, and the dataset's tokenizer files when it has an HF tokenizer. Names
are converted in usp/models/hf_convert.py (the tensors themselves are HF's: same RoPE layout). The
tensors come as a stream (usp/engine/tensor_stream.py): one usp tensor converted at a time, one
shard in memory at a time. usp/engine/export.py writes it into a temporary directory beside the
target and swaps it into place: a crash never leaves half an export.

In: the model (or pipeline stage) is built on the meta device, parallelized and allocated (this rank's
shards only, usp/engine/parallel/materialize.py); then `load_hf_weights` goes through its parameters
one at a time and reads, of each one's HF tensor(s), only the part this rank holds (safetensors
slices of the memory-mapped files), straight into the rank's shard. Transformers is not imported."""
from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from usp.contract.config_schema import ModelConfig
from usp.contract.hf_shape import CONFIG, hf_config, model_type
from usp.data.tiktoken_file import TIKTOKEN_FILE, TIKTOKEN_META, hf_tokenizer_json, read_ranks
from usp.engine.parallel.local_part import local_index, local_tensor
from usp.engine.tensor_stream import TensorStream, meta_like, write_shards
from usp.errors import UspError
from usp.models.hf_convert import hf_names, hf_tensors, read_part, usp_shape

PATTERN = "model{suffix}.safetensors"  # huggingface_hub's and transformers' file names
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Tokenizer files transformers' AutoTokenizer reads, copied from the dataset directory when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
DEFAULT_SHARD_MB = 5000  # huggingface_hub's default max_shard_size ("5GB"; transformers 5 saves 50 GB shards)


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

def write_hf(tensors: TensorStream | dict[str, torch.Tensor], model: ModelConfig, vocab: int, max_seq_len: int,
             dataset_dir: str, ckpt: Path, step: int, out: Path,
             max_shard_mb: float = DEFAULT_SHARD_MB) -> HFExportResult:
    """Write `tensors` (usp FQNs, whole tensors, vocabulary padding removed: a stream read one tensor
    at a time, or a dict) as the new HF directory `out` (usp export writes it under a temporary name
    and swaps it into place): safetensors files of at most max_shard_mb MiB, always with the index."""
    from safetensors.torch import save_file

    stream = tensors if isinstance(tensors, TensorStream) else TensorStream.of(tensors)
    tied = bool(model.tie_embeddings)
    if tied:  # stored once, as the embedding (transformers re-ties it)
        stream = TensorStream({k: v for k, v in stream.shapes.items() if k != "output.weight"}, stream.read)
    kind = model_type(model)
    hf = hf_stream(stream, kind)
    dtype = str(next(iter(hf.shapes.values())).dtype).replace("torch.", "")
    config = hf_config(model, int(vocab), int(max_seq_len), dtype)
    out.mkdir(parents=True)
    shards = write_shards(hf, out, PATTERN, max_shard_mb, always_index=True,
                          save=lambda shard, path: save_file(shard, str(path), metadata={"format": "pt"}))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copied = _copy_tokenizer(Path(dataset_dir), out)
    return HFExportResult(out, ckpt, step, shards, hf.numel(), config["architectures"][0], tied, copied)


def hf_stream(stream: TensorStream, kind: str) -> TensorStream:
    """`stream` (usp names) as Hugging Face's tensors (usp/models/hf_convert.py `hf_tensors`: renamed;
    stacked experts split per expert and transposed). A usp tensor is read when one of its HF tensors
    is asked for, and its conversion kept until another's is: all of a layer's experts come from one
    read (again for a file that starts in the middle of them). `kind`: the HF model type."""
    shapes: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for name, meta in stream.shapes.items():
        for hf_name, t in hf_tensors(name, meta, kind).items():
            shapes[hf_name], source[hf_name] = meta_like(t), name
    last: dict[str, dict[str, torch.Tensor]] = {}

    def read(hf_name: str) -> torch.Tensor:
        name = source[hf_name]
        if name not in last:
            last.clear()  # the previous conversion goes before the next tensor is read
            last[name] = hf_tensors(name, stream.read(name), kind)
        return last[name][hf_name]

    return TensorStream(shapes, read)


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


def _weight_map(path: Path) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it (an index of shards, or one file)."""
    from safetensors import safe_open

    if (path / INDEX).is_file():
        return dict(json.loads((path / INDEX).read_text())["weight_map"])
    if (path / SINGLE).is_file():
        with safe_open(str(path / SINGLE), framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE)
    raise HFLoadError(f"no {SINGLE} or {INDEX} in {path}", key="model.init_from", value=str(path),
                      fix="save the model with save_pretrained(..., safe_serialization=True)")


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | Path, seed: int = 0) -> None:
    """Copy an HF Llama / Mixtral / Qwen3 / Qwen3-MoE checkpoint into `model`, a usp Llama or pipeline stage (plain, or
    already parallelized and allocated: this rank's shards, usp/engine/parallel/materialize.py), one
    parameter at a time, reading only the part of it this rank holds (`local_index`: a DTensor's
    chunk, expert parallelism's experts, or the whole tensor) with safetensors' `get_slice`.

    Why safetensors' slices and not DCP's `HuggingFaceStorageReader` + `dcp.load`: that reader does
    the same (torch 2.13: `safe_open(...).get_slice(name)[chunk]` per read item), but it loads a
    state dict that is HF's tensors one for one, which usp's model is not: Mixtral's experts are
    stacked and transposed in usp (hf_convert.read_part reads each expert's part), tensor
    parallelism pads the vocabulary with rows the checkpoint lacks (they keep the model's own
    initialisation, `seed`), and dcp.load is a collective over every rank, where each rank's read
    here is its own. Each parameter opens the files it needs and closes them before the next: pages
    of a memory-mapped file count in the process's resident memory while it stays mapped.

    The architecture was checked at plan time (usp/plan/hf_config.py); names and shapes are checked
    here, before any value is read."""
    args, path = model.args, Path(path).expanduser()
    files = _HFFiles(path)
    _check_names(type(model), args, set(files.shapes), path, files.kind)
    for name, p, shape, rows in model.full_parameters():
        if _mtp_absent(name, args, set(files.shapes), files.kind):  # keeps the model's own initialisation
            continue
        stored = usp_shape(name, [files.shapes[n] for n in hf_names(name, args.n_experts, files.kind)])
        _check_shape(name, stored, shape, path)
        dest, index = local_tensor(p), local_index(p, rows)
        if _vocab_row(name) and index[0].stop > stored[0]:  # rows beyond the checkpoint: TP's vocabulary padding
            dest, index = _init_padding(model, name, shape, seed, dest, index, stored[0])
        if dest.numel():
            files.read_into(dest, name, index, args.n_experts)
    for name, buf in _hf_buffers(model, files.kind):  # DeepSeek-V3's router biases: whole on every rank
        if not _mtp_absent(name, args, set(files.shapes), files.kind):
            files.read_into(buf, name, (slice(None),), args.n_experts)


def _hf_buffers(model: nn.Module, kind: str) -> list[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint of `kind` holds values of (canonical name, buffer): DeepSeek-V3's
    e_score_correction_bias is usp's aux-loss-free expert_bias."""
    if kind != "deepseek_v3":
        return []
    return [(model.canonical_name(n), b) for n, b in model.named_buffers() if n.endswith("expert_bias")]


class _HFFiles:
    """An HF checkpoint directory: which file holds each tensor, every tensor's shape (from the files'
    headers: no tensor read), its model type (config.json's: it names the MoE tensors), and a part of one
    usp parameter read into a destination."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path, self.weight_map = path, _weight_map(path)
        self.kind = str(json.loads((path / CONFIG).read_text()).get("model_type"))
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.weight_map.values())):
            with safe_open(str(path / file), framework="pt") as f:
                self.shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})

    def read_into(self, dest: torch.Tensor, name: str, index: tuple[slice, ...], n_experts: int) -> None:
        """dest <- part `index` of usp parameter `name` (the dtype converted by the copy); only those
        bytes of the files are read (a column slice: each row's columns)."""
        from safetensors import safe_open

        with contextlib.ExitStack() as stack:
            opened: dict[str, object] = {}

            def read(hf_name: str, hf_index: tuple[slice, ...]) -> torch.Tensor:
                file = self.weight_map[hf_name]
                if file not in opened:
                    opened[file] = stack.enter_context(safe_open(str(self.path / file), framework="pt"))
                return opened[file].get_slice(hf_name)[hf_index]  # type: ignore[attr-defined]

            dest.copy_(read_part(name, index, n_experts, self.kind, read))


def _init_padding(model: nn.Module, name: str, shape: tuple[int, ...], seed: int, dest: torch.Tensor,
                  index: tuple[slice, ...], stored_rows: int) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """Fill the rows of `dest` (at `index` of the whole tensor) past the checkpoint's `stored_rows`
    with the model's initialisation; returns what is left to read from the checkpoint."""
    first = index[0].start
    keep = max(stored_rows - first, 0)  # rows of dest the checkpoint has
    dest[keep:].copy_(model.initial_value(name, shape, seed)[index][keep:])
    return dest[:keep], (slice(first, first + keep), *index[1:])


def _mtp_skipped(name: str, args) -> bool:
    """A DeepSeek-V3 checkpoint's multi-token-prediction tensor usp doesn't read: all of them without
    model.mtp_depth (transformers skips them too), else the copies of the embedding and the head it keeps."""
    mtp = f"model.layers.{args.n_layers}."
    if not name.startswith(mtp):
        return False
    return not args.mtp_depth or name[len(mtp):] in ("embed_tokens.weight", "shared_head.head.weight")


def _mtp_absent(name: str, args, available: set[str], kind: str) -> bool:
    """A parameter of usp's multi-token-prediction block (layers.{n_layers}) that the checkpoint lacks
    (transformers writes none): it keeps its initialisation."""
    return bool(args.mtp_depth) and name.startswith(f"layers.{args.n_layers}.") and \
        not set(hf_names(name, args.n_experts, kind)) <= available


def _check_names(model_cls: type, args, available: set[str], path: Path, kind: str) -> None:
    """The checkpoint holds every tensor of the whole model (whatever part this rank holds) and
    nothing else (a tied model's lm_head.weight and old RoPE frequency buffers are ignored)."""
    with torch.device("meta"):  # names only: nothing allocated
        whole = model_cls(args, max_seq_len=2)
    needed = {name: hf_names(name, args.n_experts, kind) for name, *_ in whole.full_parameters()}
    needed.update({name: hf_names(name, args.n_experts, kind) for name, _ in _hf_buffers(whole, kind)})
    missing = sorted(name for name, hf in needed.items()
                     if not set(hf) <= available and not _mtp_absent(name, args, available, kind))
    known = set().union(*needed.values()) | ({"lm_head.weight"} if args.tie_embeddings else set())
    unexpected = sorted(n for n in available - known
                        if not n.endswith("rotary_emb.inv_freq") and not _mtp_skipped(n, args))
    if missing or unexpected:
        raise HFLoadError(f"{path} does not match the model: missing {missing[:4]}, unexpected {unexpected[:4]}",
                          key="model.init_from", value=str(path))


def _check_shape(name: str, stored: tuple[int, ...] | None, shape: tuple[int, ...], path: Path) -> None:
    """The checkpoint's tensor fits the whole parameter: the same shape, or fewer vocabulary rows
    (the model's are padded)."""
    fits = stored is not None and tuple(stored[1:]) == tuple(shape[1:]) and (
        stored[0] == shape[0] or (stored[0] < shape[0] and _vocab_row(name)))
    if not fits:
        raise HFLoadError(f"{name}: the checkpoint's shape {stored} does not fit the model's {tuple(shape)}",
                          key="model.init_from", value=str(path))


def _vocab_row(name: str) -> bool:
    return name in ("tok_embeddings.weight", "output.weight")
