"""`usp export`: one checkpoint -> one file with the whole model, usable without usp.

Reads the model part of a torch.distributed.checkpoint (DCP) save in a single process with
DCP's own loader (`_load_state_dict_from_keys`: full, unsharded tensors whatever layout saved
them), and writes {FQN: tensor} with torch.save (or safetensors) plus config.json with the
architecture. Tied weights are stored once (torch: two keys share one storage; safetensors: the
duplicate key is dropped) and listed under "tied_weights" in config.json. A checkpoint written
before usp's RoPE layout change has its q/k rows converted (usp/engine/rope_upgrade.py): every
export is in today's layout. --format hf writes a Hugging Face directory instead
(usp/engine/hf_checkpoint.py).

Every format writes one directory the export owns (model.pt or model.safetensors + config.json,
or the HF files): a torch file has no room for the architecture without changing what torch.load
returns, and a config.json must never land in a folder holding someone else's (an HF model's).
The directory is built under a temporary name and swapped into place (usp.run.files.staged); an
--out that exists is refused unless force (usp.run.writable.check_new_output)."""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from usp.engine.hf_checkpoint import DEFAULT_SHARD_MB, HFExportResult, write_hf
from usp.engine.rope_upgrade import checkpoint_rope_layout, upgrade_rope_rows
from usp.errors import UspError
from usp.models.rope_layout import ROPE_LAYOUT
from usp.run.files import (
    CHECKPOINTS,
    MANIFEST,
    check_manifest,
    checkpoint_dir,
    list_checkpoints,
    plan_path,
    read_plan,
    staged,
)
from usp.run.writable import check_new_output

FORMATS = ("torch", "safetensors", "hf")
WEIGHTS = {"torch": "model.pt", "safetensors": "model.safetensors"}  # the file in the export directory
CONFIG = "config.json"
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing / compile


class ExportError(UspError):
    """The checkpoint can't be exported as asked."""


@dataclass
class ExportResult:
    path: Path
    config_path: Path
    checkpoint: Path
    step: int
    n_tensors: int
    n_params: int
    tied: dict
    non_finite: list  # keys of tensors holding NaN / inf

    def describe(self) -> str:
        lines = [f"exported step {self.step} ({self.n_params:,} parameters, {self.n_tensors} tensors) "
                 f"from {self.checkpoint}",
                 f"  weights: {self.path} ({self.path.stat().st_size / 2 ** 20:.1f} MiB)",
                 f"  config:  {self.config_path}"]
        lines += [f"  tied:    {k} = {v} (stored once)" for k, v in self.tied.items()]
        if self.non_finite:
            lines.append(f"  warning: {len(self.non_finite)} tensor(s) hold NaN or inf values, "
                         f"e.g. {self.non_finite[0]}")
        if self.path.suffix == ".safetensors":
            lines.append("  load:    safetensors.torch.load_model(model, path)  (restores tied weights)")
        else:
            lines.append("  load:    model.load_state_dict(torch.load(path, weights_only=True))")
        return "\n".join(lines)


def load_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors from a DCP checkpoint directory, keyed by FQN (single process)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is unavailable or uninitialized": intended
        loaded = _load_state_dict_from_keys({"model"}, checkpoint_id=str(ckpt))
    model = loaded.get("model")
    if not isinstance(model, dict) or not model:
        raise ExportError(f"{ckpt} has no model state (expected the key 'model' in the DCP save)")
    out = {}
    for key, value in model.items():
        if not isinstance(value, torch.Tensor):
            continue
        for part in _WRAPPER_PARTS:
            key = key.replace(part, "")
        out[key] = value.detach().contiguous()
    return out


