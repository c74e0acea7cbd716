"""`usp export`: one checkpoint -> one directory with the whole model, usable without usp.

Streams the model part of a torch.distributed.checkpoint (DCP) save in a single process
(usp/engine/checkpoint_tensors.py: the checkpoint's metadata names every tensor, `dcp.load` reads
one whole tensor at a time, whatever layout saved it) into files of at most --shard-mb MiB
(usp/engine/tensor_stream.py, huggingface_hub's shard split): torch.save or safetensors files of
{FQN: tensor} plus config.json with the architecture, or (--format hf) a Hugging Face directory
(usp/engine/hf_checkpoint.py). Memory: one output file's tensors plus the tensor being read,
never the model. A model that fits one file is written as one (model.pt / model.safetensors);
a bigger one as model-00001-of-0000N.* with an index (model.pt.index.json,
model.safetensors.index.json: transformers' layout, loaded by huggingface_hub.load_torch_model).
Tied weights are stored once (torch: the head shares the embedding's storage in its file;
safetensors: the duplicate key is dropped) and listed under "tied_weights" in config.json. A
checkpoint written before usp's RoPE layout change has its q/k rows converted tensor by tensor
(usp/engine/rope_upgrade.py): every export is in today's layout.

Every format writes one directory the export owns (the weights + config.json, or the HF files): a
torch file has no room for the architecture without changing what torch.load returns, and a
config.json must never land in a folder holding someone else's (an HF model's). The directory is
built under a temporary name and swapped into place (usp.run.files.staged); an --out that exists
is refused unless force (usp.run.writable.check_new_output)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from usp.contract.hf_shape import model_type
from usp.contract.plan_file import read_plan
from usp.contract.run_plan import RunPlan
from usp.engine.checkpoint_tensors import checkpoint_tensors
from usp.engine.hf_checkpoint import DEFAULT_SHARD_MB, HFExportResult, write_hf
from usp.engine.rope_upgrade import checkpoint_rope_layout, upgrade_rope_rows
from usp.engine.tensor_stream import TensorStream, meta_like, write_shards
from usp.errors import UspError
from usp.models.llama import LlamaArgs
from usp.models.rope_layout import ROPE_LAYOUT
from usp.run import checksums
from usp.run.files import (
    CHECKPOINTS,
    MANIFEST,
    check_manifest,
    list_checkpoints,
    plan_path,
    run_checkpoint_dir,
    staged,
)
from usp.run.writable import check_new_output

FORMATS = ("torch", "safetensors", "hf")
WEIGHTS = {"torch": "model.pt", "safetensors": "model.safetensors"}  # the file in the export directory
PATTERNS = {"torch": "model{suffix}.pt", "safetensors": "model{suffix}.safetensors"}  # when it takes several
CONFIG = "config.json"
EMB, HEAD = "tok_embeddings.weight", "output.weight"


class ExportError(UspError):
    """The checkpoint can't be exported as asked."""


@dataclass
class ExportResult:
    path: Path  # the weights file, or the index of several
    config_path: Path
    checkpoint: Path
    step: int
    n_tensors: int
    n_params: int
    tied: dict
    non_finite: list  # keys of tensors holding NaN / inf
    files: list = field(default_factory=list)  # the weights files, beside `path`
    nbytes: int = 0  # the weights' size

    def describe(self) -> str:
        size = f"{self.nbytes / 2 ** 20:.1f} MiB"
        weights = f"{self.path} ({size})" if len(self.files) <= 1 else \
            f"{len(self.files)} files of at most --shard-mb ({size}), index {self.path}"
        lines = [f"exported step {self.step} ({self.n_params:,} parameters, {self.n_tensors} tensors) "
                 f"from {self.checkpoint}",
                 f"  weights: {weights}",
                 f"  config:  {self.config_path}"]
        lines += [f"  tied:    {k} = {v} (stored once)" for k, v in self.tied.items()]
        if self.non_finite:
            lines.append(f"  warning: {len(self.non_finite)} tensor(s) hold NaN or inf values, "
                         f"e.g. {self.non_finite[0]}")
        lines.append(f"  load:    {self._load_hint()}")
        return "\n".join(lines)

    def _load_hint(self) -> str:
        safetensors = ".safetensors" in self.path.name
        if len(self.files) > 1:
            pattern = "" if safetensors else ', filename_pattern="model{suffix}.pt", safe=False'
            return f"huggingface_hub.load_torch_model(model, {str(self.path.parent)!r}{pattern})"
        if safetensors:
            return "safetensors.torch.load_model(model, path)  (restores tied weights)"
        return "model.load_state_dict(torch.load(path, weights_only=True))"


