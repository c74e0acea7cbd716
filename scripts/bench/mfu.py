#!/usr/bin/env python
"""GPU throughput (needs CUDA; exits 2 with a message elsewhere): tokens/s, MFU, HFU and peak
memory of usp's trainer on one GPU, each next to the planner's prediction, for

- Llama-3.2 1B (conf/model/llama3_2_1b) at seq 2048: torch.compile off/on x SDPA / flash-attn
  (flash-attn rows only when the package is installed: pip install 'usp[gpu]');
- the largest catalogue Llama the planner predicts to fit this GPU with full activation
  recomputation, at seq 2048 and 4096 (compile off/on).

Micro batch: the largest power of two (<= 8) the planner predicts to fit. bf16 (train.dtype=auto),
the GPU defaults of `usp train` (fused AdamW, SDPA flash first, expandable segments, no
deterministic kernels). The GPU's peak FLOP/s and memory come from its cluster group in
conf/cluster (GPU_GROUPS). MFU = measured tokens/s x model FLOPs/token / peak bf16 FLOP/s; HFU
counts recomputation too. Each case runs in its own process (a compile or an OOM can't leak
into the next) and its row is printed as soon as it is measured; --out appends each result as a
JSON line, so a time limit loses only the case in flight.

    python scripts/bench/mfu.py [--only 1b|largest] [--steps 10] [--out results.jsonl] [--json]
    python scripts/bench/mfu.py --plan-only "NVIDIA H100 80GB HBM3" 79.1   # the cases, no GPU needed
    python scripts/bench/mfu.py --smoke   # this script's machinery on CPU: one tiny case, figures meaningless
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import gpu_context  # noqa: E402
import gpu_peak  # noqa: E402

from usp.contract.run_plan import RunPlan  # noqa: E402

# torch.cuda.get_device_name() substring -> the cluster group holding that GPU's figures, first
# match wins. None: a variant with other clocks and no group yet (H100 PCIe ~756, NVL ~835 TFLOP/s).
GPU_GROUPS = (("H200", "h200"), ("H100 PCIe", None), ("H100 NVL", None), ("H100", "slurm_h100"),
              ("A100", "a100_80gb"), ("MI300X", "mi300x"))
LARGEST_CANDIDATES = ["llama3_1_8b", "llama3_2_3b", "llama3_2_1b"]  # largest first
WARMUP = 3  # steps before the timed window (compile happens here)
SMOKE_CASE = "tiny seq128 cpu smoke"


def need_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        print("mfu.py measures GPU throughput and needs a CUDA device; none is visible here "
              "(CPU figures: scripts/bench/overhead.py, distributed.py).", file=sys.stderr)
        sys.exit(2)


def gpu_overrides(name: str, mem_gib: float) -> list[str]:
    """local_gpu with this GPU's name and memory and the peak figures of its cluster group."""
    from usp.config.compose import compose_config

    group = next((g for key, g in GPU_GROUPS if key in name), None)
    if group is None:
        raise SystemExit(f"no cluster group holds the figures of {name!r}: add one to conf/cluster "
                         f"(peak_tflops_bf16 from the vendor's sheet) and map it in GPU_GROUPS ({__file__})")
    c = compose_config(None, [f"cluster={group}"])[0].cluster
    timing = [f"cluster.timing.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in c.timing.items()
              if k != "calibrated"]  # the GPU's time constants (its network's are not used on one node)
    return ["cluster=local_gpu", f"cluster.device_name={name.replace(' ', '_')}",
            f"cluster.peak_tflops_bf16={c.peak_tflops_bf16}", f"cluster.peak_tflops_fp32={c.peak_tflops_fp32}",
            f"cluster.peak_tflops_fp8={c.peak_tflops_fp8}", f"cluster.intra_node_gbps={c.intra_node_gbps}",
            f"cluster.hbm_gbps={c.hbm_gbps}", f"cluster.device_memory_gb={mem_gib:.1f}", *timing]


def this_gpu() -> tuple[str, float]:
    import torch

    return torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory / 2**30


