"""Failure records and checkpoints in this process: exceptions classified (OOM, timeout, lost peer,
Python), the failure record and log line a rank writes, the worker re-raising, `usp status` naming
the root cause of a failed run, checkpoint listing and `usp export` of real checkpoints (real runs:
tests/e2e/test_failures.py)."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from tests.helpers import usp_cli
from tests.unit.test_failures import _fake_checkpoint, _write_jsonl, make_run
from usp.engine.observe.failure import LOST_PEER, OOM, PYTHON, TIMEOUT, classify, record_failure
from usp.run.files import list_checkpoints

PP2_TP2 = ["cluster.procs_per_node=4", "parallelism.pp=2", "parallelism.tp=2", "model.tie_embeddings=false"]
TINY = ["model.dim=32", "model.n_heads=4", "model.ffn_dim=64", "model.vocab_size=4096", "train.seq_len=16"]


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - a real traceback for the record
        return caught


# -- classify ----------------------------------------------------------------------------------

def test_classify_exception_objects():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")
    assert classify(oom) == OOM
    assert classify(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                 "1099511627776 bytes. Error code 12 (Cannot allocate memory)")) == PYTHON
    assert classify(MemoryError()) == OOM
    gloo = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/{}"
    assert classify(RuntimeError(gloo.format("unbound_buffer.cc:78] Timed out waiting 1000ms for recv "
                                             "operation to complete"))) == TIMEOUT
    assert classify(RuntimeError(gloo.format("pair.cc:537] Read error [127.0.0.1]:53911: Connection reset by "
                                             "peer. This is typically caused by a remote worker hanging"))) == LOST_PEER
    assert classify(RuntimeError("Application timeout caused pair closure")) == LOST_PEER
    nccl = torch.distributed.DistBackendError("[Rank 3] Watchdog caught collective operation timeout: "
                                              "WorkNCCL(SeqNum=12, OpType=ALLREDUCE) ran for 600016 milliseconds")
    assert classify(nccl) == TIMEOUT
    assert classify(torch.distributed.DistNetworkError("failed to recv, got 0 bytes")) == LOST_PEER
    assert classify(ValueError("timeout must be positive")) == PYTHON  # not a collective
    assert classify(KeyError("layers.0")) == PYTHON
    try:  # the cause counts: an OOM re-raised as something else is still an OOM
        try:
            raise oom
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("pipeline stage 1 failed") from inner
    except RuntimeError as outer:
        assert classify(outer) == OOM


# -- failure records -----------------------------------------------------------------------------

def test_record_failure_file_and_log_line(tmp_path, monkeypatch):
    run_dir, plan = make_run(tmp_path, *PP2_TP2)
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "rank_3.log").write_text("2025-01-01 rank3 step 7 loss 4.1\n")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    exc = raised(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB " + "x" * 3000))
    path = record_failure(run_dir, plan, 3, exc, 7)
    assert path == run_dir / "logs" / "failure_rank3.json"
    rec = json.loads(path.read_text())
    assert (rec["rank"], rec["node"], rec["local_rank"]) == (3, 0, 3)
    assert rec["coords"] == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert rec["stages"] == [1]  # plan.pipeline.rank_stages[pp=1]
    assert rec["error_class"] == OOM and rec["exception_type"] == "torch.OutOfMemoryError"
    assert rec["message"].startswith("CUDA out of memory") and len(rec["message"]) == 2000
    assert "raise exc" in rec["traceback"] and rec["last_completed_step"] == 7
    assert rec["restart_count"] == 1 and abs(rec["unix_time"] - time.time()) < 60 and "T" in rec["time"]
    log = (run_dir / "logs" / "rank_3.log").read_text().splitlines()
    assert log[0].endswith("loss 4.1") and "rank3 FAILED (OOM)" in log[-1] and "last completed step: 7" in log[-1]
    assert not list((run_dir / "logs").glob(".failure*"))  # atomic write left no temp file


def test_worker_records_failure_and_reraises(tmp_path, monkeypatch):
    """The real run_worker: the trainer fails after step 7, the record says so, the error propagates."""
    from usp.engine import worker

    run_dir, _ = make_run(tmp_path)

    class FailingTrainer:
        def __init__(self, plan, ctx):
            self.run_dir, self.start_step, self.last_completed_step = run_dir, 0, 7
            self.log, self.startup = None, {}  # the worker adds its start-up phases to the trainer's

        def fit(self):
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4242")

    monkeypatch.setattr(worker, "Trainer", FailingTrainer)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        with pytest.raises(RuntimeError, match="Connection closed"):
            worker.run_worker(str(run_dir / "plan.yaml"))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    rec = json.loads((run_dir / "logs" / "failure_rank0.json").read_text())
    assert rec["error_class"] == LOST_PEER and rec["last_completed_step"] == 7 and rec["rank"] == 0
    assert "FAILED (lost peer)" in (run_dir / "logs" / "rank_0.log").read_text()


# -- usp status ---------------------------------------------------------------------------------


def _failed_run(tmp_path: Path) -> Path:
    """World 4 (pp=2 x tp=2): rank 3 runs out of memory after step 7, rank 1 loses it as a peer,
    ranks 0 and 2 are killed without a traceback."""
    run_dir, plan = make_run(tmp_path, *PP2_TP2, name="pp2tp2")
    _write_jsonl(run_dir / "metrics.jsonl", [{"step": 5, "loss": 4.5}])
    _fake_checkpoint(run_dir / "checkpoints", 5)
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "rank_0.log").write_text("t rank0 start\nt rank0 step 7 loss 4.4\n")
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
    record_failure(run_dir, plan, 3, raised(oom), 7)
    time.sleep(0.01)
    record_failure(run_dir, plan, 1, raised(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:555")), 7)
    return run_dir


def test_status_failed_run_names_the_root_cause(tmp_path):
    run_dir = _failed_run(tmp_path)
    proc = usp_cli("status", str(run_dir), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "failed" in out and "root cause" in out
    root = out[out.index("root cause"):]
    assert "failing rank" in root and "│ 3" in root.split("node")[0]
    assert "pp=1 tp=1" in root and "pipeline stage      │ 1" in root
    assert "OOM" in root and "CUDA out of memory" in root and "last completed step │ 7" in root
    assert "rank 1: lost peer" in out
    assert "rank(s) 0, 2 died without a Python traceback" in out and "SIGKILL" in out
    assert "step 7 loss 4.4" in out  # the silent rank's last log line


def test_train_failure_summary_and_stale_records(tmp_path):
    run_dir = _failed_run(tmp_path)
    from usp.launch.status import print_failure_summary

    buf = io.StringIO()
    assert print_failure_summary(run_dir, Console(file=buf, width=200))
    assert "failing rank" in buf.getvalue() and "OOM" in buf.getvalue()
    # A new launch (plan.yaml rewritten) makes the old records history: not failed any more.
    time.sleep(0.01)
    os.utime(run_dir / "plan.yaml", (time.time() + 5, time.time() + 5))
    assert not print_failure_summary(run_dir, Console(file=io.StringIO()))
    proc = usp_cli("status", str(run_dir), cwd=tmp_path)
    assert proc.returncode == 0 and "stopped" in proc.stdout and "earlier failures" in proc.stdout


# -- real checkpoints: list_checkpoints and usp export --------------------------------------------

def _model_for(plan: dict):
    from usp.models.llama import Llama, LlamaArgs

    args = LlamaArgs.from_config(plan.config.model, int(plan.model.vocab_size))
    return Llama(args, max_seq_len=int(plan.batch.seq_len))


def save_checkpoint(ckpt_dir: Path, step: int, model, optimizer, plan_path: Path) -> Path:
    """A checkpoint in the format of usp/engine/checkpoint.py, written in one process (in today's RoPE
    layout: trainer_state.json says so, as the engine's does, or the export would convert its q/k rows)."""
    import torch.distributed.checkpoint as dcp

    from usp.engine.rope_upgrade import LAYOUT_KEY
    from usp.models.rope_layout import ROPE_LAYOUT

    final = ckpt_dir / f"step_{step:08d}"
    tmp = ckpt_dir / f".tmp-step_{step}"
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=str(tmp))
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, LAYOUT_KEY: ROPE_LAYOUT}))
    shutil.copy(plan_path, tmp / "plan.yaml")
    files = {p.name: p.stat().st_size for p in tmp.iterdir()}
    (tmp / "manifest.json").write_text(json.dumps({"files": files, "step": step}))
    tmp.rename(final)
    return final


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny Llama (tied embeddings), trained a little, with real DCP checkpoints at steps 3 and 5."""
    tmp = tmp_path_factory.mktemp("export")
    run_dir, plan = make_run(tmp, *TINY, name="tiny")
    torch.manual_seed(0)
    model = _model_for(plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 96, (2, 16))
    logits = {}
    for step in range(1, 6):
        model(tokens).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        if step in (3, 5):
            save_checkpoint(run_dir / "checkpoints", step, model, opt, run_dir / "plan.yaml")
            with torch.no_grad():
                logits[step] = model(tokens)
    return run_dir, plan, tokens, logits


def test_list_checkpoints_flags_incomplete(tmp_path, trained_run):
    run_dir = trained_run[0]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run_dir / "checkpoints", ckpt)
    good = ckpt / "step_00000005"
    truncated = shutil.copytree(good, ckpt / "step_00000007")
    (truncated / "manifest.json").write_text((good / "manifest.json").read_text().replace('"step": 5', '"step": 7'))
    data = truncated / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    unfinished = shutil.copytree(good, ckpt / "step_00000009")
    (unfinished / "manifest.json").unlink()
    shutil.copytree(good, ckpt / ".tmp-step_11")
    found = {(c.step, c.path.name): c for c in list_checkpoints(ckpt)}
    assert [k[0] for k in found] == [3, 5, 7, 9, 11]
    assert found[(3, "step_00000003")].complete and found[(5, "step_00000005")].problem is None
    bad = found[(7, "step_00000007")]
    assert not bad.complete and "__0_0.distcp" in bad.problem and "truncated" in bad.problem
    assert not found[(9, "step_00000009")].complete and "no manifest.json" in found[(9, "step_00000009")].problem
    assert not found[(11, ".tmp-step_11")].complete
    assert list_checkpoints(tmp_path / "nothing") == []
    proc = usp_cli("status", str(run_dir), cwd=tmp_path)  # the real checkpoints are listed as complete
    assert proc.returncode == 0 and "step_00000003" in proc.stdout and "resume / export from step 5" in proc.stdout


def test_export_newest_checkpoint_loads_into_a_fresh_model(tmp_path, trained_run):
    from usp.engine.export import ExportError, export_model
    from usp.models.llama import Llama, LlamaArgs

    run_dir, plan, tokens, logits = trained_run
    result = export_model(run_dir)
    assert result.step == 5 and result.path == run_dir / "export" / "torch_step00000005" / "model.pt"
    assert result.config_path == result.path.parent / "config.json"  # in the directory the export owns
    config = json.loads(result.config_path.read_text())
    assert config["model"]["vocab_size"] == 4096 and config["model"]["dim"] == 32 and config["step"] == 5
    assert config["tied_weights"] == {"output.weight": "tok_embeddings.weight"}
    state = torch.load(result.path, weights_only=True)
    assert "output.weight" in state and not any("optim" in k for k in state)
    storage = state["tok_embeddings.weight"].untyped_storage().data_ptr()
    assert state["output.weight"].untyped_storage().data_ptr() == storage
    model = Llama(LlamaArgs(**config["model"]), max_seq_len=config["max_seq_len"])  # no usp config needed
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert torch.equal(model(tokens), logits[5])
    assert config["n_params"] == sum(p.numel() for p in model.parameters())

    with pytest.raises(ExportError, match="pip install safetensors") if not _has("safetensors") else _noop():
        export_model(run_dir, fmt="safetensors", out=tmp_path / "m")
    with pytest.raises(ExportError, match="step 4"):
        export_model(run_dir, step=4)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


class _noop:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- pre-launch check of the checkpoint directory ------------------------------------------------


def test_export_cli_older_step(tmp_path, trained_run):
    from usp.models.llama import Llama, LlamaArgs

    run_dir, _, tokens, logits = trained_run
    out = tmp_path / "out" / "step3"
    proc = usp_cli("export", str(run_dir), "--step", "3", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exported step 3" in proc.stdout and "output.weight = tok_embeddings.weight" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    model = Llama(LlamaArgs(**config["model"]), max_seq_len=config["max_seq_len"])
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    with torch.no_grad():
        assert torch.equal(model(tokens), logits[3])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.pt"]
    assert [p.name for p in out.parent.iterdir()] == ["step3"]  # no temp left beside it
