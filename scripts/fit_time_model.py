"""Fit the catalogue's time constants (docs/planner.md "Where the constants come from") with
usp calibrate's search, in stages that keep hardware and stack constants apart, and print them with
their scores. The committed values in conf/cluster/*.yaml and usp/perf/stack_profile.py are this
script's output (copied by hand, with their sources in comments).

  A  Hopper GPU (gemm_efficiency, gemm_fixed_us, interference: every H100 / H200 group), the playbook
     cluster's network latencies, nanotron's and llm-foundry's stack constants, the A100's
     gemm_efficiency: on the playbook sweep's even rows + llm-foundry's bf16 rows (H100, A100)
  C  torchtitan's stack constants + the 500 W H100's clock: on torchtitan's 2024-12 tables and the one
     published torchtitan run marked `fit` (32k tokens without CP: its attention kernel)
  M  Megatron-Core's element-wise factor (Llama 3's stack borrows it) on the published Megatron-Core runs
     marked `fit`; legacy Megatron's element-wise factor and per-step cost on MegaScale's runs marked `fit`

  U  usp's eager and FP8 constants from its single-GPU sessions (with the committed GPU constants)

    python scripts/fit_time_model.py [--stages A,C,M]   # then --stages U
    python scripts/fit_time_model.py --cross-validate   # stage A on each playbook half, scored on the other
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from usp.perf.calibration import published as P  # noqa: E402
from usp.perf.calibration.calibrate import Param, Problem, cell_ranks, fit, score  # noqa: E402
from usp.perf.stack_profile import PROFILES  # noqa: E402

HOPPER = ("slurm_h100", "h100_playbook", "h100_500w", "h200", "local_gpu")
AMPERE = ("a100_80gb", "a100_40gb")

# (field, lower, upper): physical ranges
STAGE_A = [
    Param("hopper.gemm_efficiency", "gemm_efficiency", 0.66, 0.81, clusters=HOPPER),  # 0.733 measured x 0.9-1.1
    Param("hopper.gemm_fixed_us", "gemm_fixed_us", 2.0, 15.0, clusters=HOPPER),  # at most a lone kernel's 14.9 us
    Param("hopper.interference", "interference", 0.01, 0.5, clusters=HOPPER),
    Param("playbook.intra_latency_us", "intra_latency_us", 1.0, 200.0, clusters=("h100_playbook",)),
    Param("playbook.inter_latency_us", "inter_latency_us", 1.0, 200.0, clusters=("h100_playbook",)),
    Param("ampere.gemm_efficiency", "gemm_efficiency", 0.5, 0.95, clusters=AMPERE),
    *(Param(f"nanotron.{f}", f, lo, hi, profile="nanotron") for f, lo, hi in (
        ("elementwise_factor", 0.5, 4.0), ("layer_us", 0.1, 300.0), ("micro_batch_ms", 0.01, 100.0),
        ("step_ms", 0.1, 500.0), ("loss_bytes_per_logit", 10.0, 200.0), ("attention_efficiency", 0.3, 1.0),
        ("tp_overlap", 0.001, 0.95), ("pp_p2p_us", 1.0, 3000.0), ("p2p_stall_ms", 1.0, 2000.0),
        ("p2p_stall_nodes", 4.0, 128.0), ("p2p_stall_headroom", 0.01, 0.6), ("p2p_tp_ms", 0.1, 500.0),
        ("p2p_tp_exp", 0.5, 4.0))),
    *(Param(f"llmfoundry.{f}", f, lo, hi, profile="llmfoundry") for f, lo, hi in (
        ("elementwise_factor", 0.5, 4.0), ("layer_us", 0.1, 300.0), ("micro_batch_ms", 0.01, 100.0),
        ("step_ms", 0.1, 500.0), ("attention_efficiency", 0.3, 1.0))),
]
STAGE_C = [
    Param("h100_500w.clock", "clock", 0.6, 1.0, clusters=("h100_500w",)),
    *(Param(f"torchtitan.{f}", f, lo, hi, profile="torchtitan") for f, lo, hi in (
        ("eager_elementwise_factor", 0.5, 8.0), ("attention_efficiency", 0.3, 1.0),
        ("async_tp_overlap", 0.001, 0.95))),
]
STAGE_M = [Param("megatron.elementwise_factor", "elementwise_factor", 0.5, 8.0, profile="megatron")]
STAGE_L = [Param("megatron_legacy.elementwise_factor", "elementwise_factor", 0.5, 8.0, profile="megatron_legacy"),
           Param("megatron_legacy.step_ms", "step_ms", 0.01, 5000.0, profile="megatron_legacy")]
HOST = ("layer_us", "micro_batch_ms", "step_ms", "pp_p2p_us")  # borrowed from nanotron where not fitted
# Where the search starts (the fit is reproducible from here, whatever the committed values): the H200's
# measured GEMM efficiency x 1.077, the rest round values of the right size
START = {
    "hopper.gemm_efficiency": 0.789, "hopper.gemm_fixed_us": 6.19, "hopper.interference": 0.375,
    "playbook.intra_latency_us": 100.0, "playbook.inter_latency_us": 77.0, "ampere.gemm_efficiency": 0.926,
    "nanotron.elementwise_factor": 0.5, "nanotron.layer_us": 25.3, "nanotron.micro_batch_ms": 5.96,
    "nanotron.step_ms": 0.68, "nanotron.loss_bytes_per_logit": 165.7, "nanotron.attention_efficiency": 1.0,
    "nanotron.tp_overlap": 0.001, "nanotron.pp_p2p_us": 826.0, "nanotron.p2p_stall_ms": 316.7,
    "nanotron.p2p_stall_nodes": 32.66, "nanotron.p2p_stall_headroom": 0.1439, "nanotron.p2p_tp_ms": 15.0,
    "nanotron.p2p_tp_exp": 2.2, "llmfoundry.elementwise_factor": 3.45,
    "llmfoundry.layer_us": 300.0, "llmfoundry.micro_batch_ms": 0.01, "llmfoundry.step_ms": 0.1,
    "llmfoundry.attention_efficiency": 0.54, "h100_500w.clock": 0.727, "torchtitan.eager_elementwise_factor": 3.45,
    "torchtitan.attention_efficiency": 0.53, "torchtitan.async_tp_overlap": 0.63,
    "megatron.elementwise_factor": 1.0, "megatron_legacy.elementwise_factor": 5.0, "megatron_legacy.step_ms": 1000.0,
}


def stage(name: str, runs, params, problem_kw) -> dict:
    t = time.time()
    problem = Problem(list(runs), **problem_kw)
    result = fit(problem, params, values={p.name: START[p.name] for p in params})
    s = result.fit
    print(f"stage {name}: {len(problem.runs)} runs, {result.evaluations} evaluations, {time.time() - t:.0f} s; "
          f"fit: {s.abs_err_p50:.2f} points, median |rel| {s.rel_err_p50:.3f}", file=sys.stderr)
    for k, v in result.values.items():
        print(f"  {k:36s} {v:.4g}")
    return {"values": result.values, "hardware": result.hardware, "stacks": result.stacks}


def _foundry_bf16() -> list:
    return [r for r in P.llmfoundry() if r.precision == "bf16"]


def _with_stage_a(profiles: dict, out: dict) -> dict:
    """The profiles with stage A's fitted stack constants (nanotron's and llm-foundry's)."""
    for name in ("nanotron", "llmfoundry"):
        profiles[name] = replace(profiles[name], time=out["stacks"][name])
    return profiles


