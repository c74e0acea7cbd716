"""The torch-free import boundary, in one place: every usp command that must not import torch runs
in its own Python process, and what that process imported (sys.modules at exit, so lazy imports
count too) must not hold torch, nor numpy where start-up keeps it out (only `usp report`'s plots
and `usp prepare-data`'s token files need it; `usp --help` also stays clear of Hydra and omegaconf). One more
case imports every module of the torch-free packages (usp.cli, usp.run, usp.config, usp.perf, usp.plan,
usp.launch, usp.report, usp.data, usp.view) and usp.errors."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from usp.contract.config_schema import ModelConfig
from usp.contract.hf_shape import hf_config
from usp.run import checksums

REPO = Path(__file__).resolve().parents[2]
TORCH_FREE_PACKAGES = ("usp.cli", "usp.run", "usp.config", "usp.perf", "usp.plan", "usp.launch", "usp.report",
                       "usp.data", "usp.view")
TORCH_FREE_MODULES = ("usp.errors",)

# Runs one usp command (or imports every torch-free module) and writes sys.modules at exit.
RUNNER = f"""
import atexit, json, os, sys
atexit.register(lambda: open(os.environ["USP_MODULES_OUT"], "w").write(json.dumps(sorted(sys.modules))))
if sys.argv[1:] == ["--import-all"]:
    import importlib, pkgutil
    for name in {TORCH_FREE_MODULES!r}:
        importlib.import_module(name)
    for pkg in {TORCH_FREE_PACKAGES!r}:
        for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
            if not info.name.endswith(".__main__"):  # `python -m` entries run the command
                importlib.import_module(info.name)
else:
    from usp.cli import main
    sys.argv = ["usp", *sys.argv[1:]]
    main()