def cases(only: str | None, steps: int, smoke: bool = False) -> list[tuple[str, list[str], list[str | None]]]:
    """(name, overrides, candidate models: the first the planner says fits is measured)."""
    run = [f"train.steps={WARMUP + steps + 1}", "train.log_interval=1", "train.eval_batches=1"]
    if smoke:
        return [(SMOKE_CASE, run + ["model=tiny", "train.seq_len=128"], [None])]
    attentions = ["sdpa"] + (["flash_attn"] if importlib.util.find_spec("flash_attn") else [])
    out = []
    if only in (None, "1b"):
        for attn in attentions:
            for compile_ in (False, True):
                out.append((f"llama3_2_1b seq2048 {attn} compile={'on' if compile_ else 'off'}",
                            run + ["model=llama3_2_1b", "train.seq_len=2048", f"model.attention={attn}",
                                   f"train.compile={str(compile_).lower()}"], [None]))
    if only in (None, "largest"):
        for seq in (2048, 4096):
            for compile_ in (False, True):
                out.append((f"largest seq{seq} recompute=full compile={'on' if compile_ else 'off'}",
                            run + [f"train.seq_len={seq}", "train.recompute=full",
                                   f"train.compile={str(compile_).lower()}"], LARGEST_CANDIDATES))
    return out


def fitting_plan(overrides: list[str], models: list[str | None], runs: str, micros: tuple = (8, 4, 2, 1),
                 global_batch: int | None = 8, accum: int = 1, recomputes: tuple = (None,)) -> RunPlan | None:
    """The first model (largest first), then the least recomputation (of `recomputes`; None: the
    overrides' own), then the largest micro batch (of `micros`) the planner predicts to fit
    (build_plan refuses a predicted OOM); global batch 8, or None: `accum` micro batches per step."""
    from usp.errors import UspError

    for model in models:
        for recompute in recomputes:
            for micro in micros:
                try:
                    return _common.plan_for(overrides + ([f"model={model}"] if model else [])
                                            + ([f"train.recompute={recompute}"] if recompute else [])
                                            + [f"train.global_batch={global_batch or micro * accum}",
                                               f"train.micro_batch={micro}"], 1, runs)
                except UspError:
                    continue
    return None


def measure(plan: RunPlan, steps: int) -> dict:
    """One case, in this process: what usp.engine.worker.run_worker does on one GPU."""
    import torch

    from usp.engine.accel import apply_determinism
    from usp.engine.parallel import mesh as udist
    from usp.engine.parallel.mesh import make_context
    from usp.engine.trainer import Trainer

    history = os.environ.get("USP_BENCH_MEMORY_HISTORY") == "1" and torch.cuda.is_available()
    torch.manual_seed(int(plan.config.train.seed))
    apply_determinism(plan)
    udist.init_process_group(plan)
    if history:
        gpu_peak.start(torch)
    try:
        trainer = Trainer(plan, make_context(plan))
        summary = trainer.fit()
    except torch.OutOfMemoryError as exc:
        return {"error": f"out of memory: {str(exc).splitlines()[0]}"}
    diagnosis = {"peak_breakdown": gpu_peak.breakdown(torch)} if history else {}
    step_s = _common.median(_common.step_times(trainer.history, WARMUP, steps))
    # each record holds the allocator's peak since the previous one (log_interval=1: per step);
    # none on CPU, which has no caching allocator to ask
    peaks = [r["memory_peak_gib"] for r in trainer.history if r.get("memory_peak_gib")]
    peak_gib = max(peaks) if peaks else None
    t, peak_stage = plan.timing, plan.memory.stages[plan.memory.peak_stage]
    tokens_per_s = t.tokens_per_step / step_s
    gross = gross_memory(torch)
    peak = t.peak_tflops * 1e12
    return {"tokens_per_s": tokens_per_s, "step_s": step_s,
            "mfu": tokens_per_s * t.model_flops_per_token / peak,
            "hfu": tokens_per_s * t.hw_flops_per_token / peak,
            "peak_memory_gib": peak_gib, "probe_peak_gib": (summary or {}).get("memory_measured_peak_gib"),
            "losses": [r["loss"] for r in trainer.history], **gross, **diagnosis,
            "predicted": {"tokens_per_s": t.tokens_per_s, "mfu": t.mfu, "hfu": t.hfu,
                          "peak_memory_gib": plan.memory.peak_gib,  # gross: with the fixed allowance
                          "overhead_gib": peak_stage.overhead / 2**30,
                          # tensors only, what the allocator's peak measures (no overhead allowance)
                          "tensor_gib": (peak_stage.total - peak_stage.overhead) / 2**30}}


