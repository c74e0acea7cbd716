"""The generated batch script, without a Slurm cluster: golden files for two real-cluster
jobs, quoting of shell-special values, and errors before anything is written or submitted.
(Jobs on a running Slurm controller: tests/e2e/test_slurm.py.)

Refresh the golden files after an intended change: USP_UPDATE_GOLDEN=1 pytest tests/unit/test_slurm_script.py"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, SESSION_CACHE, usp_cli

GOLDEN = REPO / "tests" / "golden"

H100_16x8 = ["model=llama3_1_70b", "cluster=slurm_h100", "cluster.nodes=16", "parallelism.tp=8", "parallelism.pp=2",
             "parallelism.dp_shard=8", "train.seq_len=4096", "train.global_batch=512", "train.micro_batch=1",
             "train.recompute=selective", "train.name=llama70b", "cluster.slurm.partition=gpu",
             "cluster.slurm.account=proj42", "cluster.slurm.python=python",
             'cluster.slurm.setup=["module load cuda/12.4","source /opt/venvs/usp/bin/activate"]']
SUPERMUC_4x4 = ["model=llama3_1_8b", "cluster=supermuc_ng_p2", "cluster.nodes=4", "parallelism.dp_shard=16",
                "train.seq_len=4096", "train.global_batch=64", "train.micro_batch=1", "train.recompute=full",
                "train.name=llama8b_pvc", "cluster.slurm.partition=general", "cluster.slurm.account=pn12ab",
                "cluster.slurm.python=python", "cluster.slurm.rdzv_port=29400"]  # a firewall-fixed port


def dry_run(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    r = usp_cli("submit", "--dry-run", *overrides, f"train.runs_dir={tmp_path}", cwd=tmp_path)
    return r, tmp_path


def rendered(tmp_path: Path, name: str, *overrides: str) -> str:
    r, runs = dry_run(tmp_path, *overrides)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (runs / name / "job.sbatch").read_text()
    assert text in r.stdout  # --dry-run prints exactly what it wrote
    return text.replace(str(runs), "<RUNS>")


@pytest.mark.parametrize("golden,name,overrides", [
    ("slurm_h100_16x8.sbatch", "llama70b", H100_16x8),
    ("supermuc_ng_p2_4x4.sbatch", "llama8b_pvc", SUPERMUC_4x4),
])
def test_golden_sbatch(tmp_path, golden, name, overrides):
    text = rendered(tmp_path, name, *overrides)
    path = GOLDEN / golden
    if os.environ.get("USP_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{golden} changed: diff it, then refresh with USP_UPDATE_GOLDEN=1"


def test_docs_show_the_golden_script():
    """docs/slurm.md's excerpt of the generated script is the H100 golden file's body, so the docs can't drift."""
    golden = (GOLDEN / "slurm_h100_16x8.sbatch").read_text().replace("<RUNS>", "/scratch/me/runs")
    body = golden[golden.index("export PYTORCH_CUDA_ALLOC_CONF"):]
    docs = REPO / "docs" / "slurm.md"
    assert body in docs.read_text(), "update docs/slurm.md's excerpt from tests/golden/slurm_h100_16x8.sbatch"


def test_h100_script_takes_nodes_and_gpus_from_the_plan(tmp_path):
    text = rendered(tmp_path, "llama70b", *H100_16x8)
    assert "#SBATCH --nodes=16\n" in text and "#SBATCH --gpus-per-node=8\n" in text
    assert "--nproc-per-node 8" in text and "--rdzv-backend c10d" in text
    assert "RDZV_PORT=$((20000 + SLURM_JOB_ID % 10000))" in text  # one port per job by default
    assert "--rdzv-endpoint \"$HEAD_NODE:$RDZV_PORT\"" in text and '--rdzv-id "$SLURM_JOB_ID"' in text
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=1" in text
    assert "#SBATCH --signal=B:USR1@300" in text and "#SBATCH --requeue" in text
    assert "world size 128; layout pp2-fsdp8-tp8" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0  # valid bash