def load_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors from a DCP checkpoint directory, keyed by FQN (single process; all of
    them in memory: for tests and small models; the export streams them)."""
    stream = checkpoint_tensors(ckpt)
    return {name: stream.read(name) for name in stream.shapes}


def export_model(source, step: int | None = None, out=None, fmt: str = "torch",
                 max_shard_mb: float | None = None, force: bool = False) -> ExportResult | HFExportResult:
    """Export the newest complete checkpoint of run directory `source` (or `step`, or `source`
    itself when it is a step_<N> directory) to the directory `out` (default <run dir>/export/
    <fmt>_step<N>), in files of at most max_shard_mb MiB (default 5000). An existing `out` is
    replaced only with force; the default one, usp's own, always is."""
    _check_format(fmt)
    if out:  # before the checkpoint is even looked for
        out = check_new_output(_out_dir(out, fmt), force=force, key="--out", inputs=[source],
                               own=Path(source) / "export")
    ckpt, run_dir = _pick_checkpoint(Path(source), step)
    if out:  # nor the checkpoint read, which may lie outside the run directory (checkpoint.dir)
        check_new_output(out, force=True, key="--out", inputs=[source, run_dir, ckpt], own=run_dir / "export")
    _refuse_damaged(ckpt)
    plan = _plan_of(ckpt, run_dir)
    ckpt_step = int(json.loads((ckpt / MANIFEST).read_text()).get("step", _dir_step(ckpt)))
    shape = model_args(plan)
    stream, padding = model_stream(ckpt, shape)
    target = Path(out) if out else run_dir / "export" / f"{fmt}_step{ckpt_step:08d}"
    if fmt == "hf":
        _check_hf_exportable(stream.shapes, plan.config.model)
    shard_mb = max_shard_mb or DEFAULT_SHARD_MB
    with staged(target) as tmp:  # swapped into place as the block ends (a return included)
        if fmt == "hf":
            result_hf = write_hf(stream, plan.config.model, plan.model.vocab_size, plan.batch.seq_len, plan.dataset_dir,
                                 ckpt, ckpt_step, tmp, shard_mb)
            return replace(result_hf, path=target)
        result = _write_portable(stream, shape, plan, ckpt, ckpt_step, padding, fmt, tmp, shard_mb)
    return replace(result, path=target / result.path.name, config_path=target / CONFIG,
                   files=[target / f.name for f in result.files])


def model_stream(ckpt: Path, shape: LlamaArgs) -> tuple[TensorStream, int]:
    """The checkpoint's model tensors, one at a time, as every format writes them: the q/k rows of a
    checkpoint from before the RoPE layout change converted, the rows tensor parallelism padded the
    vocabulary with removed. Returns the stream and how many rows were removed."""
    raw = checkpoint_tensors(ckpt)
    if not raw.shapes:
        raise ExportError(f"{ckpt} has no model state (expected the key 'model' in the DCP save)")
    vocab = int(shape.vocab_size)
    legacy = checkpoint_rope_layout(ckpt) != ROPE_LAYOUT  # written before usp's RoPE layout change

    def read(name: str) -> torch.Tensor:
        t = raw.read(name)
        if legacy:
            upgrade_rope_rows({name: t}, shape.n_heads, shape.n_kv_heads)
        return _unpadded(name, t, vocab)

    padding = max([raw.shapes[k].shape[0] - vocab for k in (EMB, HEAD) if k in raw.shapes] + [0])
    return TensorStream({k: meta_like(_unpadded(k, v, vocab)) for k, v in raw.shapes.items()}, read), padding


def _unpadded(name: str, t: torch.Tensor, vocab: int) -> torch.Tensor:
    """An embedding or LM head without the rows tensor parallelism padded the vocabulary with (a copy:
    a view would save its whole storage)."""
    if name in (EMB, HEAD) and t.shape[0] > vocab:
        return t[:vocab].clone()
    return t


def _out_dir(out, fmt: str) -> Path:
    """--out is the directory the export writes; a weights file name there is the old usage."""
    out = Path(out)
    if fmt != "hf" and out.suffix in (".pt", ".pth", ".bin", ".safetensors"):
        raise ExportError(f"--out names the directory the export writes ({WEIGHTS[fmt]} and {CONFIG} go in it), "
                          "not the weights file", key="--out", value=str(out), fix=f"--out {out.with_suffix('')}")
    return out


