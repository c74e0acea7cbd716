"""`usp export` streams a checkpoint (usp/engine/export.py): a model trained under FSDP over 2 processes
(151 MB in fp32) exports in every format in files of at most --shard-mb with a process whose peak
resident memory grows by far less than the model (the console command run in a process of its own
that reports its VmHWM), and the files load back: transformers reads the HF directory with usp's
logits, huggingface_hub's load_torch_model the torch and safetensors files with the checkpoint's
tensors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_usp, usp_env

# 35.7 M parameters, untied (the LM head is a tensor of its own): 151 MB in fp32; its largest tensors
# are the 4096 x 512 embedding and head (8 MiB each)
MODEL = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.ffn_dim=2048", "model.tie_embeddings=false"]
SHARD_MB = 16
TOL = 1e-5
# The export command in a process of its own that prints its peak resident set (VmHWM) above the one it
# had once usp, torch, DCP, safetensors and huggingface_hub were imported (the process's baseline).
MEASURED = """
import json, sys
from pathlib import Path
import huggingface_hub, safetensors.torch, torch.distributed.checkpoint  # noqa: F401
from usp.cli import app

def vm_hwm():
    return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
                if l.startswith("VmHWM:"))

Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
base = vm_hwm()
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print(json.dumps({"base": base, "peak": vm_hwm()}))
"""

FORMATS = ("hf", "torch", "safetensors")

# the run (2 processes) and three exports: 138 s measured on the loaded 2-core machine (load average ~15)
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shakespeare) -> Path:
    runs = tmp_path_factory.mktemp("export")
    proc = run_usp("train", *MODEL, f"train.runs_dir={runs}", "train.name=run", "cluster.procs_per_node=2",
                   "parallelism.dp_shard=2", "parallelism.dp_replicate=1", "train.steps=1", "train.global_batch=4",
                   "train.seq_len=64", "checkpoint.enabled=true", "train.sample_tokens=0", "train.eval_interval=0",
                   "logging.console=plain")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return runs / "run"


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> dict[str, tuple[Path, int]]:
    """Each format exported by the console command in files of at most SHARD_MB: {format: (its
    directory, the export's peak memory growth in bytes)}."""
    out = tmp_path_factory.mktemp("exports")
    return {fmt: (out / fmt, _export(trained, fmt, out / fmt)) for fmt in FORMATS}


def _export(run: Path, fmt: str, out: Path) -> int:
    """Peak resident memory growth (bytes) of `usp export` writing `out`."""
    proc = subprocess.run([sys.executable, "-c", MEASURED, "export", str(run), "--format", fmt,
                           "--shard-mb", str(SHARD_MB), "--out", str(out)],
                          env=usp_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    return measured["peak"] - measured["base"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_memory_is_one_file_not_the_model(trained, exported, fmt):
    """The export's peak memory grows by one file of at most --shard-mb plus the tensors being read
    and converted, far from the model it writes (measured: 34.5-48.9 MiB over two runs for the 144 MiB
    model in 16 MiB files; 161-175 MiB when the export loaded the whole model first); the model lands in
    several files with an index."""
    from usp.engine.checkpoint_tensors import checkpoint_tensors
    from usp.run.files import list_checkpoints

    stream = checkpoint_tensors([c for c in list_checkpoints(trained / "checkpoints") if c.complete][-1].path)
    model_bytes, largest = stream.nbytes(), max(t.numel() * t.element_size() for t in stream.shapes.values())
    directory, growth = exported[fmt]
    print(f"{fmt}: peak memory growth {growth / 2 ** 20:.1f} MiB, model {model_bytes / 2 ** 20:.1f} MiB")
    assert growth < SHARD_MB * 2 ** 20 + 3 * largest + 24 * 2 ** 20 < model_bytes / 2, (growth, model_bytes)
    files = sorted(p.name for p in directory.iterdir())
    suffix = ".pt" if fmt == "torch" else ".safetensors"
    assert sum(name.endswith(suffix) for name in files) > model_bytes / (SHARD_MB * 2 ** 20), files
    assert f"model{suffix}.index.json" in files


def test_sharded_exports_load_back(trained, exported):
    """transformers loads the sharded HF export with the logits of usp's model built from the
    checkpoint; huggingface_hub's load_torch_model loads the sharded torch and safetensors exports
    (their indexes) into usp's model with every tensor of the checkpoint."""
    from huggingface_hub import load_torch_model
    from transformers import AutoModelForCausalLM

    from usp.contract.plan_file import read_plan
    from usp.engine.export import load_model_state
    from usp.models.llama import Llama, LlamaArgs
    from usp.run.files import list_checkpoints

    plan = read_plan(trained / "plan.yaml")
    ckpt = [c for c in list_checkpoints(trained / "checkpoints") if c.complete][-1].path
    state = load_model_state(ckpt)
    args = LlamaArgs.from_config(plan.config.model, int(plan.model.vocab_size))
    ours = Llama(args, max_seq_len=64)
    ours.load_state_dict(state)
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ours(tokens)
        theirs = AutoModelForCausalLM.from_pretrained(exported["hf"][0])(tokens).logits
    assert expected.abs().max() > 0.1 and torch.allclose(theirs, expected, rtol=0, atol=TOL), \
        (theirs - expected).abs().max()
    for fmt, pattern in (("torch", {"filename_pattern": "model{suffix}.pt", "safe": False}), ("safetensors", {})):
        back = Llama(args, max_seq_len=64)
        result = load_torch_model(back, exported[fmt][0], strict=True, **pattern)
        assert not result.missing_keys and not result.unexpected_keys
        assert all(torch.equal(v, state[k]) for k, v in back.state_dict().items()), fmt