def export_model(source, step: int | None = None, out=None, fmt: str = "torch",
                 max_shard_mb: float | None = None, force: bool = False) -> ExportResult | HFExportResult:
    """Export the newest complete checkpoint of run directory `source` (or `step`, or `source`
    itself when it is a step_<N> directory) to the directory `out` (default <run dir>/export/
    <fmt>_step<N>; hf in safetensors shards of at most max_shard_mb). An existing `out` is
    replaced only with force; the default one, usp's own, always is."""
    _check_format(fmt)
    if out:  # before the (possibly long) load
        out = check_new_output(_out_dir(out, fmt), force=force, key="--out", inputs=[source])
    ckpt, run_dir = _pick_checkpoint(Path(source), step)
    if out and force:  # nor the checkpoint it reads (checkpoint.dir may lie outside the run directory)
        check_new_output(out, force=True, key="--out", inputs=[ckpt])
    plan = _plan_of(ckpt, run_dir)
    ckpt_step = int(json.loads((ckpt / MANIFEST).read_text()).get("step", _dir_step(ckpt)))
    state = load_model_state(ckpt)
    model_cfg = _model_config(plan)
    if checkpoint_rope_layout(ckpt) != ROPE_LAYOUT:  # written before usp's RoPE layout change
        upgrade_rope_rows(state, model_cfg)
    padding = _strip_vocab_padding(state, int(model_cfg["vocab_size"]))
    target = Path(out) if out else run_dir / "export" / f"{fmt}_step{ckpt_step:08d}"
    if fmt == "hf":
        _check_hf_exportable(state)
    with staged(target) as tmp:  # swapped into place as the block ends (a return included)
        if fmt == "hf":
            return replace(write_hf(state, model_cfg, plan, ckpt, ckpt_step, tmp, max_shard_mb or DEFAULT_SHARD_MB),
                           path=target)
        config = _write_portable(state, model_cfg, plan, ckpt, ckpt_step, padding, fmt, tmp)
    non_finite = [k for k, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    return ExportResult(target / WEIGHTS[fmt], target / CONFIG, ckpt, ckpt_step, len(state), config["n_params"],
                        config["tied_weights"], non_finite)


def _out_dir(out, fmt: str) -> Path:
    """--out is the directory the export writes; a weights file name there is the old usage."""
    out = Path(out)
    if fmt != "hf" and out.suffix in (".pt", ".pth", ".bin", ".safetensors"):
        raise ExportError(f"--out names the directory the export writes ({WEIGHTS[fmt]} and {CONFIG} go in it), "
                          "not the weights file", key="--out", value=str(out), fix=f"--out {out.with_suffix('')}")
    return out


def _write_portable(state: dict, model_cfg: dict, plan: dict, ckpt: Path, ckpt_step: int, padding: int,
                    fmt: str, directory: Path) -> dict:
    """The weights file and usp's config.json in `directory` (created here); returns the config."""
    directory.mkdir()
    tied = _tie_embeddings(state, model_cfg, fmt)
    _write_weights(state, directory / WEIGHTS[fmt], fmt, tied)
    unique = {id(t): t for t in state.values()}
    config = {
        "architecture": "llama (usp.models.llama.Llama: RMSNorm, RoPE, GQA attention, SwiGLU)",
        "model": model_cfg,
        "max_seq_len": int(plan["batch"]["seq_len"]),
        "dtype": str(next(iter(state.values())).dtype).replace("torch.", ""),
        "weights": WEIGHTS[fmt], "weights_format": fmt, "tied_weights": tied,
        "vocab_padding_removed": padding, "n_params": sum(t.numel() for t in unique.values()), "step": ckpt_step,
        "source_checkpoint": str(ckpt), "run": plan.get("name"), "model_name": plan["config"]["model"].get("name"),
        "rope_layout": ROPE_LAYOUT,  # q/k rows as usp.models.llama.Llama rotates them (usp/models/rope_layout.py)
    }
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return config


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


def _check_hf_exportable(state: dict) -> None:
    """Mixtral routes by its gate's top-k alone: a model trained with aux-loss-free balancing picks
    its experts with a bias (usp.models.moe) that MixtralForCausalLM has no place for."""
    biased = [k for k in state if k.endswith("expert_bias")]
    if biased:
        raise ExportError(f"the checkpoint has router biases ({biased[0]}, model.router_bias_update_rate > 0): "
                          "Mixtral has no router bias, so transformers would route other experts", key="--format",
                          value="hf", fix="--format safetensors or --format torch (usp's own model keeps the bias)")


def _strip_vocab_padding(state: dict, vocab: int) -> int:
    """Drop the rows tensor parallelism padded the vocabulary with (in place); returns how many."""
    padding = 0
    for key in ("tok_embeddings.weight", "output.weight"):
        if key in state and state[key].shape[0] > vocab:
            padding = state[key].shape[0] - vocab
            state[key] = state[key][:vocab].clone()
    return padding


def _tie_embeddings(state: dict, model_cfg: dict, fmt: str) -> dict:
    """Store a tied LM head once (in place): torch shares the embedding's storage, safetensors
    drops the key. Returns {tied key: the key it shares}, or {}."""
    if not (model_cfg.get("tie_embeddings") and "tok_embeddings.weight" in state):
        return {}
    emb, head = state["tok_embeddings.weight"], state.get("output.weight")
    if head is not None and not (head.shape == emb.shape
                                 and torch.allclose(head, emb, rtol=0, atol=0, equal_nan=True)):
        return {}
    if fmt == "torch":
        state["output.weight"] = emb  # one storage: torch.save writes it once
    else:
        state.pop("output.weight", None)
    return {"output.weight": "tok_embeddings.weight"}


def _write_weights(state: dict, path: Path, fmt: str, tied: dict) -> None:
    if fmt == "torch":
        torch.save(state, path)
    else:
        from safetensors.torch import save_file

        save_file(state, str(path), metadata={"format": "pt", "tied_weights": json.dumps(tied)})


def _model_config(plan: dict) -> dict:
    """The architecture as the keyword arguments of usp.models.llama.LlamaArgs, vocab resolved."""
    from usp.models.llama import LlamaArgs

    cfg = dict(plan["config"]["model"])
    cfg["vocab_size"] = int(plan["model"]["vocab_size"])
    names = [f.name for f in fields(LlamaArgs)]
    out = {k: cfg[k] for k in names if k in cfg}
    if out.get("n_kv_heads") is None:
        out["n_kv_heads"] = out.get("n_heads")
    return out


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
    where = checkpoint_dir(read_plan(plan_file)) if plan_file.is_file() else source / CHECKPOINTS
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


def _plan_of(ckpt: Path, run_dir: Path) -> dict:
    for path in (plan_path(ckpt), plan_path(run_dir)):
        if path.is_file():
            return read_plan(path)
    raise ExportError(f"neither {ckpt} nor {run_dir} has a plan.yaml: the model architecture is unknown")


def _dir_step(ckpt: Path) -> int:
    try:
        return int(ckpt.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return 0
