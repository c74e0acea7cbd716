"""Checkpoints that survive anything, the parts around the save/resume core: failure records
(usp/engine/observe/failure.py), `usp status`, checkpoint listing, `usp export` and the pre-launch
check of the checkpoint directory. Real files, real exceptions, real processes."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from tests.helpers import REPO, run_usp, usp_cli
from usp.config.compose import compose_config
from usp.engine.observe.failure import LOST_PEER, OOM, PYTHON, TIMEOUT, classify, record_failure
from usp.errors import LaunchError
from usp.launch.checkpoints import check_checkpoint_dir
from usp.plan.io import write_plan
from usp.plan.plan import build_plan
from usp.rundir import list_checkpoints, read_plan

PP2_TP2 = ["cluster.procs_per_node=4", "parallelism.pp=2", "parallelism.tp=2", "model.tie_embeddings=false"]
TINY = ["model.dim=32", "model.n_heads=4", "model.ffn_dim=64", "model.vocab_size=4096", "train.seq_len=16"]


def make_run(tmp_path: Path, *overrides: str, name: str = "run") -> tuple[Path, dict]:
    """A run directory with the real plan.yaml of `overrides`."""
    cfg, choices = compose_config(None, [f"train.runs_dir={tmp_path / 'runs'}", f"train.name={name}", *overrides])
    plan = build_plan(cfg, choices, training=False)
    path = write_plan(plan)
    return path.parent, read_plan(path)


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


GLOO_SCRIPT = textwrap.dedent("""
    import datetime, json, os, sys, time
    import torch, torch.distributed as dist
    from usp.engine.observe.failure import classify
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=1))
    second = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    if rank == 1:  # never joins the first collective, then dies
        time.sleep(1.3)
        os._exit(0)
    out = []
    for group in (None, second):
        try:
            dist.all_reduce(torch.ones(2), group=group)
        except Exception as exc:
            out.append([classify(exc), str(exc)[:300]])
        time.sleep(0.7)
    print(json.dumps(out), flush=True)
    os._exit(0)
""")


@pytest.mark.distributed
def test_classify_real_gloo_errors(tmp_path):
    """A peer that never joins a collective (timeout), then one that has died (lost peer)."""
    script = tmp_path / "gloo_errors.py"
    script.write_text(GLOO_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    peer = subprocess.Popen([sys.executable, str(script), "1", str(port)], env=env)
    try:
        main = subprocess.run([sys.executable, str(script), "0", str(port)], env=env, capture_output=True,
                              text=True, timeout=60)
    finally:
        peer.wait(timeout=30)
    results = json.loads(main.stdout.strip().splitlines()[-1])
    assert [r[0] for r in results] == [TIMEOUT, LOST_PEER], results


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
    assert rec["stages"] == [1]  # plan["pipeline"]["rank_stages"][pp=1]
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
            self.log = None

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

def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _fake_checkpoint(ckpt_dir: Path, step: int, manifest: bool = True) -> Path:
    d = ckpt_dir / f"step_{step:08d}"
    d.mkdir(parents=True)
    files = {".metadata": b"m" * 10, "__0_0.distcp": b"w" * 100,
             "trainer_state.json": json.dumps({"step": step}).encode()}
    for name, data in files.items():
        (d / name).write_bytes(data)
    if manifest:
        (d / "manifest.json").write_text(json.dumps({"files": {k: len(v) for k, v in files.items()}, "step": step}))
    return d


def test_status_completed_run(tmp_path):
    run_dir, _ = make_run(tmp_path)
    _write_jsonl(run_dir / "metrics.jsonl", [{"step": 10, "loss": 5.0}, {"step": 20, "loss": 3.25, "val_loss": 3.5}])
    _write_jsonl(run_dir / "logs" / "events.jsonl", [{"event": "restart", "time": time.time(), "restart": 1,
                                                     "resumed_from_step": 10}])
    _fake_checkpoint(run_dir / "checkpoints", 20)
    (run_dir / "summary.json").write_text(json.dumps({"steps": 20}))
    proc = usp_cli("status", cwd=tmp_path)  # default: the newest directory under ./runs
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "run: run" in out and "completed" in out and "single process" in out
    assert "20 / 150: loss 3.2500, val loss 3.5000" in out
    assert "step_00000020" in out and "complete" in out and "resumed from step 10" in out


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


FAST_TRAIN = ["data.tokenizer=bytes", "model.dim=32", "model.ffn_dim=64", "train.seq_len=32", "train.global_batch=4",
              "train.eval_batches=1", "train.sample_tokens=0", "logging.console=plain", "train.log_interval=1"]


def test_train_that_fails_prints_the_root_cause(tmp_path):
    """A real run (one rank, in-process) whose loss blows up: nan_policy=stop raises, the worker
    records it, and `usp train` ends with the failure summary."""
    proc = run_usp("train", f"train.runs_dir={tmp_path}", "train.name=boom", *FAST_TRAIN, "train.steps=6",
                   "optimizer.lr=1e30", "optimizer.warmup_steps=0", "optimizer.grad_clip=0")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    rec = json.loads((tmp_path / "boom" / "logs" / "failure_rank0.json").read_text())
    assert rec["error_class"] == PYTHON and rec["last_completed_step"] is not None
    assert "root cause" in proc.stderr and "failing rank" in proc.stderr and "usp status" in proc.stderr
    assert "FAILED (Python error)" in (tmp_path / "boom" / "logs" / "rank_0.log").read_text()
    status = usp_cli("status", str(tmp_path / "boom"), cwd=tmp_path)
    assert status.returncode == 1 and rec["exception_type"] in status.stdout


def _pids_with_env(marker: str, rank: int) -> list[int]:
    """Processes started by this test (they inherit `marker` in their environment) with RANK=rank."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if marker.encode() in env and f"RANK={rank}".encode() in env:
            found.append(int(proc.name))
    return found


