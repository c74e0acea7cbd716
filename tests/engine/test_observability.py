"""Watching a run, for real, in this process: the plain console line, metrics.jsonl's performance
fields, W&B offline runs (read back from the .wandb file), TensorBoard event files (read back with
TensorBoard's own reader), the profiler's traces and summaries. Nothing touches the network: W&B
runs offline, or "online" against a closed local port to exercise the fallback."""
from __future__ import annotations

import glob
import io
import json
import re
import struct
from pathlib import Path

import pytest

from tests.helpers import train_in_process
from usp.contract.plan_file import read_plan
from usp.engine.observe.metrics import read_metrics

FAST = ["train.global_batch=4", "train.seq_len=64", "train.sample_tokens=0", "train.log_interval=1",
        "train.eval_interval=0", "train.eval_batches=1", "logging.console=plain"]


@pytest.fixture(scope="module")
def offline_wandb(tmp_path_factory):
    """W&B silent and offline, its config and cache in a temporary directory."""
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_CONFIG_DIR": home / "config",
                           "WANDB_CACHE_DIR": home / "cache", "WANDB_DATA_DIR": home / "data"}.items():
            mp.setenv(key, str(value))
        mp.delenv("WANDB_API_KEY", raising=False)
        yield mp


def train(runs: Path, *overrides: str) -> tuple[Path, str]:
    """One rank trained in this process: the run dir and what it printed."""
    return train_in_process(f"train.runs_dir={runs}", *FAST, *overrides)


@pytest.fixture(scope="module")
def observed(tmp_path_factory, shakespeare, offline_wandb):
    """One 4-step run with every backend and the profiler (steps 2-3) on, as a requeued Slurm job."""
    offline_wandb.setenv("SLURM_RESTART_COUNT", "2")
    run_dir, printed = train(tmp_path_factory.mktemp("runs"), "train.steps=4", "logging.wandb=true",
                             "logging.tensorboard=true", "logging.wandb_tags=[ci,tiny]", "profile.enabled=true",
                             "profile.steps=[2,3]", "checkpoint.enabled=false")
    offline_wandb.delenv("SLURM_RESTART_COUNT")
    return run_dir, printed, read_metrics(run_dir / "metrics.jsonl")


def test_records_carry_mfu_data_wait_and_restart_count(observed):
    run_dir, _, metrics = observed
    plan = read_plan(run_dir / "plan.yaml")
    peak, flops = plan.timing.peak_tflops * 1e12, plan.timing.model_flops_per_step
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    for r in metrics:
        assert r["mfu"] == pytest.approx(flops / (r["step_time_s"] * plan.world_size * peak), rel=1e-9)
        assert 0 < r["data_wait_s"] < r["step_time_s"]
        assert r["slurm_restart_count"] == 2


def test_plain_console_line_has_every_field(observed):
    _, printed, metrics = observed
    lines = [line for line in printed.splitlines() if line.startswith("step ")]
    assert len(lines) == 4, printed
    pattern = re.compile(r"step (\d)/4 eta \S+ \| loss ([\d.]+) \|( val [\d.]+ \|)? lr \S+ \| gnorm [\d.]+ \| "
                         r"[\d,]+ tok/s \| "
                         r"[\d,]+ tok/s/dev \| mfu [\d.]+% \|( mem [\d.]+ GiB \|)? data [\d.]+ ms$")
    for line, record in zip(lines, metrics):
        match = pattern.match(line)
        assert match, line
        assert int(match[1]) == record["step"] and float(match[2]) == round(record["loss"], 4)
    measured = [line for line in lines if " mem " in line]  # the memory probe's step (step 2)
    assert len(measured) == 1 and measured[0].startswith("step 2/")