def cross_validate() -> None:
    """Stage A fitted on each half of the playbook sweep (with llm-foundry's bf16 rows), scored on the other
    half: how far the held-out figures move between two equal splits of the same sweep, and each cell's rank
    of its measured-best layout. The committed constants are the even-rows fit (the first fold)."""
    hits = cells = 0
    for fit_half, held in (("even", "odd"), ("odd", "even")):
        out = stage(f"A on the {fit_half} rows", [*P.playbook(fit_half), *_foundry_bf16()], STAGE_A, {})
        profiles = _with_stage_a(dict(PROFILES), out)
        for half in (held, fit_half):
            problem = Problem(list(P.playbook(half)), hardware=out["hardware"], profiles=profiles)
            predicted = problem.predict()
            s, ranks = score(problem.runs, predicted), cell_ranks(problem.runs, predicted)
            if half == held:
                hits, cells = hits + sum(r <= 3 for r in ranks.values()), cells + len(ranks)
            print(f"fit {fit_half}, scored on {half} ({'held out' if half == held else 'fitted'}): "
                  f"{s.abs_err_p50:.2f} points, predicted/measured by nodes "
                  f"{ {n: round(v, 2) for n, v in s.ratio_by_nodes.items()} }, top 3 {s.top3_share:.0%} of {s.cells}")
            print("  measured best at rank: " + " ".join(f"{k[4]}@{k[5]}:{r}" for k, r in sorted(
                ranks.items(), key=lambda kr: (kr[0][4], kr[0][5]))))
    print(f"held-out top 3 over both folds: {hits} of {cells} ({hits / cells:.0%})")


