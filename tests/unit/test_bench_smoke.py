"""scripts/bench/gpu_session.py read in this process (torch-free): --plan-only prints its one device
command, a valid bash line that runs the script with arguments it accepts, and --fit recovers the
planner constants the rows were made from (the scripts run as they run: tests/e2e/test_bench_smoke.py)."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from tests.helpers import REPO

BENCH = REPO / "scripts" / "bench"


def gpu_session_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_session", BENCH / "gpu_session.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    sys.modules["gpu_session"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_session_plan_only_prints_the_device_command(monkeypatch, capsys):
    """--plan-only prints the one command for the device on one line: valid bash that fits the device
    tool's 2,000 characters, puts the checkout's usp before anything carried, writes under $OUT, and
    runs this script with arguments its own parser accepts (--budget-s 300)."""
    gs = gpu_session_module()
    seen = {}
    monkeypatch.setattr(gs, "plan_only", lambda args, cases, gpu: seen.update(args=args, gpu=gpu))
    monkeypatch.setattr(sys, "argv", ["gpu_session.py", "--plan-only", "NVIDIA H100 80GB HBM3", "79.1"])
    gs.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "device command:" and seen["gpu"] == ("NVIDIA H100 80GB HBM3", 79.1)
    command = lines[1].strip()
    assert command == gs.DEVICE_COMMAND and len(command) < 2000
    assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0
    assert "export PYTHONPATH=$PWD:/tmp/site" in command and "$OUT/" in command
    words = shlex.split(command.split("python3 scripts/bench/gpu_session.py", 1)[1].split("2>&1")[0])
    monkeypatch.setattr(sys, "argv", ["gpu_session.py", *words, "--plan-only", "NVIDIA H100 80GB HBM3", "79.1"])
    gs.main()  # the script's parser takes the command's own arguments
    assert seen["args"].budget_s == 300


@pytest.mark.slow
def test_gpu_session_fit_recovers_the_planner_constants(shakespeare, tmp_path):
    """--fit on a session's rows (two JSONLs, as two device calls write them): eager_overhead = the eager
    step's extra time over the compiled step's compute (its planned share) per model; with two models, the
    eager blocks and the eager loss apart (rows made with 0.25 and 10 ps per logit); the fp8_efficiency at
    which the planner predicts the measured FP8 / bf16 speedup (rows made from the planner at 0.6)."""
    gs = gpu_session_module()
    hardware = gs.mfu.gpu_overrides("NVIDIA H100 80GB HBM3", 79.1)
    base = {"hardware": hardware, "model": "llama3_2_1b", "micro_batch": 8, "grad_accum": 1}
    bf16 = {**base, "case": "1b compiled", "group": "mfu", "overrides": list(gs.all_cases()[4].overrides)}
    fp8 = {**base, "case": "1b fp8 tensorwise compiled", "group": "fp8",
           "overrides": list(gs.all_cases()[5].overrides), "check": {"ref": "1b compiled"}}
    runs = str(tmp_path / "runs")
    bf16["tokens_per_s"] = gs._predicted_tokens_per_s(bf16, runs)
    fp8["tokens_per_s"] = gs._predicted_tokens_per_s(fp8, runs, "cluster.timing.fp8_efficiency=0.6")
    largest = {**bf16, "case": "largest compiled", "model": "llama3_2_3b", "micro_batch": 2, "grad_accum": 4}
    rows = [bf16, fp8, largest]
    step_1b = 8 * 2048 / bf16["tokens_per_s"]  # the FP8 row's reference keeps its planned tokens/s
    shares = {}
    for r, step_s in ((bf16, step_1b), (largest, 0.8)):  # eager = compiled + 0.25 x its compute + 10 ps x logits
        tokens = r["micro_batch"] * r["grad_accum"] * 2048
        r.update(step_s=step_s, tokens_per_s=tokens / step_s)
        shares[r["case"]] = share = gs.compute_share(r, runs)
        assert 0.5 < share < 1  # the optimizer step and the fixed cost are the rest
        eager_s = step_s + 0.25 * share * step_s + 10e-12 * tokens * 128256
        rows.append({**r, "case": r["case"].replace("compiled", "eager"), "step_s": eager_s,
                     "tokens_per_s": tokens / eager_s})
    paths = [tmp_path / "run1.jsonl", tmp_path / "run2.jsonl"]
    for path, part in zip(paths, (rows[:3], rows[3:])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    lines = gs.fit([str(p) for p in paths])
    eager_1b = 0.25 + 10e-12 * 8 * 2048 * 128256 / (step_1b * shares["1b compiled"])
    assert f"1b (llama3_2_1b): cluster.timing.eager_overhead = {eager_1b:.3f} (blocks and loss together)" in lines
    assert ("eager blocks and eager loss apart (2 models): cluster.timing.eager_overhead = 0.250, "
            "cluster.timing.eager_loss_ps_per_logit = 10.00") in lines
    [fitted] = [line for line in lines if "fp8_efficiency" in line]
    assert float(fitted.rsplit("= ", 1)[1]) == pytest.approx(0.6, abs=2e-3)


def test_kernel_time_sums_a_traces_kernels_by_kind(tmp_path):
    """The profiled step's GPU time by kind: flash attention (whose names hold "cutlass") is attention,
    not a matmul; the optimizer's multi_tensor_apply kernels are apart; CPU ops are not kernels."""
    gs = gpu_session_module()
    events = [("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 3000), ("nvjet_sm90_qqtst_256x128_TNT", 1000),
              ("void pytorch_flash::flash_bwd_kernel<cutlass::bfloat16_t>", 500),
              ("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", 700),
              ("triton_red_fused_abs_max_t_1", 200), ("triton_red_fused_abs_max_t_1", 200),
              ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", 300), ("memset", 50)]
    trace = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": n, "dur": us} for n, us in events]
             + [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9000}]}
    path = tmp_path / "rank_0.json"
    path.write_text(json.dumps(trace))
    k = gs.kernel_time(path, top=3)
    assert k["by_kind_ms"] == {"matmul": 4.0, "attention": 0.5, "optimizer": 0.7, "fused (inductor)": 0.4,
                               "elementwise (aten)": 0.3, "other": 0.05}
    assert k["total_ms"] == pytest.approx(5.95)
    assert [t["name"][:18] for t in k["top"]] == ["nvjet_sm90_tst_256", "nvjet_sm90_qqtst_2", "void at::native::m"]
    assert k["top"][0] == {"name": events[0][0], "ms": 3.0, "calls": 1}
