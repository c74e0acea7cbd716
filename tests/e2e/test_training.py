"""Training on the real corpus through `usp train`: the loss falls, DDP on two processes gives one
process's losses step by step, and a failing run ends cleanly (a Ctrl-C: tests/e2e/test_interrupt.py)."""
from __future__ import annotations

import json
import re

import pytest

from tests.helpers import assert_same_losses, run_usp, train_in_process
from usp.engine.observe.metrics import read_metrics

QUIET = ["logging.console=quiet", "train.sample_tokens=0", "train.log_interval=1", "train.eval_interval=0"]


@pytest.mark.slow
def test_demo_learns_real_text(tmp_path, shakespeare):
    """The README demo, shortened, through the CLI: loss falls far below its start."""
    proc = run_usp("train", "conf=tiny_demo", "train.steps=80", f"train.runs_dir={tmp_path}",
                   "logging.console=plain", "train.eval_interval=40", "train.sample_tokens=20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(tmp_path / "tiny_demo" / "metrics.jsonl")
    first, last = metrics[0], metrics[-1]
    assert first["step"] == 1 and last["step"] == 80
    assert first["loss"] > 8.0  # ~ln(4096) = 8.3 at initialisation
    assert last["loss"] < first["loss"] - 2.0, (first["loss"], last["loss"])
    assert last["val_loss"] is not None and last["val_loss"] < first["loss"] - 2.0
    summary = json.loads((tmp_path / "tiny_demo" / "summary.json").read_text())
    assert summary["tokens"] == 80 * 16 * 128 and summary["final_loss"] == last["loss"]
    assert "run plan: tiny_demo" in proc.stdout and "summary" in proc.stdout
    sample = (tmp_path / "tiny_demo" / "sample.txt").read_text()
    assert sample.startswith("ROMEO:") and len(sample) > len("ROMEO:")


@pytest.mark.distributed
def test_ddp_two_processes_matches_single_process(tmp_path, shakespeare):
    steps = ["train.steps=6", "train.global_batch=16"]
    proc = run_usp("train", "conf=tiny_ddp", *steps, f"train.runs_dir={tmp_path}", *QUIET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = read_metrics(tmp_path / "tiny_ddp" / "metrics.jsonl")
    single_dir, _ = train_in_process(f"train.runs_dir={tmp_path}", *QUIET, *steps, "train.micro_batch=16",
                                     "train.name=single")
    single = read_metrics(single_dir / "metrics.jsonl")
    assert_same_losses(single, ddp, rtol=1e-6)
    assert abs(single[-1]["val_loss"] - ddp[-1]["val_loss"]) <= 1e-6 * single[-1]["val_loss"]
    plan = (tmp_path / "tiny_ddp" / "plan.yaml").read_text()
    assert "grad_accum: 1" in plan and "world_size: 2" in plan
    for rank in (0, 1):  # every rank writes its own log
        log = (tmp_path / "tiny_ddp" / "logs" / f"rank_{rank}.log").read_text()
        assert "done:" in log
        # torch imported with the collector paused, then frozen, and the collector on again (usp/engine/startup_gc.py)
        frozen = re.search(r"garbage collector: on, (\d+) objects frozen at start-up", log)
        assert frozen and int(frozen.group(1)) > 100_000, log[:2000]
        # built under 1 MiB, trained under the plan's threshold (usp/run/allocator.py): DDP gathers no
        # parameter, so glibc's 32 MiB ceiling (its trim threshold twice that)
        assert f"glibc mmap threshold {32 * 2**20} B while training ({2**20} B while building)" in log, log[:3000]


def test_missing_data_file_is_a_clear_error(tmp_path):
    proc = run_usp("train", "data=token_files", f"data.train_bin={tmp_path / 'nope.bin'}",
                   f"data.val_bin={tmp_path / 'nope.bin'}", f"train.runs_dir={tmp_path}")
    assert proc.returncode == 2
    assert "data.train_bin" in proc.stderr and "nope.bin" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_unwritable_run_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = run_usp("train", f"train.runs_dir={blocker / 'runs'}")
    assert proc.returncode == 2
    assert "train.runs_dir" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.distributed
def test_failing_rank_propagates_exit_code(tmp_path):
    """A rank that dies makes `usp train` fail with torchrun's code and names the logs."""
    proc = run_usp("train", "conf=tiny_ddp", "cluster.device=cuda", f"train.runs_dir={tmp_path}", *QUIET)
    assert proc.returncode != 0
    assert "no CUDA device" in proc.stderr and "per-rank logs" in proc.stderr