def _keep(done: list, out: dict) -> dict:
    done.append(out)
    return out


# usp's engine on one GPU (docs/benchmarks.md "GPU session"; docs/planner.md "Compile and FP8"): tokens/s compiled,
# eager, of Llama-3.2 1B (8 x 1) and 3B (2 x 4) on an H100 and 1B on an H200, seq 2048; FP8 tensorwise / bf16
H100_1B = ("cluster=slurm_h100", "cluster.procs_per_node=1", "model=llama3_2_1b", "train.seq_len=2048",
           "train.global_batch=8", "train.micro_batch=8")
H100_3B = (*H100_1B[:2], "model=llama3_2_3b", "train.seq_len=2048", "train.global_batch=8", "train.micro_batch=2")
H200_1B = ("cluster=h200", *H100_1B[1:])
H200_8B = ("cluster=h200", "cluster.procs_per_node=1", "model=llama3_1_8b", "train.seq_len=2048",
           "train.global_batch=4", "train.micro_batch=1", "train.recompute=selective")
EAGER = {"h100": ((H100_1B, 59_902, 44_586), (H100_3B, 21_126, 16_327)), "h200": ((H200_1B, 58_946, 49_072),)}
FP8 = (H100_3B, 22_310 / 21_126)  # fitted; H200_8B at 1.122 checks it