def _write_portable(stream: TensorStream, shape: LlamaArgs, plan: RunPlan, ckpt: Path, ckpt_step: int, padding: int,
                    fmt: str, directory: Path, shard_mb: float) -> ExportResult:
    """The weights file(s) and usp's config.json in `directory` (created here)."""
    directory.mkdir()
    stream, tied, aliases = _tie_embeddings(stream, shape.tie_embeddings, fmt)
    stream, non_finite = _watch_finite(stream)
    files = write_shards(stream, directory, PATTERNS[fmt], shard_mb, _saver(fmt, tied), aliases=aliases)
    weights = files[0] if len(files) == 1 else f"{PATTERNS[fmt].format(suffix='')}.index.json"
    config = {
        "architecture": "llama (usp.models.llama.Llama: RMSNorm, RoPE, GQA attention, SwiGLU)",
        "model": asdict(shape),
        "max_seq_len": int(plan.batch.seq_len),
        "dtype": str(next(iter(stream.shapes.values())).dtype).replace("torch.", ""),
        "weights": weights, "weights_format": fmt, "tied_weights": tied,
        "vocab_padding_removed": padding, "n_params": stream.numel(), "step": ckpt_step,
        "source_checkpoint": str(ckpt), "run": plan.name, "model_name": plan.config.model.name,
        "rope_layout": ROPE_LAYOUT,  # q/k rows as usp.models.llama.Llama rotates them (usp/models/rope_layout.py)
    }
    if len(files) > 1:
        config["weights_files"] = files
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return ExportResult(directory / weights, directory / CONFIG, ckpt, ckpt_step, len(stream.shapes) + len(aliases),
                        stream.numel(), tied, non_finite, [directory / f for f in files], stream.nbytes())


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}", key="--format", value=fmt,
                          fix="--format torch, --format safetensors or --format hf")
    if fmt in ("safetensors", "hf"):
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise ExportError("the safetensors package is not installed", key="--format", value=fmt,
                              fix="pip install safetensors (or --format torch)") from None


def _check_hf_exportable(names, model) -> None:
    """Mixtral and Qwen3-MoE route by their gate's top-k alone: a model trained with aux-loss-free
    balancing picks its experts with a bias (usp.models.moe) that neither has a place for. Mixtral
    always renormalises the top-k weights (model.router_norm_topk=false needs Qwen3-MoE's norm_topk_prob,
    so model.qk_norm). DeepSeek-V3 has the bias (e_score_correction_bias) and its router's options; the
    other types none of them, nor dense first layers."""
    kind = model_type(model)
    if kind == "deepseek_v3":
        if int(model.n_experts or 0) and model.router_score != "sigmoid":
            raise ExportError("model.router_score=softmax: DeepSeek-V3 scores its experts by sigmoids, so "
                              "transformers would route otherwise", key="--format", value="hf",
                              fix="--format safetensors or --format torch")
        return
    for key, plain in (("router_score", "softmax"), ("router_groups", 1), ("router_scale", 1.0), ("n_dense_layers", 0)):
        if int(model.n_experts or 0) and getattr(model, key) != plain:
            raise ExportError(f"model.{key}={getattr(model, key)!r} is DeepSeek-V3's, whose Hugging Face model needs "
                              "latent attention (model.kv_lora_rank > 0)", key="--format", value="hf",
                              fix="--format safetensors or --format torch")
    biased = [k for k in names if k.endswith("expert_bias")]
    if biased:
        raise ExportError(f"the checkpoint has router biases ({biased[0]}, model.router_bias_update_rate > 0): "
                          "Mixtral and Qwen3-MoE have no router bias, so transformers would route other experts",
                          key="--format", value="hf",
                          fix="--format safetensors or --format torch (usp's own model keeps the bias)")
    if kind == "mixtral" and not model.router_norm_topk:
        raise ExportError("model.router_norm_topk=false: Mixtral renormalises the top-k router probabilities, so "
                          "transformers would weight the experts otherwise", key="--format", value="hf",
                          fix="--format safetensors or --format torch")