def test_supermuc_script_is_an_xpu_job_without_a_gpu_request(tmp_path):
    text = rendered(tmp_path, "llama8b_pvc", *SUPERMUC_4x4)
    assert "--gpus-per-node" not in text and "--gres" not in text and "#SBATCH --exclusive" in text
    assert "--nproc-per-node 4" in text and "cuda/nccl" not in text and "xpu/xccl" in text
    assert "RDZV_PORT=29400\n" in text and "SLURM_JOB_ID % 10000" not in text


NASTY = "a b \"q\" 'r' $HOME `touch PWNED` ; touch PWNED2 $(touch PWNED3) \\ end"


def test_shell_special_values_are_quoted_and_never_executed(tmp_path):
    """A value with spaces, quotes, $, backticks and ; lands in the script as one quoted word
    (env) or an escaped comment (the command line); running the script's environment part
    defines it unchanged and executes nothing."""
    quoted = "'" + NASTY.replace("'", "\\'") + "'"  # Hydra's quoted-string syntax
    r, runs = dry_run(tmp_path, "conf=tiny_demo", "cluster=local_slurm", "train.name=nasty",
                      f"+cluster.env.USP_PROBE={quoted}", f"train.sample_prompt={quoted}")
    assert r.returncode == 0, r.stdout + r.stderr
    text = (runs / "nasty" / "job.sbatch").read_text()
    assert f"export USP_PROBE={shlex.quote(NASTY)}\n" in text
    # The environment block of the script, run for real in bash: the value arrives unchanged.
    env_block = "\n".join(line for line in text.splitlines() if line.startswith(("export ", "#")))
    probe = subprocess.run(["bash", "-c", env_block + '\nprintf %s "$USP_PROBE"'], cwd=tmp_path,
                           capture_output=True, text=True)
    assert probe.returncode == 0 and probe.stdout == NASTY
    assert not list(tmp_path.glob("PWNED*"))
    # The prompt travels in plan.yaml only: outside the comment, only the quoted env value has it.
    lines = [ln for ln in text.splitlines() if "PWNED2" in ln]
    assert len(lines) == 2 and lines[0].startswith("# command: ") and lines[1].startswith("export USP_PROBE=")
    import yaml

    plan = yaml.safe_load((runs / "nasty" / "plan.yaml").read_text())
    assert plan["config"]["train"]["sample_prompt"] == NASTY


def test_a_newline_in_the_command_cannot_leave_its_comment(tmp_path):
    r, runs = dry_run(tmp_path, "conf=tiny_demo", "cluster=local_slurm", "train.name=nl",
                      "train.sample_prompt='line1\ntouch PWNED'")
    assert r.returncode == 0, r.stdout + r.stderr
    text = (runs / "nl" / "job.sbatch").read_text()
    assert not any(line.startswith("touch PWNED") for line in text.splitlines())
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


@pytest.mark.parametrize("override,key", [
    ("cluster.slurm.time=tomorrow", "cluster.slurm.time"),
    ("cluster.slurm.partition='gpu; rm -rf /'", "cluster.slurm.partition"),
    ("cluster.slurm.gpu_request=all", "cluster.slurm.gpu_request"),
    ("cluster.slurm.signal_lead_s=3600", "cluster.slurm.signal_lead_s"),
    ("cluster.slurm.sbatch_extra=['reservation=x']", "cluster.slurm.sbatch_extra[0]"),
    ("+cluster.env.1BAD=x", "cluster.env.1BAD"),
    ("cluster.launcher=pbs", "cluster.launcher"),
])
def test_bad_slurm_settings_fail_before_anything_is_written(tmp_path, override, key):
    r, runs = dry_run(tmp_path, "conf=tiny_demo", "cluster=local_slurm", "train.name=bad", override)
    assert r.returncode == 2, r.stdout + r.stderr
    assert key in r.stderr and "fix:" in r.stderr
    assert not (runs / "bad" / "job.sbatch").exists()


