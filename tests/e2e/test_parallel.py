"""The parity matrix: every parallel layout the engine supports, alone and composed, trains
the tiny model for 5 AdamW steps (some with gradient accumulation) next to a single-process
reference of the same model, seed and global batch. A layout passes only if its loss matches
at every step and its final parameters match the reference's.

One torchrun launch per world size runs all layouts of that size (tests/dist/layouts.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist.harness import launch
from tests.dist.layouts import APPROXIMATE, LAYOUTS
from tests.dist.layouts import PARAM_ATOL as PARAM_ATOL_BY_LAYOUT

LOSS_RTOL = 1e-5  # fp32 loss per step, relative
# AdamW divides by sqrt(second moment): rounding differences of ~1e-7 in near-zero gradients
# become ~1e-5 parameter differences after a few steps; 1e-4 absolute bounds that (measured max 8.5e-5).
PARAM_ATOL = 1e-4
SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "cases_parallel.py"

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1800)]  # the launches' own limit (below)


@pytest.fixture(scope="module")
def results(shakespeare):
    """{world: {layout: result}}, one launch per world size, run lazily and cached."""
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            cache[world] = launch(SCRIPT, world, timeout=1800)  # the 4-process launch runs ~30 layouts
        return cache[world]

    return get


@pytest.mark.parametrize("world,layout", [(w, name) for w, layouts in LAYOUTS.items() for name in layouts])
def test_layout_matches_single_process(results, world, layout):
    result = results(world).get(layout)
    assert result is not None, f"{layout} did not run"
    assert result["ok"], result.get("trace") or result
    assert result["steps"] == result["steps_expected"] == (2 if layout.startswith("bf16_") else 3)  # cases_parallel.py
    assert not result["missing_params"], result["missing_params"]
    rtol = APPROXIMATE.get(layout, LOSS_RTOL)
    assert result["max_rel_loss_diff"] <= rtol, result["rows"]
    if layout not in APPROXIMATE:
        atol = PARAM_ATOL_BY_LAYOUT.get(layout, PARAM_ATOL)
        assert result["max_param_diff"] <= atol, (result["max_param_diff"], result["worst_param"],
                                                  result["routing_diverged_at"])
        assert result["routing_diverged_at"] is None, result["routing_diverged_at"]  # MoE: the same tokens per expert


def test_matrix_covers_the_required_compositions():
    names = {name for layouts in LAYOUTS.values() for name in layouts}
    required = {"ddp", "zero1", "fsdp_zero2", "fsdp_zero3_grad_accum", "tp_sp", "cp", "ep_x_fsdp", "pp_afab", "pp_1f1b",
                "pp_interleaved_1f1b", "pp_zbv", "dp_x_tp", "fsdp_x_tp", "tp_x_pp", "dp_x_pp", "cp_x_dp", "hsdp",
                "fsdp_x_tp_x_pp", "tp_sp_recompute_selective", "fsdp_recompute_full",
                "bf16_ddp", "bf16_fsdp_mixed_precision", "bf16_tp_sp", "bf16_pp_1f1b", "bf16_fsdp_x_tp",
                "zero1_x_tp", "zero1_x_pp", "cp_x_pp", "dp_x_cp_x_tp_x_pp", "ep_x_tp", "ep_x_pp",
                "tied_dp_x_pp", "ep_x_fsdp_x_tp_x_pp", "ep_aux_free_grad_accum", "ep_aux_free_x_pp", "ep_shared_expert",
                "qwen3_tp_sp", "qwen3_fsdp_x_tp", "qwen3_cp", "qwen3_pp_1f1b", "qwen3_moe_ep_x_fsdp",
                "qwen3_moe_ep_x_tp", "qwen3_moe_ep_x_pp", "deepseek_v3_tp_sp", "deepseek_v3_cp", "deepseek_v3_pp_1f1b",
                "deepseek_v3_ep_x_fsdp_grad_accum", "deepseek_v3_ep_x_tp", "deepseek_v3_ep_x_pp",
                "deepseek_v3_mtp_ep_x_fsdp_grad_accum", "deepseek_v3_yarn_cp",
                "deepseek_v3_mtp_tp_sp"}
    assert required <= names, required - names


def test_the_planner_counts_the_tp_collectives_recompute_runs_again(results):
    """Counted on usp's own TP block (gloo, 2 ranks): the all-gathers and reduce-scatters each recompute mode
    runs again per layer in the backward are the ones the time model charges (usp.perf.timing._tp_reruns)."""
    from usp.perf.stack_profile import PROFILES
    from usp.perf.timing import _tp_reruns

    result = results(2).get("tp_recompute_collectives")
    assert result is not None and result["ok"], result
    for mode in ("selective", "full"):
        assert result[mode] == list(_tp_reruns(mode, PROFILES["usp"])), (mode, result[mode])


def test_bf16_fsdp_computes_in_bf16_over_fp32_master_weights(results):
    """The GPU's FSDP recipe (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), run on
    gloo: a block's forward sees bf16 weights at every micro batch; the sharded parameters, the
    gradients AdamW steps with and its moments are fp32."""
    result = results(2).get("bf16_fsdp_dtypes")
    assert result is not None and result["ok"], result
    assert result["forward_weight"] == ["bfloat16"] and result["n_forward"] >= 2  # one per step (BF16_STEPS: 2)
    assert result["params"] == result["grads"] == result["moments"] == ["float32"]
    assert result["n_grads"] > 0 and len(result["losses"]) == 2


def test_fp8_under_fsdp_tracks_one_process(results):
    """train.fp8=tensorwise (torchao, on torch's CPU _scaled_mm) under FSDP2 ZeRO-3 on 2 ranks against the
    same FP8 run in one process. Not exact: each rank scales its half of the batch's activations by their
    own amax (one process: the whole batch's), so the FP8 roundings differ; 1e-3 relative bounds that
    (FP8 vs fp32 itself: 1.6e-4 over 20 steps; this case, a narrower one-block tiny model on sequences of 32:
    4.0e-5) while a lost gradient or unsynced shard shows at step 2."""
    result = results(2).get("fp8_fsdp")
    assert result is not None and result["ok"], result.get("trace") or result
    assert result["steps"] == result["steps_expected"] == 3 and not result["missing_params"]
    assert result["max_rel_loss_diff"] <= 1e-3, result["rows"]
    assert result["max_rel_loss_diff"] > 0  # FP8: not bit-identical (if it were, FP8 would not have run)


def test_usp_verify_passes_an_exact_layout(tmp_path, shakespeare):
    """`usp verify` as a user types it: tp x pp on 4 processes, exit 0 and a per-step table."""
    from tests.helpers import run_usp

    proc = run_usp("verify", "parallelism.tp=2", "parallelism.pp=2", "model.tie_embeddings=false",
                   "model.n_layers=4", "train.micro_batch=4", f"train.runs_dir={tmp_path}", "--steps", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout and "reference loss" in proc.stdout
    result = json.loads((tmp_path / "verify" / "tiny-pp2-tp2" / "verify.json").read_text())
    assert len(result["rows"]) == 3 and result["max_rel_loss_diff"] <= LOSS_RTOL


def test_usp_verify_takes_deepseek_v3(tmp_path, shakespeare):
    """`usp verify model=deepseek_v3_tiny` (latent attention, a dense first block, sigmoid group routing with
    a shared expert, the router bias moving each step) over EP x FSDP on 2 processes: exit 0, exact."""
    from tests.helpers import run_usp

    proc = run_usp("verify", "model=deepseek_v3_tiny", "parallelism.dp_replicate=1", "parallelism.dp_shard=2",
                   "parallelism.ep=2", f"train.runs_dir={tmp_path}", "--steps", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout
    result = json.loads(next((tmp_path / "verify").glob("*/verify.json")).read_text())
    assert len(result["rows"]) == 3 and result["max_rel_loss_diff"] <= LOSS_RTOL


def test_usp_verify_fails_an_approximate_layout(tmp_path, shakespeare):
    """PowerSGD compression changes the loss: verify must notice and exit non-zero."""
    from tests.helpers import run_usp

    proc = run_usp("verify", "parallelism.dp_replicate=2", "parallelism.ddp_comm_hook=powersgd",
                   f"train.runs_dir={tmp_path}")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL" in proc.stdout


def test_usp_verify_refuses_a_layout_the_engine_cannot_run(tmp_path):
    from tests.helpers import run_usp

    proc = run_usp("verify", "parallelism.dp_replicate=2", "parallelism.ddp_comm_hook=bf16",
                   f"train.runs_dir={tmp_path}")
    assert proc.returncode == 2 and "parallelism.ddp_comm_hook" in proc.stderr and "Traceback" not in proc.stderr