def gross_memory(torch) -> dict:
    """The process's device memory beyond the allocator, at the end of the run: what the GPU's
    driver counts as used (one process per GPU here) minus what the caching allocator reserves is
    the CUDA context, cuBLAS / NCCL workspaces and the kernels' code; + the allocator's reserved
    peak = the gross peak, what the plan's printed figure (its fixed allowance included) promises."""
    if not torch.cuda.is_available():
        return {}
    outside = gpu_context.outside_allocator(torch)
    reserved_peak = torch.cuda.max_memory_reserved() / 2**30
    return {"reserved_peak_gib": reserved_peak, "outside_allocator_gib": outside,
            "gross_peak_gib": reserved_peak + outside}


def run_case(name: str, args) -> dict:
    """Plan the case (and with a GPU, measure it here); a dict with the model, batch and numbers."""
    case = next((c for c in cases(args.only, args.steps, args.smoke) if c[0] == name), None)
    if case is None:
        raise SystemExit(f"no case {name!r}")
    if args.smoke:
        hardware = ["cluster=local_cpu"]
    else:
        hardware = gpu_overrides(*((args.plan_only[0], float(args.plan_only[1])) if args.plan_only else this_gpu()))
    with tempfile.TemporaryDirectory() as runs:
        plan = fitting_plan(case[1] + hardware, case[2], runs)
        if plan is None:
            return {"error": "the planner predicts no micro batch fits"}
        out = {"model": plan.model.name, "micro_batch": plan.batch.micro_batch,
               "grad_accum": plan.batch.grad_accum}
        if args.plan_only:
            t = plan.timing
            return {**out, "predicted_mfu": t.mfu, "predicted_tokens_per_s": t.tokens_per_s,
                    "predicted_peak_gib": plan.memory.peak_gib}
        return {**out, **measure(plan, args.steps)}


def row(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name:<48} {r['error']}"
    pr = r["predicted"]
    peak = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}"
    return (f"{name:<48} {r['tokens_per_s']:>9,.0f} {r['mfu']:>6.1%} {r['hfu']:>6.1%} {peak:>9}   "
            f"{pr['tokens_per_s']:,.0f}, {pr['mfu']:.1%}, {pr['peak_memory_gib']:.1f} "
            f"({r['model']}, micro batch {r['micro_batch']} x {r['grad_accum']})")


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--only", choices=["1b", "largest"])
    p.add_argument("--steps", type=int, default=10, help="timed steps per case, after 3 warm-up steps")
    p.add_argument("--plan-only", nargs=2, metavar=("GPU_NAME", "GIB"),
                   help="no GPU needed: the cases and micro batches chosen for this GPU")
    p.add_argument("--out", help="append each case's result to this file as a JSON line")
    p.add_argument("--case-timeout", type=float, default=1200, help="seconds per case")
    p.add_argument("--smoke", action="store_true",
                   help="check this script on CPU: one tiny-model case through the same subprocess, "
                        "measurement and --out path (its figures mean nothing)")
    p.add_argument("--case", help=argparse_hidden())  # a child process: measure this case, print JSON
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args)))
        return
    if args.plan_only:
        results = {name: run_case(name, args) for name, _, _ in cases(args.only, args.steps, args.smoke)}
        _common.emit({"cases": results}, args, [f"{n}: {r}" for n, r in results.items()])
        return
    env = dict(os.environ)
    if not args.smoke:
        need_cuda()
        from usp.launch.local import accelerator_env

        env = {**accelerator_env("cuda"), **env}  # set before the child imports torch; the user's wins
    results = {}
    if not args.json:
        print(f"{'case':<48} {'tokens/s':>9} {'MFU':>6} {'HFU':>6} {'peak GiB':>9}   predicted tokens/s, MFU, GiB",
              flush=True)
    for name, _, _ in cases(args.only, args.steps, args.smoke):
        cmd = [sys.executable, __file__, "--case", name, "--steps", str(args.steps)] + \
              (["--only", args.only] if args.only else []) + (["--smoke"] if args.smoke else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.case_timeout)
            last = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
            r = json.loads(last[0]) if last else {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}",
                                                  "stderr_tail": proc.stderr.strip()[-4000:]}
        except subprocess.TimeoutExpired:
            r = {"error": f"no result in {args.case_timeout:.0f} s"}
        results[name] = r
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"case": name, **r, **_common.machine()}) + "\n")
        if not args.json:
            print(row(name, r), flush=True)
        r.pop("stderr_tail", None)  # kept in --out's line only: the table stays one row a case
    if args.json:
        _common.emit({"cases": results, **_common.machine()}, args, [])


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