def wandb_records(path: Path) -> list:
    """Protobuf records of an offline .wandb file (LevelDB log format: 32 KiB blocks of
    [crc32, length, type] chunks after a 7-byte ':W&B' header). W&B 0.31 ships no reader."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, out, chunk = path.read_bytes(), 7, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or kind == 0:  # block trailer / padding
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def wandb_history(records: list) -> list[dict]:
    """The logged rows: {metric: value}, nested keys joined with '/'."""
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def test_wandb_offline_run_holds_the_plan_and_the_metrics(observed):
    run_dir, _, metrics = observed
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    files = glob.glob(str(run_dir / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    assert len(files) == 1, list((run_dir / "wandb").iterdir())
    records = wandb_records(Path(files[0]))
    run = [r.run for r in records if r.WhichOneof("record_type") == "run"][0]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert run.project == "usp" and run.display_name == run_dir.name and list(run.tags) == ["ci", "tiny"]
    assert config["world_size"] == 1 and config["name"] == run_dir.name
    assert config["config"]["profile"]["steps"] == [2, 3]
    history = wandb_history(records)
    assert [h["_step"] for h in history] == [1, 2, 3, 4]
    for h, record in zip(history, metrics):
        assert h["loss"] == pytest.approx(record["loss"], rel=1e-12) and h["mfu"] == pytest.approx(record["mfu"])
        assert h["slurm_restart_count"] == 2
    assert history[1]["memory_measured_breakdown_gib/activations"] > 0  # nested fields flattened


def test_tensorboard_events_match_metrics_jsonl(observed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, metrics = observed
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "data_wait_s", "slurm_restart_count"} <= tags
    assert "memory_measured_breakdown_gib/activations" in tags  # nested fields flattened
    for tag in ("loss", "lr", "mfu", "tokens_per_s"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in metrics]
        for e, r in zip(events, metrics):
            assert e.value == pytest.approx(r[tag], rel=1e-6), (tag, e.step)


def test_profiler_traces_the_chosen_steps(observed):
    run_dir, _, _ = observed
    trace = json.loads((run_dir / "profile" / "rank_0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"usp_step_2", "usp_step_3", "usp_forward", "usp_backward", "usp_optimizer"} <= names
    assert not names & {"usp_step_1", "usp_step_4"}  # outside profile.steps
    assert any(str(n).startswith("aten::mm") for n in names)
    summary = (run_dir / "profile" / "summary_rank_0.txt").read_text()
    assert "optimizer steps 2-3" in summary and "step_2" in summary and "step_3" in summary
    assert re.search(r"communication: 0\.0% of self CPU time", summary), summary  # one rank: no collectives
    assert "aten::mm" in summary  # the top-ops table


def test_online_wandb_without_a_server_falls_back_to_offline_and_resume_keeps_the_run_id(
        tmp_path, shakespeare, offline_wandb):
    """wandb_mode=online against a closed local port: a warning, then an offline run. Resuming
    the run (more steps, same name) logs to the same W&B run id from the step it resumed at."""
    offline_wandb.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: connection refused
    offline_wandb.setenv("WANDB_API_KEY", "x" * 40)
    try:
        run_dir, printed = train(tmp_path, "train.steps=2", "train.name=fallback", "logging.wandb=true",
                                 "logging.wandb_mode=online", "logging.wandb_init_timeout_s=3",
                                 "train.measure_memory=false")
    finally:
        offline_wandb.delenv("WANDB_BASE_URL")
        offline_wandb.delenv("WANDB_API_KEY")
    assert "usp: warning: W&B online init failed" in printed and "wandb sync" in printed, printed
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    _, printed = train(tmp_path, "train.steps=3", "train.name=fallback", "logging.wandb=true",
                       "train.measure_memory=false")
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    # W&B names the folder by the second its init ran in and appends -1, -2 ... when a run of the
    # same id already started in that second (an in-process resume can be that quick: seen in CI)
    runs = sorted(glob.glob(str(run_dir / "wandb" / f"offline-run-*-{run_id}*" / f"run-{run_id}.wandb")),
                  key=lambda f: (Path(f).parent.name.split("-")[2], len(Path(f).parent.name), f))  # start order
    assert len(runs) == 2, list((run_dir / "wandb").iterdir())
    steps = [[h["_step"] for h in wandb_history(wandb_records(Path(f)))] for f in runs]
    assert steps == [[1, 2], [3]]


def test_communication_ops_are_told_from_compute():
    from usp.engine.observe.profiler import is_comm

    for name in ("c10d::allreduce_", "gloo:all_reduce", "nccl:all_gather", "nccl:_reduce_scatter_base",
                 "record_param_comms", "c10d::broadcast_", "_c10d_functional::all_to_all_single", "nccl:send"):
        assert is_comm(name), name
    for name in ("aten::mm", "aten::broadcast_tensors", "aten::add_", "usp_backward", "Optimizer.step#AdamW.step"):
        assert not is_comm(name), name


def test_trackers_get_numbers_only_with_nested_fields_flattened():
    from usp.engine.observe.tracking import scalars

    record = {"step": 3, "loss": 2.5, "val_loss": None, "grad_norm": float("nan"), "by": "MemTracker",
              "flag": True, "breakdown": {"params": 0.5, "acts": {"attn": 1}}}
    assert scalars(record) == {"loss": 2.5, "breakdown/params": 0.5, "breakdown/acts/attn": 1}


@pytest.mark.parametrize("configured,env,mode", [
    (None, {}, "offline"),  # no network needed by default
    (None, {"WANDB_API_KEY": "k"}, "online"),  # a key: the user asked W&B to upload
    (None, {"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}, "disabled"),  # W&B's own variable wins over the key
    (None, {"WANDB_MODE": "dryrun"}, "offline"),  # W&B's older name
    ("offline", {"WANDB_MODE": "online", "WANDB_API_KEY": "k"}, "offline"),  # the config wins over the environment
])
def test_wandb_mode_follows_config_then_environment(configured, env, mode):
    from usp.engine.observe.tracking import wandb_mode

    assert wandb_mode(configured, env) == mode


def test_a_failing_backend_is_dropped_closed_and_the_jsonl_goes_on(tmp_path):
    from usp.engine.observe.metrics import MetricsWriter
    from usp.engine.observe.tracking import Trackers

    class Broken:
        closed = 0

        def log(self, step, record):
            raise RuntimeError("disk full")

        def close(self):
            Broken.closed += 1

    warnings = []
    trackers = Trackers(MetricsWriter(tmp_path / "metrics.jsonl"), [Broken()], warnings.append)
    trackers.log(1, {"step": 1, "loss": 2.0})
    trackers.log(2, {"step": 2, "loss": 1.5})
    trackers.close()
    assert Broken.closed == 1 and len(warnings) == 1 and "disk full" in warnings[0]
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [2.0, 1.5]


def test_console_auto_is_plain_in_a_batch_log_and_rich_on_a_terminal(monkeypatch):
    """auto: plain lines when stdout is a file or pipe (Slurm's output file), the live bar on a TTY."""
    from usp.engine.observe.console import Console as TrainConsole

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    log = io.StringIO()
    monkeypatch.setattr("sys.stdout", log)
    console = TrainConsole("auto", total_steps=4, enabled=True)
    console.step(1, {"loss": 7.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0, "elapsed_s": 1.0})
    console.step(2, None)  # not a logged step: nothing printed
    console.close()
    assert console.mode == "plain" and "\x1b[" not in log.getvalue()
    lines = log.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("step 1/4 eta ") and "loss 7.5000" in lines[0]

    monkeypatch.setattr("sys.stdout", Terminal())
    rich_console = TrainConsole("auto", total_steps=4, enabled=True)
    rich_console.close()
    assert rich_console.mode == "rich"
    assert TrainConsole("auto", total_steps=4, enabled=False).mode == "quiet"  # ranks other than 0