"""

HF = {"transformers", "safetensors"}  # usp[hf]: only `usp export --format hf` and model.init_from's load use them
NO_TORCH = {"torch"} | HF
NO_NUMPY = {"torch", "numpy", "datasets"} | HF
R, C, H = "<runs>", "<corpus>", "<hf>"  # placeholders: the module's runs directory, a small text corpus, an HF
# checkpoint directory (its config.json: what `usp plan` reads of a model.init_from)
JOB_ID = "987654321"
RUN = f"{R}/boundary"  # a run directory: plan.yaml (usp plan --save), a rank log, a job record
CASES = [  # (argv, modules that must not be imported)
    pytest.param(["--help"], NO_NUMPY | {"hydra", "omegaconf"}, id="help"),
    pytest.param(["plan", f"train.runs_dir={R}"], NO_NUMPY, id="plan"),
    pytest.param(["plan", "model=llama3_1_8b", "cluster=slurm_h100", "--force"], NO_NUMPY, id="plan-force"),
    pytest.param(["plan", f"model.init_from={H}", "model.vocab_size=4096"], NO_NUMPY, id="plan-init-from-hf"),
    pytest.param(["plan", "--search", "model=llama3_2_1b", "cluster=slurm_h100"], NO_NUMPY, id="plan-search"),
    pytest.param(["plan", "--cfg", "job"], NO_NUMPY, id="plan-cfg"),
    pytest.param(["plan", "--json", "conf=mixtral_8x7b"], NO_NUMPY | {"plotly"}, id="plan-json"),
    pytest.param(["plan", "conf=mixtral_8x7b", "--html", f"{R}/plan.html"], NO_TORCH, id="plan-html"),
    # the engine builds the ranks in a subprocess (python -m usp.engine.meta_build): this one stays torch-free
    pytest.param(["plan", "--build-check", "conf=tiny_ddp", "1"], NO_NUMPY, id="plan-build-check"),
    # own files: planned from their names and sizes, nothing read or tokenized
    pytest.param(["plan", "data=files", f"data.paths=[{C}]", f"train.runs_dir={R}"],
                 NO_NUMPY | {"tokenizers", "datasets", "tiktoken", "pyarrow"}, id="plan-files"),
    pytest.param(["estimate", "conf=llama3_1_8b", "train.tokens=1e12", "--gpus", "64"], NO_NUMPY, id="estimate"),
    pytest.param(["estimate", "conf=llama3_1_8b", "train.tokens=1e12", "--scaling", "--max-nodes", "2"], NO_NUMPY,
                 id="estimate-scaling"),
    # The runs directory holds no measured metrics.jsonl: usp calibrate refuses (exit 2) after its imports.
    pytest.param(["calibrate", R, "--cluster", "slurm_h100"], NO_NUMPY, id="calibrate", marks=pytest.mark.may_refuse),
    pytest.param(["train", "--cfg", "job"], NO_NUMPY, id="train-cfg"),
    pytest.param(["train", "--dry-run", "cluster=local_slurm", f"train.runs_dir={R}", "train.name=t"], NO_NUMPY,
                 id="train-dry-run"),
    pytest.param(["submit", "--dry-run", "cluster=local_slurm", f"train.runs_dir={R}", "train.name=s"], NO_NUMPY,
                 id="submit-dry-run"),
    pytest.param(["sweep", "--dry-run", "train.micro_batch=4,8", f"train.runs_dir={R}", "--name", "sw"], NO_NUMPY,
                 id="sweep-dry-run"),
    pytest.param(["sweep", "--dry-run", "cluster=local_slurm", "train.micro_batch=4,8", f"train.runs_dir={R}",
                  "--name", "sw_slurm"], NO_NUMPY, id="sweep-slurm-dry-run"),
    pytest.param(["status", RUN], NO_NUMPY, id="status"),
    pytest.param(["logs", RUN, "--rank", "0"], NO_NUMPY, id="logs"),
    pytest.param(["checkpoints", "verify", RUN], NO_NUMPY, id="checkpoints-verify"),
    # Without a Slurm controller scontrol fails and usp says so (exit 2) after importing all it uses.
    pytest.param(["cancel", RUN], NO_NUMPY, id="cancel", marks=pytest.mark.may_refuse),
    pytest.param(["config", "list"], NO_NUMPY, id="config-list"),
    pytest.param(["config", "show", "model=tiny"], NO_NUMPY, id="config-show-group"),
    pytest.param(["config", "show", "tiny_ddp"], NO_NUMPY, id="config-show-recipe"),
    pytest.param(["config", "cp", "tiny_ddp", f"{R}/copied.yaml"], NO_NUMPY, id="config-cp"),
    pytest.param(["report", RUN, "--out", f"{R}/report"], NO_TORCH, id="report"),
    pytest.param(["prepare-data", "data=text_files", f"data.paths=[{C}]", "data.vocab_size=300",
                  "data.val_fraction=0.3"], NO_TORCH, id="prepare-data"),
    pytest.param(["--import-all"], NO_TORCH, id="every-torch-free-module"),
]


def _run(argv: list[str], cwd: Path, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, USP_CACHE_DIR=str(cwd / "cache"), USP_MODULES_OUT=str(out), COLUMNS="200",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", RUNNER, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A runs directory holding one planned run (with a rank log and a job record) and a corpus."""
    work = tmp_path_factory.mktemp("boundary")
    runs = work / "runs"
    proc = _run(["plan", "--save", f"train.runs_dir={runs}", "train.name=boundary"], work, work / "modules.json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = runs / "boundary"
    (run / "logs").mkdir()
    (run / "logs" / "rank_0.log").write_text("step 1/1 loss 8.0\n")
    # a job id no Slurm cluster here reaches: with tests/e2e/test_slurm.py's local cluster up in the
    # other worker, `usp cancel` of a job 1 cancelled that cluster's first job
    (run / "job.json").write_text(json.dumps({"jobs": [{"job_id": JOB_ID, "script": str(run / "job.sbatch"),
                                                        "log_dir": str(run / "logs"),
                                                        "plans": [str(run / "plan.yaml")], "submitted_at": 0.0}]}))
    step = run / "checkpoints" / "step_00000001"  # a checkpoint's files as usp writes them, with checksums
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (step / "manifest.json").write_text(json.dumps(checksums.manifest(
        1, {"__0_0.distcp": 256 * 64}, checksums.digests(step, ["__0_0.distcp"]))))
    (work / "hf").mkdir()  # the tiny model group as a Hugging Face config.json
    (work / "hf" / "config.json").write_text(json.dumps(hf_config(
        ModelConfig(dim=128, n_layers=2, n_heads=4, ffn_dim=384, tie_embeddings=True, rope_theta=10000.0,
                    norm_eps=1e-5), vocab=4096, max_seq_len=128, dtype="float32")))
    save_file({"model.norm.weight": np.ones(128, np.float32)}, str(work / "hf" / "model.safetensors"))  # headers read
    rng = random.Random(0)
    words = "the king queen of and to a in is that my love".split()
    (work / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(20000)))
    return work


@pytest.mark.parametrize("argv,forbidden", CASES)
def test_command_imports_no_torch(work, argv, forbidden, tmp_path, request):
    argv = [a.replace(R, str(work / "runs")).replace(C, str(work / "corpus.txt")).replace(H, str(work / "hf"))
            for a in argv]
    out = tmp_path / "modules.json"
    proc = _run(argv, work, out)
    ok = (0, 2) if request.node.get_closest_marker("may_refuse") else (0,)
    assert proc.returncode in ok and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    modules = set(json.loads(out.read_text()))
    assert "usp.cli" in modules or argv == ["--import-all"]  # the record is of a real run
    imported = sorted(forbidden & {m.split(".")[0] for m in modules})
    assert not imported, f"usp {' '.join(argv)} imported {', '.join(imported)}"