def usp_gpu_constants() -> None:
    """cluster.timing.eager_overhead / eager_loss_ps_per_logit (the eager step's extra time = overhead x the
    compiled micro batches' compute, as the planner splits the step, + per logit x the logits) and usp's
    fp8_cast_bytes (the FP8 / bf16 speedup), from the measured rows above."""
    from functools import partial

    from tests.helpers import plan_for
    from usp.perf import stack_profile

    plan = partial(plan_for, training=False)
    for gpu, pairs in EAGER.items():
        rows = []
        for args, compiled, eager in pairs:
            t = plan(*args, "train.compile=true").timing
            step_c, step_e = t.tokens_per_step / compiled, t.tokens_per_step / eager
            rows.append((step_c * t.compute_s / t.step_s, t.tokens_per_step * 128256, step_e - step_c))
        if len(rows) == 1:
            print(f"{gpu} eager_overhead {rows[0][2] / rows[0][0]:.4g} (the eager loss in both runs)")
            continue
        (a1, l1, x1), (a2, l2, x2) = rows
        det = a1 * l2 - a2 * l1
        print(f"{gpu} eager_overhead {(x1 * l2 - x2 * l1) / det:.4g}, eager_loss_ps_per_logit "
              f"{1e12 * (a1 * x2 - a2 * x1) / det:.4g}")
    base = stack_profile.PROFILES["usp"]

    def speedup(cast: float, args) -> float:
        stack_profile.PROFILES["usp"] = base.with_time(fp8_cast_bytes=cast)
        return plan(*args, "train.fp8=tensorwise").timing.tokens_per_s / plan(*args).timing.tokens_per_s

    lo, hi = 0.1, 200.0
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if speedup(mid, FP8[0]) > FP8[1] else (lo, mid)
    print(f"usp fp8_cast_bytes {mid:.4g} (H100 3B: {speedup(mid, FP8[0]):.4f}x, measured {FP8[1]:.4f}x); "
          f"H200 8B 1 x 4 selective predicted {speedup(mid, H200_8B):.4f}x, measured 1.122x")
    stack_profile.PROFILES["usp"] = base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="A,C,M")  # M: both Megatron stages
    ap.add_argument("--rows", action="store_true", help="every published run's prediction")
    ap.add_argument("--json", help="write the fitted values here")
    ap.add_argument("--cross-validate", action="store_true",
                    help="stage A on each half of the playbook sweep, scored on the other (nothing else)")
    args = ap.parse_args()
    if args.cross_validate:
        cross_validate()
        return
    stages = args.stages.split(",")
    if "U" in stages:
        usp_gpu_constants()
        return
    hardware, profiles, done = {}, dict(PROFILES), []
    if "A" in stages:
        runs = [*P.playbook("even"), *_foundry_bf16()]
        out = _keep(done, stage("A", runs, STAGE_A, {}))
        hardware.update(out["hardware"])
        profiles = _with_stage_a(profiles, out)
        borrowed = {f: getattr(profiles["nanotron"].time, f) for f in HOST}
        for name in ("torchtitan", "megatron", "megatron_legacy", "meta_llama3", "usp"):
            profiles[name] = profiles[name].with_time(**borrowed)
        print("  borrowed from nanotron: " + ", ".join(f"{k} {v:.4g}" for k, v in borrowed.items()))
    if "C" in stages:
        runs = [*P.torchtitan(), *(r for r in P.published() if r.use == "fit" and r.profile == "torchtitan")]
        out = _keep(done, stage("C", runs, STAGE_C, {"hardware": hardware, "profiles": profiles}))
        hardware.update({k: v for k, v in out["hardware"].items() if k == "h100_500w"})
        profiles["torchtitan"] = replace(profiles["torchtitan"], time=out["stacks"]["torchtitan"])
    if "M" in stages:
        runs = [r for r in P.published() if r.use == "fit" and r.profile == "megatron"]
        out = _keep(done, stage("M", runs, STAGE_M, {"hardware": hardware, "profiles": profiles}))
        profiles["megatron"] = replace(profiles["megatron"], time=out["stacks"]["megatron"])
        factor = profiles["megatron"].time.elementwise_factor
        profiles["meta_llama3"] = profiles["meta_llama3"].with_time(elementwise_factor=factor)
        print(f"  meta_llama3.elementwise_factor borrowed from megatron: {factor:.4g}")
        runs = [r for r in P.published() if r.use == "fit" and r.profile == "megatron_legacy"]
        out = _keep(done, stage("L", runs, STAGE_L, {"hardware": hardware, "profiles": profiles}))
        profiles["megatron_legacy"] = replace(profiles["megatron_legacy"], time=out["stacks"]["megatron_legacy"])
    if args.rows:
        problem = Problem([r for r in P.published() if r.use in ("eval", "fit", "eval_lowconf")], hardware=hardware,
                          profiles=profiles)
        for r, p in zip(problem.runs, problem.predict()):
            print(f"  {r.run_id:34s} {r.use:12s} {r.profile:16s} {r.layout.world:6d} meas {100 * r.mfu:5.1f} "
                  f"pred {100 * p:5.1f} {p / r.mfu - 1:+.1%}")
    if args.json:
        import json

        values = {k: v for st in done for k, v in st["values"].items()}
        values.update({f"{name}.{f}": getattr(profiles[name].time, f) for name in ("torchtitan", "megatron",
                       "megatron_legacy", "meta_llama3", "usp") for f in HOST})
        Path(args.json).write_text(json.dumps(values, indent=1, sort_keys=True))
    for name, runs in (("playbook odd (held out)", P.playbook("odd")),
                       ("playbook 3.57B and 80B (never fitted)", P.playbook_other_sizes()),
                       ("llm-foundry bf16", _foundry_bf16()),
                       ("torchtitan 2024-12", P.torchtitan()),
                       ("published eval", [r for r in P.published() if r.use == "eval"])):
        problem = Problem(list(runs), hardware=hardware, profiles=profiles)
        s = score(problem.runs, problem.predict())
        print(f"{name}: n {len(problem.runs)}, {s.abs_err_p50:.2f} points, median |rel| {s.rel_err_p50:.3f}, "
              f"within 15 % {s.within_15:.0%}, max {s.rel_err_max:.3f}, by nodes "
              f"{ {n: round(v, 2) for n, v in s.ratio_by_nodes.items()} }, top 3 {s.top3_share:.0%} of {s.cells}")


if __name__ == "__main__":
    main()
