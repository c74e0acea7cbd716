"""Training on the real corpus in this process: layouts that must be exactly equivalent (gradient
accumulation vs one big micro batch, recompute on/off, compiled blocks vs eager) give the same
losses step by step; token files train. DDP against one process: tests/e2e/test_training.py."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tests.helpers import assert_same_losses, train_in_process
from usp.engine.observe.metrics import read_metrics

QUIET = ["logging.console=quiet", "train.sample_tokens=0", "train.log_interval=1", "train.eval_interval=0"]


def train_inprocess(runs: Path, *overrides: str) -> list[dict]:
    """One rank trained in this process, quietly: its metrics.jsonl records."""
    run_dir, _ = train_in_process(f"train.runs_dir={runs}", *QUIET, *overrides)
    return read_metrics(run_dir / "metrics.jsonl")


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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = train_inprocess(tmp_path, "train.steps=4", *run, "train.compile=true", "train.name=compiled")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    # the memory probe's module hooks under compiled blocks: no raw torch warning reaches the user
    assert not [w for w in caught if "global hooks" in str(w.message)], [str(w.message) for w in caught]
    assert_same_losses(ref[:4], compiled, rtol=1e-5)
    resumed = train_inprocess(tmp_path, "train.steps=6", *run, "train.name=compiled")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]  # appended from step 5: it resumed
    assert_same_losses(ref[4:], resumed[4:], rtol=1e-5)
