"""A checkpoint that fails to load is classified (mismatch, corrupt, missing); resuming with another
model shape: tests/e2e/test_resume_guard.py."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

FAST = ["data.tokenizer=bytes", "model.dim=32", "model.ffn_dim=64", "train.seq_len=32", "train.global_batch=4",
        "train.eval_batches=1", "train.sample_tokens=0", "logging.console=plain", "train.log_interval=1",
        "train.eval_interval=0"]


def _snapshot(run_dir: Path) -> dict[str, tuple[bytes, float]]:
    return {str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_load_errors_are_classified(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from usp.engine.checkpoint import CORRUPT, MISMATCH, MISSING, classify_load_error

    logging.disable(logging.CRITICAL)  # DCP logs each failed metadata read with a traceback
    try:
        dcp.save({"model": torch.nn.Linear(8, 4).state_dict()}, checkpoint_id=str(tmp_path))

        def failure(state: dict) -> BaseException:
            with pytest.raises(BaseException) as err:  # DCP's CheckpointException is not an Exception
                dcp.load({"model": state}, checkpoint_id=str(tmp_path))
            return err.value

        assert classify_load_error(failure(torch.nn.Linear(8, 5).state_dict()))[0] == MISMATCH  # shape
        kind, detail = classify_load_error(failure(torch.nn.Sequential(torch.nn.Linear(8, 4)).state_dict()))
        assert kind == MISMATCH and "Missing key" in detail  # architecture
        meta = (tmp_path / ".metadata").read_bytes()
        (tmp_path / ".metadata").write_bytes(bytes(b ^ 0xFF for b in meta))
        kind, detail = classify_load_error(failure(torch.nn.Linear(8, 4).state_dict()))
        assert kind == CORRUPT and "invalid load key" in detail
        (tmp_path / ".metadata").write_bytes(meta)
        next(tmp_path.glob("*.distcp")).unlink()
        assert classify_load_error(failure(torch.nn.Linear(8, 4).state_dict()))[0] == MISSING
    finally:
        logging.disable(logging.NOTSET)
