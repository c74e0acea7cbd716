"""Training on the real corpus: the loss falls, and layouts that must be exactly equivalent
(DDP vs one process, gradient accumulation vs one big micro batch, recompute on/off) give
the same losses step by step."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from rich.console import Console

from tests.helpers import SESSION_CACHE, USP, run_usp
from usp.config.compose import compose_config
from usp.engine.observe.metrics import read_metrics
from usp.launch.prepare import prepare_run

QUIET = ["logging.console=quiet", "train.sample_tokens=0", "train.log_interval=1", "train.eval_interval=0"]


def train_inprocess(runs: Path, *overrides: str) -> list[dict]:
    """Plan and train one rank in this process (what `usp train` does for world size 1)."""
    from usp.engine.worker import run_worker

    cfg, choices = compose_config(None, [f"train.runs_dir={runs}", *QUIET, *overrides])
    plan, plan_path = prepare_run(cfg, choices, console=Console(file=io.StringIO()))
    assert run_worker(str(plan_path)) == 0
    return read_metrics(Path(plan.run_dir) / "metrics.jsonl")


def assert_same_losses(ref: list[dict], other: list[dict], rtol: float) -> None:
    assert [r["step"] for r in ref] == [r["step"] for r in other]
    for a, b in zip(ref, other):
        assert abs(a["loss"] - b["loss"]) <= rtol * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"]), (a["step"], a, b)


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
    single = train_inprocess(tmp_path, *steps, "train.micro_batch=16", "train.name=single")
    assert_same_losses(single, ddp, rtol=1e-6)
    assert abs(single[-1]["val_loss"] - ddp[-1]["val_loss"]) <= 1e-6 * single[-1]["val_loss"]
    plan = (tmp_path / "tiny_ddp" / "plan.yaml").read_text()
    assert "grad_accum: 1" in plan and "world_size: 2" in plan
    for rank in (0, 1):  # every rank writes its own log
        assert "done:" in (tmp_path / "tiny_ddp" / "logs" / f"rank_{rank}.log").read_text()


@pytest.mark.slow
def test_grad_accum_equals_one_big_micro_batch(tmp_path, shakespeare):
    big = train_inprocess(tmp_path, "train.steps=5", "train.micro_batch=16", "train.name=big")
    accum = train_inprocess(tmp_path, "train.steps=5", "train.micro_batch=4", "train.name=accum")
    plan = (tmp_path / "accum" / "plan.yaml").read_text()
    assert "grad_accum: 4" in plan
    assert_same_losses(big, accum, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_the_same_losses(tmp_path, shakespeare, mode):
    ref = train_inprocess(tmp_path, "train.steps=4", "train.name=ref")
    other = train_inprocess(tmp_path, "train.steps=4", f"train.recompute={mode}", f"train.name={mode}")
    assert_same_losses(ref, other, rtol=1e-6)


def test_pretokenized_token_files(tmp_path, shakespeare):
    """data=token_files trains from the user's own uint16 .bin files (no tokenizer, no sample)."""
    directory, _ = shakespeare
    metrics = train_inprocess(tmp_path, "data=token_files", f"data.train_bin={directory / 'train.bin'}",
                              f"data.val_bin={directory / 'val.bin'}", "data.vocab_size=4096", "train.steps=2",
                              "train.sample_tokens=5")
    assert len(metrics) == 2 and metrics[0]["loss"] > 8.0
    assert not (tmp_path / "tiny-single" / "sample.txt").exists()


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


@pytest.mark.distributed
def test_ctrl_c_stops_every_rank(tmp_path, shakespeare):
    env = dict(os.environ, USP_CACHE_DIR=str(SESSION_CACHE))
    proc = subprocess.Popen([USP, "train", "conf=tiny_ddp", "train.steps=100000", f"train.runs_dir={tmp_path}",
                             "logging.console=plain", "train.log_interval=1"], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    for line in proc.stdout:  # wait until training is under way
        if line.startswith("step 2/") or time.time() > deadline:
            break
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    assert proc.wait(timeout=60) != 0
    time.sleep(1)
    plan_path = str(tmp_path / "tiny_ddp" / "plan.yaml")
    leftover = subprocess.run(["pgrep", "-f", plan_path], capture_output=True, text=True).stdout.split()
    assert leftover == [], f"workers still running: {leftover}"


@pytest.mark.slow
def test_compiled_blocks_give_the_same_losses_and_checkpoints(tmp_path, shakespeare):
    """train.compile=true (per-block torch.compile; inductor's C++ backend on CPU) with full
    recomputation, the combination mfu.py measures on a GPU, against eager; its checkpoint
    resumes an eager run (the checkpoint's keys don't carry the compile wrapper)."""
    import torch._dynamo

    run = ["train.recompute=full", "checkpoint.interval=2"]
    ref = train_inprocess(tmp_path, "train.steps=6", *run, "train.name=eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = train_inprocess(tmp_path, "train.steps=4", *run, "train.compile=true", "train.name=compiled")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert_same_losses(ref[:4], compiled, rtol=1e-5)
    resumed = train_inprocess(tmp_path, "train.steps=6", *run, "train.name=compiled")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]  # appended from step 5: it resumed
    assert_same_losses(ref[4:], resumed[4:], rtol=1e-5)