@pytest.mark.distributed
def test_sigkilled_rank_is_named_by_status(tmp_path):
    """Two ranks under torchrun; rank 1 gets SIGKILL mid-run (what the OOM killer does). Rank 0
    records a lost peer; `usp status` names rank 1 as the one that died without a traceback."""
    marker = f"USP_TEST_MARKER={os.getpid()}-{time.time()}"
    env = dict(os.environ, COLUMNS="200", **dict([marker.split("=", 1)]))
    cmd = [str(Path(sys.executable).parent / "usp"), "train", "conf=tiny_ddp", "train.steps=100000",
           f"train.runs_dir={tmp_path}", *FAST_TRAIN, "logging.console=quiet", "train.eval_interval=0",
           "checkpoint.enabled=false"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "tiny_ddp" / "logs" / "rank_1.log"
    try:
        deadline = time.time() + 90
        while time.time() < deadline and not (log.is_file() and "step 2 " in log.read_text()):
            time.sleep(0.2)
        victims = _pids_with_env(marker, 1)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "rank(s) 1 died without a Python traceback" in err and "likely root cause" in err
    rec = json.loads((tmp_path / "tiny_ddp" / "logs" / "failure_rank0.json").read_text())
    assert rec["error_class"] == LOST_PEER, rec["message"]
    assert not (tmp_path / "tiny_ddp" / "logs" / "failure_rank1.json").exists()
    status = usp_cli("status", str(tmp_path / "tiny_ddp"), cwd=tmp_path)
    assert status.returncode == 1 and "rank 0: lost peer" in status.stdout and "dp_replicate=1" in status.stdout


# -- real checkpoints: list_checkpoints and usp export --------------------------------------------

def _model_for(plan: dict):
    from usp.models.llama import Llama, LlamaArgs

    args = LlamaArgs.from_config(type("M", (), plan["config"]["model"]), int(plan["model"]["vocab_size"]))
    return Llama(args, max_seq_len=int(plan["batch"]["seq_len"]))


def save_checkpoint(ckpt_dir: Path, step: int, model, optimizer, plan_path: Path) -> Path:
    """A checkpoint in the format of usp/engine/checkpoint.py, written in one process."""
    import torch.distributed.checkpoint as dcp

    final = ckpt_dir / f"step_{step:08d}"
    tmp = ckpt_dir / f".tmp-step_{step}"
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=str(tmp))
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
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
    assert result.step == 5 and result.path == run_dir / "export" / "model_step00000005.pt"
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
        export_model(run_dir, fmt="safetensors", out=tmp_path / "m.safetensors")
    with pytest.raises(ExportError, match="step 4"):
        export_model(run_dir, step=4)


def test_export_cli_older_step(tmp_path, trained_run):
    from usp.models.llama import Llama, LlamaArgs

    run_dir, _, tokens, logits = trained_run
    out = tmp_path / "out" / "step3.pt"
    proc = run_usp("export", str(run_dir), "--step", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exported step 3" in proc.stdout and "output.weight = tok_embeddings.weight" in proc.stdout
    config = json.loads((out.parent / "config.json").read_text())
    model = Llama(LlamaArgs(**config["model"]), max_seq_len=config["max_seq_len"])
    model.load_state_dict(torch.load(out, weights_only=True))
    with torch.no_grad():
        assert torch.equal(model(tokens), logits[3])
    assert sorted(p.name for p in out.parent.iterdir()) == ["config.json", "step3.pt"]  # no temp files


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


class _noop:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- pre-launch check of the checkpoint directory ------------------------------------------------

def test_train_refuses_unwritable_checkpoint_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = run_usp("train", f"train.runs_dir={tmp_path / 'runs'}", f"checkpoint.dir={blocker / 'ckpt'}",
                   "logging.console=plain")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "checkpoint.dir" in proc.stderr and str(blocker / "ckpt") in proc.stderr and "fix:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_checkpoint_dir_needs_room_for_keep_last_plus_one(tmp_path):
    cfg, choices = compose_config(None, [f"train.runs_dir={tmp_path}", "train.name=x", "checkpoint.keep_last=2"])
    plan = build_plan(cfg, choices, training=False)
    need = 3 * plan.model.params * 12
    with pytest.raises(LaunchError) as err:
        check_checkpoint_dir(plan, disk_free=lambda path: need - 1)
    msg = str(err.value)
    assert msg.startswith("checkpoint.dir: ") and "keep_last + 1 = 3" in msg
    assert f"{plan.model.params:,} parameters" in msg
    assert f"{need - 1:,} bytes" in msg and f"{need:,} bytes" in msg
    assert "checkpoint.keep_last=1" in msg and "checkpoint.enabled=false" in msg
    assert check_checkpoint_dir(plan, disk_free=lambda path: need) == tmp_path / "x" / "checkpoints"
    plan.config["checkpoint"]["enabled"] = False
    assert check_checkpoint_dir(plan, disk_free=lambda path: 0) is None