def test_a_saved_plan_is_checked_again_before_its_script_is_written():
    """`usp submit runs/<name>` re-reads plan.yaml: an env key edited in by hand is refused by the
    same field rule as at plan time, as a LaunchError naming it."""
    from omegaconf import OmegaConf

    from usp.config.compose import compose_config
    from usp.errors import LaunchError
    from usp.launch.slurm_script import check_slurm_settings

    cluster = OmegaConf.to_object(compose_config(None, ["cluster=local_slurm"])[0]).cluster
    check_slurm_settings(cluster)
    cluster.env = {"GOOD_KEY": "1", "1BAD": "x"}
    with pytest.raises(LaunchError) as err:
        check_slurm_settings(cluster)
    assert (err.value.key, err.value.value) == ("cluster.env.1BAD", "1BAD") and err.value.fix


def test_submit_refuses_a_local_cluster(tmp_path):
    r = usp_cli("submit", "conf=tiny_demo", f"train.runs_dir={tmp_path}", cwd=tmp_path)
    assert r.returncode == 2 and "cluster.launcher" in r.stderr and "cluster=local_slurm" in r.stderr


def test_submit_without_slurm_commands_says_what_to_do(tmp_path, shakespeare):
    """No sbatch on PATH: a clear error, and the script is still there to submit by hand."""
    env = {"PATH": str(Path(sys.executable).parent), "USP_CACHE_DIR": str(SESSION_CACHE)}  # the corpus, prepared
    r = usp_cli("submit", "conf=tiny_demo", "cluster=local_slurm", "train.name=nosbatch", f"train.runs_dir={tmp_path}",
                cwd=tmp_path, env=env)
    assert r.returncode == 2 and "`sbatch` not found" in r.stderr and "--dry-run" in r.stderr
    assert (tmp_path / "nosbatch" / "job.sbatch").is_file()


def test_array_script_gives_each_task_its_own_plan(tmp_path):
    from usp.config.compose import compose_config
    from usp.launch.slurm_script import render_job
    from usp.plan.plan import build_plan

    plans, paths = [], []
    for i, mb in enumerate((4, 8)):
        cfg, choices = compose_config("tiny_demo", ["cluster=local_slurm", f"train.micro_batch={mb}",
                                                    f"train.name=p{i}", f"train.runs_dir={tmp_path}"])
        plans.append(build_plan(cfg, choices))
        paths.append(tmp_path / f"p{i}" / "plan.yaml")
    text = render_job(plans, paths, ["usp", "sweep"], log_dir=tmp_path / "logs", title="sweep s", array_limit=1)
    assert "#SBATCH --array=0-1%1\n" in text and "slurm-%A_%a.out" in text
    assert re.search(r'PLANS=\(\n  \S+/p0/plan.yaml\n  \S+/p1/plan.yaml\n\)', text)
    assert 'export USP_PLAN="${PLANS[$SLURM_ARRAY_TASK_ID]}"' in text


@pytest.mark.parametrize("events,want", [
    ([{"event": "stopped", "step": 7, "signal": "SIGUSR1", "checkpoint": True}], "preempted"),
    ([{"event": "stopped", "step": 7, "signal": "SIGINT", "checkpoint": True}], "stopped SIGINT"),
    ([{"event": "stopped", "step": 7, "signal": "SIGTERM", "checkpoint": True}], "stopped SIGTERM"),
    ([{"event": "preempted", "step": 7}], "preempted"),  # written by an earlier usp: requeued as before
    ([{"event": "stopped", "step": 7, "signal": "SIGINT"}, {"event": "restart"}], "failed"),  # not the last event
    ([], "failed"),
])
def test_the_batch_script_requeues_only_a_usr1_stop(tmp_path, events, want):
    """What the batch script does after the job step (usp.launch.slurm_outcome): only a stop on
    USR1 (a time limit or a preemption) is "preempted", which requeues; one on INT or TERM is not."""
    from usp.launch.slurm_outcome import outcome

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "events.jsonl").write_text("".join(json.dumps({**e, "time": 100.0}) + "\n" for e in events))
    assert outcome(tmp_path, since=50.0, code=1) == want
    if events and want != "failed":
        assert outcome(tmp_path, since=150.0, code=1) == "failed"  # a stop of an earlier attempt
