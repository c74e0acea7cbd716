"""What the test files share besides fixtures (those are in tests/conftest.py): the repository, the
session's data cache, `usp` run as a user runs it or in this process, a run's losses and a plan."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from usp.run.files import metrics_path, read_jsonl

REPO = Path(__file__).resolve().parents[1]
USP = str(Path(sys.executable).parent / "usp")  # the console script of this environment
# The session's data cache (never ~/.cache/usp): tests/conftest.py points USP_CACHE_DIR at it and
# removes it at the end. One per process: each pytest-xdist worker has its own.
SESSION_CACHE = Path(tempfile.mkdtemp(prefix="usp-test-cache-"))


def usp_env(**extra: str) -> dict[str, str]:
    """The environment of a `usp` process started by a test: the session's data cache (the corpus
    the `shakespeare` fixture prepared), a wide console."""
    return dict(os.environ, USP_CACHE_DIR=str(SESSION_CACHE), COLUMNS="200", **extra)


def run_usp(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real `usp` console script as a user would (its own process: for commands that train,
    start torchrun, or whose start-up is what the test is about)."""
    return subprocess.run([USP, *args], cwd=cwd or REPO, env=usp_env(), capture_output=True, text=True,
                          timeout=timeout)


def usp_cli(*args: str, cwd: Path, env: dict | None = None, columns: int = 200) -> subprocess.CompletedProcess:
    """The same `usp` command line run in this process (typer's CliRunner): the commands that only
    plan, print or write files, where a fresh interpreter per call would cost ~1 s and test nothing
    more (tests/e2e/test_import_boundary.py runs every command in its own process). The result reads
    like run_usp's: returncode, stdout, stderr; an unexpected exception is exit 1 with its traceback
    on stderr, as the console script would show it."""
    import traceback

    from typer.testing import CliRunner

    from usp.cli import app

    env = {"USP_CACHE_DIR": str(cwd / "cache"), "COLUMNS": str(columns), **(env or {})}
    here = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, list(args), env=env, prog_name="usp")
    finally:
        os.chdir(here)
    stderr, code = result.stderr, result.exit_code
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
        code = 1
    return subprocess.CompletedProcess(["usp", *args], code, result.stdout, stderr)


def losses(run_dir: Path) -> dict[int, float]:
    """{step: training loss} from a run's metrics.jsonl (rank 0's records)."""
    return {r["step"]: r["loss"] for r in read_jsonl(metrics_path(run_dir)) if "loss" in r}


def plan_for(*overrides: str, conf: str | None = None, runs_dir: Path | None = None, training: bool = True, **kw):
    """The RunPlan of a config (the catalogue's, or the recipe `conf`) with `overrides` (and
    train.runs_dir=`runs_dir`), planned as `usp train` plans it; training=False plans as `usp plan`
    and `usp estimate` do (the data pipeline's limits are warnings). **kw: build_plan's (force, ...)."""
    from usp.config.compose import compose_config
    from usp.plan.plan import build_plan

    extra = [f"train.runs_dir={runs_dir}"] if runs_dir else []
    cfg, choices = compose_config(conf, [*overrides, *extra])
    return build_plan(cfg, choices, training=training, **kw)


def train_in_process(*overrides: str, conf: str | None = None) -> tuple[Path, str]:
    """Plan and train one rank in this process, as `usp train` does for world size 1 (the catalogue's
    config, or the recipe `conf`, with `overrides`); returns the run directory and what the run printed.
    The run lock is given back at the end, as `usp train` gives it back."""
    import contextlib
    import io

    from rich.console import Console

    from usp.config.compose import compose_config
    from usp.engine.worker import run_worker
    from usp.launch.pre_launch import prepare_run
    from usp.run.lock import release

    cfg, choices = compose_config(conf, list(overrides))
    plan, plan_path = prepare_run(cfg, choices, console=Console(file=io.StringIO()))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            assert run_worker(str(plan_path)) == 0
    finally:
        release(plan.run_dir)
    return Path(plan.run_dir), out.getvalue()


def assert_same_losses(ref: list[dict], other: list[dict], rtol: float) -> None:
    """Two runs' metrics.jsonl records: the same steps, losses within rtol, gradient norms within 1e-5."""
    assert [r["step"] for r in ref] == [r["step"] for r in other]
    for a, b in zip(ref, other):
        assert abs(a["loss"] - b["loss"]) <= rtol * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"]), (a["step"], a, b)


def hf_tensors(directory: Path) -> dict:
    """Every tensor of an HF checkpoint directory (one model.safetensors or an index's shards), by name."""
    from safetensors.torch import load_file

    return {name: t for file in sorted(Path(directory).glob("*.safetensors")) for name, t in load_file(file).items()}
