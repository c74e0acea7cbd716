"""`usp plan --build-check` (issue 27, item 6) as a user runs it: the engine builds the named ranks'
parallel model on the meta device under a fake process group of the plan's world size, in a
subprocess; no GPU, no prepared corpus (a fresh data cache), nothing allocated. Each rank's local
parameter, gradient and optimizer-state bytes must equal the planner's within 1 %, and a plan that
passes every rule but doesn't build fails with the engine's error."""
from __future__ import annotations

import os
import re
import subprocess
import time
from importlib.util import find_spec

import pytest

from tests.helpers import REPO, USP

pytestmark = pytest.mark.timeout(600)


def build_check(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """`usp plan --build-check ...` in its own process, with an empty data cache (no corpus here)."""
    env = dict(os.environ, USP_CACHE_DIR=str(tmp_path / "empty_cache"), COLUMNS="250")
    start = time.perf_counter()
    proc = subprocess.run([USP, "plan", "--build-check", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    return proc, time.perf_counter() - start


def rows(out: str) -> dict[int, str]:
    """The table's row of each rank built: {rank: the row's text}."""
    return {int(m.group(1)): m.group(0) for m in re.finditer(r"^│\s+(\d+) │.*$", out, re.M)}


def within(out: str) -> float:
    """The summary's largest difference from the planner, in percent."""
    m = re.search(r"build check: (\d+) of (\d+) rank\(s\) built; local bytes within ([\d.]+)% of the plan", out)
    assert m and m.group(1) == m.group(2), out
    return float(m.group(3))


@pytest.mark.parametrize("args, ranks", [
    (["conf=tiny_ddp"], [0, 1]),  # DDP: the whole model on each rank (the wrap itself is left out on meta)
    # FSDP over TP, two pipeline stages (1F1B), a padded vocabulary: every default rank
    (["model=tiny", "model.vocab_size=4099", "model.n_layers=4", "parallelism.pp=2", "parallelism.tp=2",
      "parallelism.dp_shard=2", "cluster.procs_per_node=8", "train.micro_batch=1", "optimizer=sgd"], [0, 4, 7]),
    # experts over ep x FSDP2's padded shards (one local expert over 2 ranks): the short rank's optimizer
    (["model=moe_tiny", "model.n_experts=4", "parallelism.dp_shard=8", "parallelism.ep=4",
      "cluster.procs_per_node=8", "checkpoint.enabled=false", "7"], [7]),
    # Qwen3's attention (head_dim 48, not dim / heads = 32; QK-norm, replicated over tp) in FSDP x TP x PP
    (["model=tiny", "model.head_dim=48", "model.qk_norm=true", "model.n_layers=4", "parallelism.pp=2",
      "parallelism.tp=2", "parallelism.dp_shard=2", "cluster.procs_per_node=8", "train.micro_batch=1"], [0, 4, 7]),
    # the Qwen3-MoE recipe at its published scale: 64 ranks, EP 8 x FSDP 32 x PP 2
    (["conf=qwen3_30b_a3b", "0", "63"], [0, 63]),
    # DeepSeek-V3's options: latent attention over tp (its low-rank projections whole on every rank), a dense
    # first block on stage 0, a shared expert, in FSDP x TP x EP x PP
    (["model=deepseek_v3_tiny", "model.vocab_size=4099", "parallelism.pp=2", "parallelism.tp=2",
      "parallelism.dp_shard=2", "parallelism.ep=2", "cluster.procs_per_node=8", "train.micro_batch=1"], [0, 4, 7]),
    # multi-token prediction: one block more (its experts over ep), its projection and norms
    (["model=deepseek_v3_tiny", "model.mtp_depth=1", "model.vocab_size=4099", "parallelism.dp_shard=4",
      "parallelism.ep=2", "cluster.procs_per_node=4", "train.micro_batch=1"], [0, 3]),
    # the DeepSeek-V3 recipe at its published scale: 512 ranks, EP 32 x FSDP 64 x PP 8; the first pipeline
    # rank (embedding, the 3 dense blocks) and the last (the LM head)
    (["conf=deepseek_v3_671b", "0", "511"], [0, 511]),
    # the Qwen3-235B-A22B recipe: 256 ranks, EP 16 x FSDP 64 x PP 4; the first and the last pipeline rank
    (["conf=qwen3_235b_a22b", "0", "255"], [0, 255]),
])
def test_small_layouts_build_as_planned(tmp_path, args, ranks):
    proc, _ = build_check(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(rows(proc.stdout)) == ranks, proc.stdout
    assert all(row.rstrip(" │").endswith("ok") for row in rows(proc.stdout).values()), proc.stdout
    assert within(proc.stdout) <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("recipe, ranks", [("llama3_1_70b", ["0", "63"]), ("llama3_1_405b", ["0", "511"])])
def test_the_big_recipes_build_their_first_and_last_ranks(tmp_path, recipe, ranks):
    """Llama 3.1 70B (tp 8 x FSDP 8, 64 ranks) and 405B (pp 8 interleaved x tp 8 x FSDP 8, 512 ranks: its
    first and last pipeline ranks) on this CPU, every byte as planned (how long it takes:
    scripts/bench/build_check.py, docs/benchmarks.md)."""
    proc, _ = build_check(tmp_path, f"conf={recipe}", *ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(rows(proc.stdout)) == [int(r) for r in ranks]
    assert within(proc.stdout) <= 1.0


@pytest.mark.skipif(find_spec("flash_attn") is not None, reason="flash-attn is installed here: that plan builds")
def test_a_plan_that_passes_every_rule_but_does_not_build_fails(tmp_path):
    """A GPU cluster's plan with model.attention=flash_attn passes every rule, but the engine can't
    build it where flash-attn isn't installed: the check says so, with the engine's own error."""
    proc, _ = build_check(tmp_path, "model=tiny", "model.attention=flash_attn", "cluster=local_gpu",
                          "cluster.procs_per_node=2", "parallelism.dp_shard=2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "build failed" in proc.stdout and "0 of 2 rank(s) built" in proc.stdout
    assert "the plan passed every rule, but the engine can't build it" in proc.stderr
    assert "flash-attn" in proc.stderr and "Traceback" in proc.stderr  # the engine's error and where


def test_a_rank_outside_the_plan_is_refused(tmp_path):
    proc, _ = build_check(tmp_path, "conf=tiny_ddp", "2")
    assert proc.returncode == 2 and "--build-check=2" in proc.stderr and "0..1" in proc.stderr
