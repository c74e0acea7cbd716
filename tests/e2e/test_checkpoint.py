"""Checkpoints for real: real processes, real signals, real files. A resumed run must
reproduce the uninterrupted run's losses; a checkpoint saved under one layout must continue
under another; a damaged checkpoint is skipped for the previous one; a kill during a save
leaves the previous checkpoint usable."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.engine.test_checkpoint import _no_nan
from tests.helpers import REPO, USP, losses, run_usp, train_in_process, usp_env
from usp.engine.observe.metrics import read_metrics
from usp.run.files import list_checkpoints

QUIET = ["logging.console=plain", "train.sample_tokens=0", "train.log_interval=1", "train.eval_interval=0",
         "train.eval_batches=1", "train.measure_memory=false"]  # neither is checked here; both cost time
UNTIED = ["model.tie_embeddings=false", "model.n_layers=4"]


def train(tmp_path: Path, *overrides: str, expect: int = 0) -> subprocess.CompletedProcess:
    proc = run_usp("train", f"train.runs_dir={tmp_path}", *QUIET, *overrides)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def train_here(tmp_path: Path, *overrides: str) -> str:
    """A one-process run as `usp train` runs it (in its own process, it trains in-process too), here
    in this process: no interpreter and torch start-up (~2 s a run). For the runs whose console
    output and exit code are not what a test is about; returns what the run printed."""
    return train_in_process(f"train.runs_dir={tmp_path}", *QUIET, *overrides)[1]


def assert_same(a: dict, b: dict, steps, rtol: float) -> None:
    for s in steps:
        assert abs(a[s] - b[s]) <= rtol * abs(a[s]), (s, a[s], b[s])


def spawn(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    env = usp_env()
    return subprocess.Popen([USP, "train", f"train.runs_dir={tmp_path}", *QUIET, *overrides], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(r["step"] >= step for r in read_metrics(path)):
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def kill_rank1_and_restart(run_dir: Path, proc: subprocess.Popen, after_step: int) -> dict:
    """SIGKILL rank 1 once `after_step` is logged; the run (train.max_restarts=1) must restart and
    complete. Returns the first restart event of logs/events.jsonl."""
    wait_for_step(run_dir, after_step, proc)
    os.kill(worker_pids(run_dir / "plan.yaml")[1], signal.SIGKILL)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, out[-4000:]
    events = [json.loads(line) for line in (run_dir / "logs" / "events.jsonl").read_text().splitlines()]
    restart = [e for e in events if e["event"] == "restart"]
    assert restart, events
    return restart[0]


def worker_pids(plan_path: Path) -> dict[int, int]:
    """{rank: pid} of the training processes of a run (not torchrun itself)."""
    out = {}
    for pid in subprocess.run(["pgrep", "-f", f"usp.engine.worker --plan {plan_path}"],
                              capture_output=True, text=True).stdout.split():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"torch.distributed.run" in cmdline or b"usp.engine.agent" in cmdline:
            continue  # torchrun itself
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = [e for e in env if e.startswith(b"RANK=")]
        if rank:
            out[int(rank[0].split(b"=")[1])] = int(pid)
    return out


STEPS = 20
DDP_RUN = ["conf=tiny_ddp", f"train.steps={STEPS}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, shakespeare) -> dict[int, float]:
    """The losses of the 2-process run that the interrupted runs below must reproduce
    (checkpoint.interval and max_restarts don't change them)."""
    runs = tmp_path_factory.mktemp("uninterrupted")
    train(runs, *DDP_RUN, "train.name=uninterrupted")
    return losses(runs / "uninterrupted")


@pytest.mark.distributed
def test_resume_after_sigusr1_reproduces_the_uninterrupted_run(tmp_path, uninterrupted):
    """2-process DDP run stopped by SIGUSR1 (what Slurm sends before preemption): it checkpoints,
    exits 75, and the same command resumes; every loss equals an uninterrupted run's."""
    common = [*DDP_RUN, "train.name=preempted"]
    proc = spawn(tmp_path, *common)
    run_dir = tmp_path / "preempted"
    wait_for_step(run_dir, 6, proc)
    pids = worker_pids(run_dir / "plan.yaml")
    assert sorted(pids) == [0, 1], pids
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR1)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out[-3000:]
    stopped_at = max(losses(run_dir))
    assert stopped_at < STEPS and [c[0] for c in list_checkpoints(run_dir / "checkpoints") if c[2]][-1] == stopped_at
    resumed = train(tmp_path, *common)
    assert f"resumed from {run_dir / 'checkpoints'}" in resumed.stdout
    summary = json.loads((run_dir / "summary.json").read_text())  # of the resumed attempt: its own steps only
    assert summary["resumed_from_step"] == stopped_at and summary["steps"] == STEPS
    assert summary["tokens_per_s"] * summary["time_s"] == pytest.approx((STEPS - stopped_at) * 16 * 128)
    events = [json.loads(line) for line in (run_dir / "logs" / "events.jsonl").read_text().splitlines()]
    assert {"event": "stopped", "step": stopped_at, "signal": "SIGUSR1", "checkpoint": True}.items() <= \
        [e for e in events if e["event"] == "stopped"][0].items()
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    assert_same(uninterrupted, losses(run_dir), range(1, STEPS + 1), 1e-6)