def _tie_embeddings(stream: TensorStream, tie: bool, fmt: str) -> tuple[TensorStream, dict, dict]:
    """A tied LM head stored once: torch saves it as an alias of the embedding (one storage, written
    once, in the embedding's file), safetensors drops the key. Returns the stream without the head,
    {tied key: the key it shares} (or {}) and the aliases to save."""
    if not (tie and EMB in stream.shapes):
        return stream, {}, {}
    if HEAD in stream.shapes:  # a checkpoint holding both copies: tied only if they are equal
        head, emb = stream.read(HEAD), stream.read(EMB)
        if not (head.shape == emb.shape and torch.allclose(head, emb, rtol=0, atol=0, equal_nan=True)):
            return stream, {}, {}
    shapes = {k: v for k, v in stream.shapes.items() if k != HEAD}
    return TensorStream(shapes, stream.read), {HEAD: EMB}, ({HEAD: EMB} if fmt == "torch" else {})


def _watch_finite(stream: TensorStream) -> tuple[TensorStream, list[str]]:
    """`stream`, noting (in the returned list) each tensor read that holds NaN or inf."""
    non_finite: list[str] = []

    def read(name: str) -> torch.Tensor:
        t = stream.read(name)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            non_finite.append(name)
        return t

    return TensorStream(stream.shapes, read), non_finite


def _saver(fmt: str, tied: dict):
    if fmt == "torch":
        return lambda shard, path: torch.save(shard, path)
    from safetensors.torch import save_file

    metadata = {"format": "pt", "tied_weights": json.dumps(tied)}
    return lambda shard, path: save_file(shard, str(path), metadata=metadata)


def model_args(plan: RunPlan) -> LlamaArgs:
    """The architecture the checkpoint was trained with (the plan's model, its vocabulary unpadded)."""
    return LlamaArgs.from_config(plan.config.model, plan.model.vocab_size)


def _pick_checkpoint(source: Path, step: int | None) -> tuple[Path, Path]:
    """(checkpoint directory, run directory)."""
    if (source / MANIFEST).is_file() or source.name.startswith("step_"):
        problem = check_manifest(source)
        if problem:
            raise ExportError(f"{source} is not a complete checkpoint: {problem}", key="RUN_DIR", value=str(source),
                              fix="pick a complete one (usp status <run dir> lists them)")
        run_dir = source.parent.parent if source.parent.name == CHECKPOINTS else source.parent
        return source, run_dir
    if not source.is_dir():
        raise ExportError(f"no such run directory {source}", key="RUN_DIR", value=str(source))
    plan_file = plan_path(source)
    configured = read_plan(plan_file).config.checkpoint.dir if plan_file.is_file() else None
    where = run_checkpoint_dir(source, configured)
    found = list_checkpoints(where)
    complete = [c for c in found if c.complete]
    if step is not None:
        match = [c for c in found if c.step == step and c.path.name.startswith("step_")]
        if not match:
            raise ExportError(f"no checkpoint of step {step} in {where}", key="--step", value=step,
                              fix=f"one of the complete steps: {[c.step for c in complete] or 'none'}")
        if not match[0].complete:
            raise ExportError(f"the checkpoint of step {step} is incomplete: {match[0].problem}", key="--step",
                              value=step, fix=f"one of the complete steps: {[c.step for c in complete] or 'none'}")
        return match[0].path, source
    if not complete:
        raise ExportError(f"no complete checkpoint in {where}", key="RUN_DIR", value=str(source),
                          fix="train with checkpoint.enabled=true (a checkpoint is saved at the end), "
                              "or pass a step_<N> directory")
    return complete[-1].path, source


def _refuse_damaged(ckpt: Path) -> None:
    """Every file of the checkpoint against its checksums before anything is written (a checkpoint
    saved without them is exported as it is)."""
    state, problems = checksums.verify_checkpoint(ckpt)
    if state == "damaged":
        raise ExportError(f"the checkpoint {ckpt} is damaged: {'; '.join(problems)}", key="--step",
                          value=_dir_step(ckpt), fix="export an older step (usp checkpoints verify <run dir> "
                                                      "lists the checkpoints that verify)")


def _plan_of(ckpt: Path, run_dir: Path) -> RunPlan:
    for path in (plan_path(ckpt), plan_path(run_dir)):
        if path.is_file():
            return read_plan(path)
    raise ExportError(f"neither {ckpt} nor {run_dir} has a plan.yaml: the model architecture is unknown")


def _dir_step(ckpt: Path) -> int:
    try:
        return int(ckpt.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return 0