@pytest.mark.distributed
def test_kill9_of_a_rank_restarts_and_resumes(tmp_path, uninterrupted):
    """SIGKILL of rank 1 mid-run: torchrun restarts the job (train.max_restarts=1), it resumes
    from the last checkpoint and completes with the uninterrupted run's losses."""
    proc = spawn(tmp_path, *DDP_RUN, "checkpoint.interval=5", "train.max_restarts=1", "train.name=killed")
    run_dir = tmp_path / "killed"
    assert kill_rank1_and_restart(run_dir, proc, after_step=12)["resumed_from_step"] >= 10
    assert "resumed from" in (run_dir / "logs" / "rank_0.log").read_text()
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    assert_same(uninterrupted, losses(run_dir), range(1, STEPS + 1), 1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(900)  # 104 s measured on a loaded 2-core machine (load average ~15)
def test_resharding_across_layouts(tmp_path, shakespeare):
    """Saved under pp=2, continued on one process; saved under FSDP (dp_shard=2), continued
    under TP (tp=2): the continued losses equal the original run's."""
    base = [*UNTIED, "train.steps=6", "checkpoint.interval=3", "train.global_batch=8"]
    train(tmp_path, *base, "cluster.procs_per_node=2", "parallelism.pp=2", "train.name=pp2")
    train_here(tmp_path, *base, "train.name=pp2_to_single",
               f"checkpoint.resume={tmp_path / 'pp2' / 'checkpoints' / 'step_00000003'}")
    assert_same(losses(tmp_path / "pp2"), losses(tmp_path / "pp2_to_single"), range(4, 7), 1e-5)
    train(tmp_path, *base, "cluster.procs_per_node=2", "parallelism.dp_shard=2", "parallelism.dp_replicate=1",
          "train.name=fsdp2")
    proc = train(tmp_path, *base, "cluster.procs_per_node=2", "parallelism.tp=2", "parallelism.dp_replicate=1",
                 "train.name=fsdp2_to_tp2", f"checkpoint.resume={tmp_path / 'fsdp2' / 'checkpoints' / 'step_00000003'}")
    assert "saved under dp_shard=2, now tp=2" in proc.stdout
    assert_same(losses(tmp_path / "fsdp2"), losses(tmp_path / "fsdp2_to_tp2"), range(4, 7), 1e-5)


@pytest.mark.distributed
def test_zero1_saves_its_partitions_and_resumes_under_zero1_and_one_process(tmp_path, shakespeare):
    """Plain-DDP ZeRO-1 (ZeroRedundancyOptimizer) saves each rank's partition of the optimizer states
    (its state_dict() alone raised "not been consolidated" at the run's final save), and the checkpoint
    continues under ZeRO-1 again (a partition without a no-decay parameter: an empty param group,
    pytorch/pytorch#143828) and on one process, with the saved run's losses."""
    base = [*UNTIED, "train.steps=4", "checkpoint.interval=2", "train.global_batch=8"]
    zero1 = ["cluster.procs_per_node=2", "parallelism.dp_replicate=2", "parallelism.zero1=true"]
    train(tmp_path, *base, *zero1, "train.name=z1")
    step2 = tmp_path / "z1" / "checkpoints" / "step_00000002"
    assert [c[0] for c in list_checkpoints(tmp_path / "z1" / "checkpoints") if c[2]] == [2, 4]
    train(tmp_path, *base, *zero1, "train.name=z1_again", f"checkpoint.resume={step2}")
    train_here(tmp_path, *base, "train.name=z1_to_single", f"checkpoint.resume={step2}")
    for name in ("z1_again", "z1_to_single"):
        assert_same(losses(tmp_path / "z1"), losses(tmp_path / name), range(3, 5), 1e-5)


def _halves_to_interleaved(w, n_heads: int):
    """usp's former RoPE row order of q/k (interleaved pairs), from today's (usp/models/rope_layout.py)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).clone()


def _as_written_before_the_rope_change(ckpt: Path, out: Path, n_heads: int, n_kv_heads: int) -> int:
    """A copy of checkpoint `ckpt` as usp wrote it before the RoPE layout change: q/k rows (weights and
    Adam's moments) in the interleaved order, no rope_layout in trainer_state.json. Returns how many
    tensors it permuted."""
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from usp.models.rope_layout import qk_heads
    from usp.run.files import MANIFEST, TRAINER_STATE

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: intended
        state = _load_state_dict_from_keys(checkpoint_id=str(ckpt))
        permuted = 0
        for section in ("model", "optim"):
            for key, t in _flat(state[section]):
                heads = qk_heads(key, n_heads, n_kv_heads)
                if heads is not None and t.dim() == 2:
                    t.copy_(_halves_to_interleaved(t, heads))
                    permuted += 1
        out.mkdir(parents=True)
        dcp.save(state, checkpoint_id=str(out))
    for f in ckpt.iterdir():
        if not (out / f.name).exists():
            shutil.copyfile(f, out / f.name)  # plan.yaml, rng_rank*.pt, trainer_state.json, manifest.json
    trainer = json.loads((out / TRAINER_STATE).read_text())
    del trainer["rope_layout"]
    (out / TRAINER_STATE).write_text(json.dumps(trainer))
    files = {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.name != MANIFEST}
    (out / MANIFEST).write_text(json.dumps({"step": trainer["step"], "files": files}))
    return permuted


def _flat(node, prefix: str = ""):
    """(dotted key, tensor) of a nested state dict."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        elif hasattr(value, "dim"):
            yield f"{prefix}{key}", value


@pytest.mark.distributed
def test_a_checkpoint_from_before_the_rope_layout_change_resumes_and_exports(tmp_path, shakespeare):
    """A checkpoint written by usp before it switched RoPE to the rotate-half layout (made here from
    a new one, written by one process: q/k rows and their Adam moments permuted back, no rope_layout
    record) resumes under FSDP2 (dp_shard=2, whose shards of wk cut through its one head) with the
    losses of the run that wrote the original, and exports the original's tensors."""
    # init_std 0.3: attention far from uniform, so q/k rows left unconverted change step 3's loss by ~1 %
    base = ["model.n_kv_heads=1", "model.init_std=0.3", "train.steps=4", "checkpoint.interval=2",
            "train.global_batch=8"]
    fsdp2 = ["cluster.procs_per_node=2", "parallelism.dp_shard=2", "parallelism.dp_replicate=1"]
    train_here(tmp_path, *base, "train.name=new")  # the copy is one process's DCP checkpoint whatever wrote it
    original = tmp_path / "new" / "checkpoints" / "step_00000002"
    legacy = tmp_path / "legacy" / "step_00000002"
    assert _as_written_before_the_rope_change(original, legacy, n_heads=4, n_kv_heads=1) == 12  # 2 layers x wq, wk
    proc = train(tmp_path, *base, *fsdp2, "train.name=from_legacy", f"checkpoint.resume={legacy}")
    assert "predates usp's RoPE layout change: 12 q/k tensors" in proc.stdout  # x (weight, exp_avg, exp_avg_sq)
    assert_same(losses(tmp_path / "new"), losses(tmp_path / "from_legacy"), range(3, 5), 1e-5)
    assert json.loads((tmp_path / "from_legacy" / "checkpoints" / "step_00000004" / "trainer_state.json")
                      .read_text())["rope_layout"] == "rotate_half"  # what it writes is today's layout

    from usp.engine.export import export_model, load_model_state

    exported = {}
    for name, ckpt in (("original", original), ("legacy", legacy)):
        export_model(ckpt, fmt="torch", out=tmp_path / f"export_{name}")
        exported[name] = torch.load(tmp_path / f"export_{name}" / "model.pt", weights_only=True)
    wk = "layers.0.attention.wk.weight"
    assert not torch.equal(load_model_state(legacy)[wk], load_model_state(original)[wk])  # the copy differs
    assert exported["legacy"].keys() == exported["original"].keys()
    assert all(torch.equal(exported["legacy"][k], v) for k, v in exported["original"].items())


@pytest.mark.distributed
@pytest.mark.timeout(900)  # 173 s measured on a loaded 2-core machine (load average ~15)
def test_tied_embeddings_under_pp_stored_once_and_resharded(tmp_path, shakespeare):
    """Tied embeddings under pp=2 (first stage: the embedding, last: its copy): the checkpoint
    holds the weight once, under tok_embeddings.weight; it continues on one process, and a
    one-process checkpoint continues under pp=2, with the uninterrupted run's losses; the export
    keeps the tie."""
    import torch.distributed.checkpoint as dcp

    from usp.engine.export import export_model

    base = ["model.tie_embeddings=true", "model.n_layers=4", "train.steps=6", "checkpoint.interval=3",
            "train.global_batch=8"]
    pp2 = ["cluster.procs_per_node=2", "parallelism.pp=2", "parallelism.dp_replicate=1"]
    train(tmp_path, *base, *pp2, "train.name=tied_pp2")
    ckpt = tmp_path / "tied_pp2" / "checkpoints" / "step_00000003"
    keys = set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    assert "model.tok_embeddings.weight" in keys and not any("output.weight" in k for k in keys), sorted(keys)
    assert "optim.state.tok_embeddings.weight.exp_avg" in keys
    train_here(tmp_path, *base, "train.name=tied_pp2_to_single", f"checkpoint.resume={ckpt}")
    assert_same(losses(tmp_path / "tied_pp2"), losses(tmp_path / "tied_pp2_to_single"), range(4, 7), 1e-5)
    train_here(tmp_path, *base, "train.name=tied_single")
    proc = train(tmp_path, *base, *pp2, "train.name=tied_single_to_pp2",
                 f"checkpoint.resume={tmp_path / 'tied_single' / 'checkpoints' / 'step_00000003'}")
    assert "saved under single process, now pp=2" in proc.stdout
    assert_same(losses(tmp_path / "tied_single"), losses(tmp_path / "tied_single_to_pp2"), range(4, 7), 1e-5)
    assert_same(losses(tmp_path / "tied_single"), losses(tmp_path / "tied_pp2"), range(1, 7), 1e-5)
    assert export_model(tmp_path / "tied_pp2").tied == {"output.weight": "tok_embeddings.weight"}


DAMAGED_RUN = ["checkpoint.interval=3", "checkpoint.keep_last=4", "train.name=run"]


@pytest.fixture(scope="module")
def twelve_steps(tmp_path_factory, shakespeare) -> Path:
    """A run of 12 steps with checkpoints at steps 3, 6, 9 and 12, trained once and copied by each test."""
    runs = tmp_path_factory.mktemp("twelve_steps")
    train_here(runs, "train.steps=12", *DAMAGED_RUN)
    return runs


def _damage(checkpoint: Path, how: str) -> None:
    if how == "truncate":
        shard = next(checkpoint.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif how == "no_metadata":
        (checkpoint / ".metadata").unlink()
    else:  # same size, other bytes, in a checkpoint an earlier usp saved (no checksums): DCP's load fails
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        (checkpoint / "manifest.json").write_text(json.dumps({"step": manifest["step"], "files": manifest["files"]}))
        meta = (checkpoint / ".metadata").read_bytes()
        (checkpoint / ".metadata").write_bytes(bytes(b ^ 0xFF for b in meta))


@pytest.mark.slow
def test_damaged_checkpoints_fall_back_to_the_newest_intact_one(tmp_path, twelve_steps):
    """The three newest checkpoints damaged three ways (one launch resumes past all of them, a failed
    load of one saved without checksums among them): each is named and skipped, and the run resumes from
    the intact step 3 with the first run's losses."""
    shutil.copytree(twelve_steps, tmp_path, dirs_exist_ok=True)
    first = losses(tmp_path / "run")
    damage = {12: "corrupt_metadata", 9: "truncate", 6: "no_metadata"}
    for step, how in damage.items():
        _damage(tmp_path / "run" / "checkpoints" / f"step_{step:08d}", how)
    proc = train(tmp_path, "train.steps=13", *DAMAGED_RUN)  # one more step: not "already at step 12"
    for step, how in damage.items():
        said = "is corrupt (" if how == "corrupt_metadata" else "is incomplete"
        assert f"step_{step:08d} {said}" in proc.stdout, (how, proc.stdout[-3000:])
    assert "step_00000012 has no checksums (saved by an earlier usp): loading it unverified" in proc.stdout
    assert "resumed from" in proc.stdout and "(step 3," in proc.stdout
    assert_same(first, losses(tmp_path / "run"), range(1, 13), 1e-6)


SAVED_EACH_STEP = ["checkpoint.interval=1", "checkpoint.keep_last=4", "train.name=run"]


@pytest.fixture(scope="module")
def eight_steps(tmp_path_factory, shakespeare) -> Path:
    """A 2-rank DDP run of 8 steps with checkpoints of steps 5 to 8 (each rank writes its own shard)."""
    runs = tmp_path_factory.mktemp("eight_steps")
    train(runs, "conf=tiny_ddp", "train.steps=8", *SAVED_EACH_STEP)
    return runs


def _stopped_at_step_6_with_it_damaged(tmp_path: Path, eight_steps: Path, rank: int) -> Path:
    """The 8-step run as if it had stopped at step 6 (checkpoints 5 and 6), then 4 KiB of random bytes
    written into the middle of rank `rank`'s shard of step 6: same size, other bytes."""
    shutil.copytree(eight_steps, tmp_path, dirs_exist_ok=True)
    ckpts = tmp_path / "run" / "checkpoints"
    for step in (7, 8):
        shutil.rmtree(ckpts / f"step_{step:08d}")
    shard = ckpts / "step_00000006" / f"__{rank}_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(size // 2)
        f.write(os.urandom(4096))
    assert shard.stat().st_size == size
    return ckpts


@pytest.mark.distributed
@pytest.mark.parametrize("rank", [0, 1])
def test_a_damaged_shard_is_found_and_the_run_goes_on_from_the_newest_good_one(tmp_path, eight_steps, rank):
    """Either rank's shard of the newest checkpoint damaged (same size): the resume names the file,
    continues from step 5 and reproduces the run's own steps 6-8; nothing good was deleted."""
    ckpts = _stopped_at_step_6_with_it_damaged(tmp_path, eight_steps, rank)
    checked = run_usp("checkpoints", "verify", str(tmp_path / "run"))
    assert checked.returncode == 1 and f"__{rank}_0.distcp does not match its checksum" in " ".join(
        checked.stdout.split()), checked.stdout
    proc = train(tmp_path, "conf=tiny_ddp", "train.steps=8", *SAVED_EACH_STEP)
    assert f"step_00000006 is damaged (__{rank}_0.distcp does not match its checksum" in proc.stdout, proc.stdout
    assert "resumed from" in proc.stdout and "(step 5," in proc.stdout
    assert_same(losses(eight_steps / "run"), losses(tmp_path / "run"), range(1, 9), 1e-6)
    assert [c.step for c in list_checkpoints(ckpts) if c.complete] == [5, 6, 7, 8]
    assert run_usp("checkpoints", "verify", str(tmp_path / "run")).returncode == 0


@pytest.mark.distributed
def test_a_nan_stop_right_after_a_damaged_checkpoint_deletes_nothing(tmp_path, eight_steps):
    """The damaged step 6 skipped for step 5, then the learning rate blows the loss up: the stop saves
    the last finite step, deletes no checkpoint (keep_last=1 would have removed step 5, the last one
    saved from good weights), and says to check the checkpoint it resumed from first."""
    ckpts = _stopped_at_step_6_with_it_damaged(tmp_path, eight_steps, rank=1)
    proc = train(tmp_path, "conf=tiny_ddp", "train.steps=8", "checkpoint.interval=4", "checkpoint.keep_last=1",
                 "train.name=run", "optimizer.lr=1e6", "optimizer.grad_clip=0", expect=1)
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "step_00000006 is damaged" in text and "(step 5," in text, text[-3000:]
    assert "non-finite" in text and "no checkpoint was deleted" in text, text[-3000:]
    assert "first check the checkpoint this run resumed from (step_00000005" in text, text[-3000:]
    stop = int(text.split("stopped with a checkpoint of step ")[1].split()[0])
    kept = [c.step for c in list_checkpoints(ckpts) if c.complete]
    assert stop > 5 and kept[0] == 5 and kept[-1] == stop, (kept, stop)
    assert run_usp("checkpoints", "verify", str(tmp_path / "run"), "--step", "5").returncode == 0


@pytest.mark.slow
def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path, shakespeare):
    """SIGKILL while step 2 is being written (a model large enough to make saving take a while):
    step 1 stays complete, the half-written one is ignored, and the same command resumes from step 1."""
    # 12 M parameters: 141 MB a checkpoint (weights, AdamW's moments), 0.2-0.4 s to save; batches of 2
    # sequences keep its steps short (0.4 s, not 2.7 s at the default 16; measured)
    big = ["model.dim=384", "model.n_layers=6", "model.ffn_dim=1024", "train.global_batch=2", "train.micro_batch=2",
           "train.steps=2", "checkpoint.interval=1", "train.name=big"]
    proc = spawn(tmp_path, *big)
    tmp = tmp_path / "big" / "checkpoints" / ".tmp-step_00000002"
    deadline = time.time() + 240
    while not tmp.exists():
        assert proc.poll() is None and time.time() < deadline, "the save of step 2 was not seen"
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    found = list_checkpoints(tmp_path / "big" / "checkpoints")
    assert [(step, complete) for step, _, complete, _ in found if complete] == [(1, True)]
    assert not (tmp_path / "big" / "checkpoints" / "step_00000002").exists()
    resumed = train(tmp_path, *big)
    assert "resumed from" in resumed.stdout and "(step 1," in resumed.stdout


@pytest.mark.slow
def test_async_save_and_retention(tmp_path, shakespeare):
    train_here(tmp_path, "train.steps=8", "checkpoint.interval=2", "checkpoint.keep_last=2",
               "checkpoint.async_mode=async", "train.name=async")
    complete = [step for step, _, ok, _ in list_checkpoints(tmp_path / "async" / "checkpoints") if ok]
    assert complete == [6, 8]
    manifest = json.loads((tmp_path / "async" / "checkpoints" / "step_00000008" / "manifest.json").read_text())
    assert manifest["step"] == 8 and ".metadata" in manifest["files"] and "trainer_state.json" in manifest["files"]
    # step 6 was published after step 8's update: it still holds step 6's learning-rate schedule
    state = json.loads((tmp_path / "async" / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["scheduler"]["last_epoch"] == 6, state["scheduler"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_loss(tmp_path, shakespeare, policy):
    """An exploding learning rate drives the loss to inf/NaN: stop checkpoints the last good
    step and fails naming the step; skip drops the bad steps and finishes."""
    proc = run_usp("train", f"train.runs_dir={tmp_path}", *QUIET, "optimizer.lr=1e6", "optimizer.warmup_steps=1",
                   "optimizer.grad_clip=0", "train.steps=12", f"train.nan_policy={policy}", "train.name=nan")
    text = proc.stdout + proc.stderr
    assert "non-finite loss" in text or "non-finite gradient norm" in text
    if policy == "stop":
        assert proc.returncode != 0 and "stopped with a checkpoint of step" in text
        complete = [step for step, _, ok, _ in list_checkpoints(tmp_path / "nan" / "checkpoints") if ok]
        assert complete and f"at step {complete[-1] + 1}" in text
    else:
        assert proc.returncode == 0 and "step skipped" in text
        summary = json.loads((tmp_path / "nan" / "summary.json").read_text(), parse_constant=_no_nan)
        assert summary["final_loss"] is None or math.isfinite(summary["final_loss"])


@pytest.mark.slow
def test_a_resume_trains_at_the_planned_learning_rate(tmp_path, shakespeare):
    """The fix a non-finite loss names is a lower optimizer.lr and the same command: the resumed steps
    run at the new rate, on the same schedule (the checkpoint's param groups and schedule carried the old
    one: a resume with optimizer.lr=1e-5 trained on at 3e-3 before)."""
    train_here(tmp_path, "train.steps=4", "train.name=lr")
    said = train_here(tmp_path, "train.steps=6", "train.name=lr", "optimizer.lr=1e-5")
    assert "optimizer.lr is now 1e-05 (the checkpoint was saved at 0.003)" in said
    records = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "lr" / "metrics.jsonl")}
    from usp.config.compose import compose_config
    from usp.contract.schedule import OptimSettings, lr_factor

    cfg, _ = compose_config(None, ["train.steps=6", "optimizer.lr=1e-5"])
    settings = OptimSettings.from_config(cfg.optimizer, 6)
    # a record's lr is the scheduler's after its step: the next step's
    assert [records[s] for s in (5, 6)] == pytest.approx([1e-5 * lr_factor(s, settings) for s in (5, 6)])


@pytest.mark.slow
def test_a_run_directory_of_the_previous_plan_format_resumes(tmp_path, shakespeare):
    """A run stopped at step 2 whose plan.yaml and checkpoint plan are version 1 (tests/golden/plan_v1.yaml,
    as usp wrote them before version 2, its paths moved here): a rank started on it directly (a Slurm job
    requeued after an upgrade) resumes and reproduces the uninterrupted run's losses."""
    import yaml

    from usp.contract.plan_file import read_plan

    train_here(tmp_path, "train.steps=4", "checkpoint.interval=2", "train.name=v1run")
    run = tmp_path / "v1run"
    whole = losses(run)
    shutil.rmtree(run / "checkpoints" / "step_00000004")  # as if it had stopped after step 2
    now = read_plan(run / "plan.yaml")
    old = yaml.safe_load((REPO / "tests" / "golden" / "plan_v1.yaml").read_text())
    old.update(run_dir=now.run_dir, dataset_dir=now.dataset_dir, data_meta=now.data_meta)
    old["config"]["train"]["runs_dir"] = now.config.train.runs_dir
    assert old["version"] == 1 and old["config"]["data"] == now.to_dict()["config"]["data"]
    step = run / "checkpoints" / "step_00000002"
    for where in (run, step):
        (where / "plan.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    sizes = {p.name: p.stat().st_size for p in step.iterdir() if p.name != "manifest.json"}  # no checksums then
    (step / "manifest.json").write_text(json.dumps({"step": 2, "files": sizes}))
    proc = subprocess.run([sys.executable, "-m", "usp.engine.worker", "--plan", str(run / "plan.yaml")],
                          env=usp_env(), capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "step_00000002 has no checksums (saved by an earlier usp): loading it unverified" in proc.stdout
    assert "resumed from" in proc.stdout and "(step 2," in proc.stdout, proc.stdout[-2000:]
    resumed = sorted(step for step in losses(run) if step > 2)  # the golden plan logs every 10th step and the last
    assert resumed[-1] == 4
    assert_same(whole, losses(run), resumed, 1e-6)
