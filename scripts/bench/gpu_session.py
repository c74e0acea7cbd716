#!/usr/bin/env python
"""The GPU session: one prepared command for a lent GPU (one H100 or H200), the checks in
priority order, each case in its own process, each row printed as soon as it is measured and
appended to a JSONL, all within a time budget (--budget-s): a case whose estimated time does not
fit what is left is not started (a later, smaller one may be), and a running one is stopped at the
budget. The device's figures: docs/benchmarks.md, "GPU session"; the planner's constants they
fill: docs/planner.md, "Compile and FP8".

Cases (priority order; --plan-only lists them with the model, micro batch and time estimate):
 1.-4. correctness: the tiny model, 20 steps, same seed and data: fp32 on the CPU (the reference),
    fp32 on the GPU (within 1e-4 relative of the CPU, step by step), bf16 autocast (within 5e-3
    of GPU fp32) and compiled fp32 (within 1e-4 of GPU fp32);
 5. Llama-3.2 1B, seq 2048, bf16, compiled, 50 steps of one micro batch (8 sequences, or fewer if
    the planner says they don't fit): tokens/s, MFU, HFU, peak memory vs the planner; its losses
    are the FP8 run's reference;
 6. the same with train.fp8=tensorwise: throughput, and its last 10 losses within 2e-2 of bf16's;
 7.-8. the largest catalogue Llama the planner fits on this GPU, compiled (50 steps) and FP8
    tensorwise compiled, at the least recompute that fits (none, then selective, then full: MFU
    is what a user gets from the layout they would pick, and full recompute spends a third more
    FLOPs that MFU does not count), then the largest micro batch of 4, with 4 micro batches per
    step (16k+ tokens per step at micro batch 2, as a real run's global batch accumulates; one
    optimizer step per micro batch would charge the whole optimizer to each);
 9.-10. 1B and the largest eager, 10 steps (the compile gain on this GPU: cluster.timing.eager_overhead,
    and with both models the eager loss apart, eager_loss_ps_per_logit);
 11. 1B with train.fp8=rowwise;
 12. 1B compiled with 4 micro batches per step (8 x 4: the 50 % MFU target at a real run's batch);
 13.-14. the memory model's checks at the largest model: no accumulation at micro batch 2 (the
    peak without earlier gradients) and micro batch 1 (what stays when the activations halve);
 15. FP8 at its own fit: case 7's model and global batch, but the least recompute and the largest
    micro batch that fit with FP8 (the memory it saves, spent as a user would), tracking case 7's losses.
Cases 7 and 8 profile their step before the last (profile.enabled): the run's profile summary is
copied to $OUT and the row gets the step's GPU time by kind of kernel (kernel_time).
FP8 and eager cases take the model, micro batch and recompute of the compiled bf16 case they are
compared with (Case.like), even where they would fit more, so that each comparison is like for like.
Case numbers count from the tiny CPU reference (1) to the last (15): --plan-only lists them.
Tolerances (max over the compared steps of |loss - ref| / ref; every step, but FP8's last
LOSS_WINDOW steps):
 - 1e-4, GPU fp32 vs CPU fp32 and compiled vs eager fp32: the same arithmetic, only reduction
   orders differ (on CPU, compiled vs eager measured < 1e-5 over 4 steps, tests/engine/test_training.py);
 - 5e-3, bf16 vs fp32: about one bf16 rounding (2^-8 = 3.9e-3) of the mean loss; a lost cast or
   gradient moves a 20-step loss by far more. Measured on CPU (tiny, 20 steps): 4.4e-5;
 - 2e-2, FP8 vs bf16 over 50 steps: e4m3 keeps 3 mantissa bits per operand, but dynamic scales
   keep the matmuls' relative error small and it averages over the tokens; measured on CPU
   (torch's CPU _scaled_mm, tiny, 20 steps): 1.6e-4 tensorwise, 1.7e-4 rowwise vs fp32. A wrong
   scale shows as a loss off by tens of percent. Compared over the last 10 of the 50 steps: the
   first H100 session (2026-11-27) saw bf16 itself spike in steps 1-8 (12.1 -> 10.8 -> 12.2 at
   1B, up to 27 at 3B: Adam's first, sign-like updates on a 128k vocabulary), where FP8's rounding
   moves the spikes by up to 28 %; over steps 41-50 FP8 stayed within 0.8 % per step of bf16.
   The check was all 50 steps before that run; this window was chosen after it.
Time: the planner's predicted step time for each case (on this GPU's cluster group) x steps, + a
process start, model build, compile and first-step allowance per case (ESTIMATE_S, guesses to be
replaced by this session's measured `elapsed_s`); the dataset is prepared once, before the first
case, by this process.

On the device, one call: DEVICE_COMMAND (at the end of this file), which --plan-only prints on one
line: it installs the wheelhouse built here and carried as .whl (docs/benchmarks.md) into /tmp/site,
puts the checkout's usp first on PYTHONPATH, and runs this script with --budget-s 300 into $OUT.

    python scripts/bench/gpu_session.py [--budget-s 300] [--cases 1-4,6] [--out results.jsonl]
    python scripts/bench/gpu_session.py --plan-only "NVIDIA H100 80GB HBM3" 79.1   # no GPU needed
    python scripts/bench/gpu_session.py --smoke       # the whole flow on CPU, tiny cases, FP8 skipped
    python scripts/bench/gpu_session.py --fit run1.jsonl [run2.jsonl]   # the planner constants the rows imply,
                                      # and each row's memory as this checkout's planner predicts it
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import mfu  # noqa: E402  (the GPU's cluster group, the fitting micro batch, one measured run)

from usp.contract.plan_file import plan_from_dict  # noqa: E402
from usp.contract.run_plan import RunPlan  # noqa: E402

WARMUP = mfu.WARMUP  # steps before the timed window (compile happens in the first)
CORRECTNESS_STEPS, LOSS_STEPS, EAGER_STEPS, SMOKE_STEPS = 20, 50, 10, 5
LOSS_WINDOW = 10  # FP8 vs bf16: the last steps, past the early loss spikes (module docstring)
RTOL_FP32, RTOL_BF16, RTOL_FP8 = 1e-4, 5e-3, 2e-2  # module docstring: why these
# Seconds besides the planned steps (guesses until a device run measures them: the rows' elapsed_s):
# a process (python, torch, CUDA context), building a model per billion parameters (CPU init, copy),
# compiling a block's forward and backward (FP8: its cast kernels too), the first steps' allocations.
ESTIMATE_S = {"process": 7.0, "build_per_b": 3.0, "compile": 40.0, "compile_fp8": 60.0, "compile_tiny": 20.0,
              "first_steps": 3.0, "margin": 1.2}
SEQ, TINY_SEQ = 2048, 256
LARGEST_ACCUM, ACCUM_1B = 4, 4  # micro batches per step: the largest model's cases, "1b compiled accum"


@dataclass(frozen=True)
class Case:
    name: str
    group: str  # correctness | mfu | fp8
    overrides: tuple[str, ...]
    steps: int
    models: tuple = (None,)  # candidates, largest first: the first the planner fits on this GPU runs
    ref: str | None = None  # the case whose losses this one tracks
    rtol: float = 0.0
    on_cpu: bool = False  # the CPU reference: planned on local_cpu, runs on the CPU
    micros: tuple = (8,)  # micro batches to try, largest first: one micro batch per step (no accumulation)
    window: int = 0  # compare only the last `window` losses (0: every step)
    accum: int = 1  # micro batches per step (gradient accumulation)
    recomputes: tuple = (None,)  # train.recompute to try, least first (None: the overrides' own)
    like: str | None = None  # the case whose model, micro batch and recompute this one takes (like for like)
    own_fit: bool = False  # with `like`: its model and global batch, but the least recompute and largest micro
    #                        batch that fit this case (FP8's saved memory spent on less recompute / larger micro)
    profile: bool = False  # torch.profiler over the step before the last: its summary lands in $OUT

    @property
    def compiled(self) -> bool:
        return "train.compile=true" in self.overrides

    @property
    def fp8(self) -> bool:
        return any(o.startswith("train.fp8=") and o != "train.fp8=off" for o in self.overrides)


def _tiny(name: str, ref: str | None, rtol: float, *extra: str, on_cpu: bool = False) -> Case:
    run = ("model=tiny", f"train.seq_len={TINY_SEQ}")  # one micro batch of 8 sequences per step (Case.micros)
    return Case(name, "correctness", run + extra, CORRECTNESS_STEPS, ref=ref, rtol=rtol, on_cpu=on_cpu)


def _big(name: str, group: str, model: str, *extra: str, steps: int = LOSS_STEPS, ref: str | None = None,
         rtol: float = 0.0, accum: int | None = None, micros: tuple | None = None, like: str | None = None,
         own_fit: bool = False, profile: bool = False) -> Case:
    largest = model == "largest"
    # lr 3e-4 (Llama 3's scale) rather than the tiny model's 3e-3: a 50-step comparison needs no loss spikes
    run = (f"train.seq_len={SEQ}", "optimizer.lr=3e-4", "train.measure_memory=false")
    models = tuple(mfu.LARGEST_CANDIDATES) if largest else (model,)
    # 1B: one micro batch per step (or `accum`), the largest that fits of 8 sequences. The largest model: the
    # least recomputation that fits, then the largest micro batch of 4 (50 steps of an 8B model at 8 x 2048
    # tokens would take the whole budget), 4 micro batches per step (16k+ tokens, as a user would train)
    micros = micros or ((4, 2, 1) if largest else (8, 4, 2, 1))
    accum = accum or (LARGEST_ACCUM if largest else 1)
    if profile:
        run += ("profile.enabled=true", profiled_step(steps))
    return Case(name, group, run + extra, steps, models, ref, rtol, micros=micros,
                window=LOSS_WINDOW if group == "fp8" else 0, accum=accum,
                recomputes=("none", "selective", "full") if largest else (None,), like=like or ref,
                own_fit=own_fit, profile=profile)


def profiled_step(steps: int) -> str:
    """One step, the one before the last: the timed steps' median moves by at most one step."""
    return f"profile.steps=[{steps - 1},{steps - 1}]"


def all_cases() -> list[Case]:
    fp32 = ("train.dtype=fp32", "train.compile=false")
    bf16 = ("train.dtype=bf16",)
    on, off = ("train.compile=true",), ("train.compile=false",)
    return [
        _tiny("tiny fp32 cpu", None, 0.0, *fp32, on_cpu=True),
        _tiny("tiny fp32", "tiny fp32 cpu", RTOL_FP32, *fp32),
        _tiny("tiny bf16", "tiny fp32", RTOL_BF16, "train.dtype=bf16", "train.compile=false"),
        _tiny("tiny fp32 compiled", "tiny fp32", RTOL_FP32, "train.dtype=fp32", "train.compile=true"),
        _big("1b compiled", "mfu", "llama3_2_1b", *bf16, *on),
        _big("1b fp8 tensorwise compiled", "fp8", "llama3_2_1b", *bf16, *on, "train.fp8=tensorwise",
             ref="1b compiled", rtol=RTOL_FP8),
        _big("largest compiled", "mfu", "largest", *bf16, *on, profile=True),
        _big("largest fp8 tensorwise compiled", "fp8", "largest", *bf16, *on, "train.fp8=tensorwise",
             ref="largest compiled", rtol=RTOL_FP8, profile=True),
        _big("1b eager", "mfu", "llama3_2_1b", *bf16, *off, steps=EAGER_STEPS, like="1b compiled"),
        _big("largest eager", "mfu", "largest", *bf16, *off, steps=EAGER_STEPS, like="largest compiled"),
        _big("1b fp8 rowwise compiled", "fp8", "llama3_2_1b", *bf16, *on, "train.fp8=rowwise",
             ref="1b compiled", rtol=RTOL_FP8),
        _big(f"1b compiled accum {ACCUM_1B}", "mfu", "llama3_2_1b", *bf16, *on, steps=EAGER_STEPS * 2,
             accum=ACCUM_1B),
        # the memory model's checks: the largest model without accumulation, and at one sequence per micro batch
        _big("largest compiled accum 1", "mfu", "largest", *bf16, *on, steps=EAGER_STEPS * 2, accum=1, micros=(2,)),
        _big("largest compiled micro 1", "mfu", "largest", *bf16, *on, steps=EAGER_STEPS * 2, micros=(1,)),
        # FP8 as a user would run it: the memory it saves buys less recompute or a larger micro batch, at the
        # bf16 case's model and global batch (so the losses still compare step by step)
        _big("largest fp8 tensorwise own fit", "fp8", "largest", *bf16, *on, "train.fp8=tensorwise",
             ref="largest compiled", rtol=RTOL_FP8, own_fit=True),
    ]


def smoke_case(case: Case) -> tuple[Case | None, str]:
    """The case as --smoke runs it on CPU (tiny model, short), or None with why it is skipped."""
    if case.fp8:
        return None, "FP8 skipped on CPU: torchao's FP8 matmuls need a GPU with FP8 units (train.fp8 is refused there)"
    keep = tuple(o for o in case.overrides if not o.startswith(("train.seq_len", "train.recompute", "model=",
                                                                  "profile.steps")))
    keep += (profiled_step(SMOKE_STEPS),) if case.profile else ()
    keep = tuple("train.compile=false" if o == "train.compile=true" else o for o in keep)  # inductor's C++: minutes
    note = "compiled on the GPU, eager in the smoke" if case.compiled else ""
    tiny = ("model=tiny", "train.seq_len=64")
    return Case(case.name, case.group, tiny + keep, SMOKE_STEPS, ref=case.ref, rtol=case.rtol,
                on_cpu=case.on_cpu, micros=(4,), profile=case.profile), note


def select(cases: list[Case], spec: str | None) -> list[int]:
    """1-based case numbers from "1-4,6" (all when None)."""
    if not spec:
        return list(range(1, len(cases) + 1))
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    if not all(1 <= i <= len(cases) for i in out):
        raise SystemExit(f"--cases {spec}: choose among 1-{len(cases)} (--plan-only lists them)")
    return sorted(set(out))


# -- planning and estimating (no torch) -----------------------------------------------------------

def hardware(case: Case, gpu: tuple[str, float] | None) -> list[str]:
    if case.on_cpu or gpu is None:
        return ["cluster=local_cpu"]
    return mfu.gpu_overrides(*gpu)


def plan_case(case: Case, gpu: tuple[str, float] | None, runs: str, like: RunPlan | None = None) -> RunPlan | None:
    """The case's plan (the fitting model and micro batch, or `like`'s: the plan of the case it is
    compared with, so that FP8 and eager run the bf16 case's batch even where they would fit more), its
    run directory under runs."""
    global_batch = None
    if like is not None and case.own_fit:
        global_batch = like.batch.micro_batch * like.batch.grad_accum
        micros = tuple(m for m in case.micros if global_batch % m == 0)
        case = replace(case, models=(like.model.name,), micros=micros)
    elif like is not None:
        case = replace(case, models=(like.model.name,), micros=(like.batch.micro_batch,),
                       recomputes=(like.config.train.recompute,))
    run = [f"train.steps={case.steps}", "train.log_interval=1", "train.eval_batches=1",
           f"train.name={case.name.replace(' ', '_')}"]
    return mfu.fitting_plan(run + list(case.overrides) + hardware(case, gpu), list(case.models), runs,
                            case.micros, global_batch=global_batch, accum=case.accum, recomputes=case.recomputes)


def estimate_s(case: Case, plan: RunPlan) -> float:
    """Seconds the case's process should take (ESTIMATE_S + the planner's steps + one eval)."""
    e = ESTIMATE_S
    params_b = plan.model.params / 1e9
    compile_s = 0.0
    if case.compiled:
        compile_s = e["compile_tiny"] if params_b < 0.1 else e["compile_fp8"] if case.fp8 else e["compile"]
    steps_s = plan.timing.step_s * (case.steps + 0.5)  # + the eval's forward
    return e["margin"] * (e["process"] + e["build_per_b"] * params_b + compile_s + e["first_steps"] + steps_s)


# -- one case, in its own process ------------------------------------------------------------------

def run_plan(path: str) -> dict:
    """The child: train the plan here (mfu.measure: tokens/s, MFU, HFU, peak memory, losses)."""
    plan = plan_from_dict(json.loads(Path(path).read_text()))
    timed = max(1, int(plan.config.train.steps) - WARMUP - 1)
    result = mfu.measure(plan, timed)
    from usp.run.files import profile_dir

    profiled = profile_dir(plan.run_dir)
    if (profiled / "rank_0.json").is_file():
        result["kernels"] = kernel_time(profiled / "rank_0.json")
        if os.environ.get("OUT"):  # the summary beside the JSONL (the trace itself is too large to carry back)
            shutil.copyfile(profiled / "summary_rank_0.txt", Path(os.environ["OUT"]) / f"profile_{plan.name}.txt")
    return {**result, **_common.machine()}


KERNEL_KINDS = (  # first match wins; lower-case substrings of a GPU kernel's name (flash's names hold "cutlass")
    ("attention", ("flash", "fmha", "attention")), ("optimizer", ("multi_tensor_apply",)),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas")), ("fused (inductor)", ("triton",)),
    ("elementwise (aten)", ("elementwise", "reduce_kernel", "copy")),
)


def kernel_time(trace: Path, top: int = 25) -> dict:
    """The profiled step's GPU time by kind of kernel (FP8 and bf16 matmuls, attention, inductor's fused
    kernels: casts, norms, activations) and the top kernels by time: where FP8's time goes."""
    ms: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for e in json.loads(trace.read_text()).get("traceEvents", []):
        if e.get("cat") == "kernel" and "dur" in e:
            ms[e["name"]] += e["dur"] / 1e3
            calls[e["name"]] += 1
    kinds: Counter[str] = Counter()
    for name, t in ms.items():
        low = name.lower()
        kinds[next((k for k, keys in KERNEL_KINDS if any(key in low for key in keys)), "other")] += t
    return {"total_ms": sum(kinds.values()), "by_kind_ms": dict(kinds),
            "top": [{"name": n[:160], "ms": t, "calls": calls[n]} for n, t in ms.most_common(top)]}


def run_child(plan: RunPlan, timeout_s: float, env: dict, work: Path) -> dict:
    path = work / f"{plan.name}.plan.json"
    path.write_text(json.dumps(plan.to_dict(), default=float))
    cmd = [sys.executable, __file__, "--run-plan", str(path)]
    # its own process group: at the budget the case goes with everything it started (inductor's compile
    # workers would otherwise hold its output pipes open, and this process would wait on them)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"stopped at the budget after {timeout_s:.0f} s"}
    last = stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
    if not last:
        return {"error": f"exit {proc.returncode}: {stderr.strip()[-300:]}", "stderr_tail": stderr[-4000:]}
    return json.loads(last[0])


def check(case: Case, r: dict, done: dict) -> dict | None:
    """The case's losses against its reference's, step by step (max relative difference)."""
    if case.ref is None or "losses" not in r:
        return None
    ref = done.get(case.ref, {})
    if "losses" not in ref:
        return {"ref": case.ref, "rtol": case.rtol, "ok": None, "why": "reference not measured in this run"}
    pairs = list(zip(r["losses"], ref["losses"]))
    complete = len(pairs) == case.steps
    pairs = pairs[-case.window:] if case.window else pairs
    diff = max(abs(a - b) / abs(b) for a, b in pairs) if pairs else float("nan")
    return {"ref": case.ref, "rtol": case.rtol, "max_rel_diff": diff, "steps": len(pairs),
            "ok": complete and diff <= case.rtol}


# -- the session ----------------------------------------------------------------------------------

HEADER = (f"{'#':>2} {'case':<34} {'model':<12} {'b x m':>6} {'s':>5} {'est':>5} {'tokens/s':>9} {'MFU':>6} "
          f"{'HFU':>6} {'GiB':>6} {'plan':>6}  check / note")


def row(i: int, case: Case, r: dict) -> str:
    """One printed line: measured, the planner's prediction (tensor GiB), the check or the reason."""
    head = f"{i:>2} {case.name:<34} {r.get('model') or '-':<12} " \
           f"{r.get('micro_batch', '-')!s:>3}x{r.get('grad_accum', '-')!s:<2} " \
           f"{r.get('elapsed_s', 0):>5.0f} {r.get('estimate_s', 0):>5.0f}"
    if "error" in r or "skipped" in r:
        return f"{head} {r.get('error') or r.get('skipped')}"
    pr = r["predicted"]
    peak = "-" if r.get("peak_memory_gib") is None else f"{r['peak_memory_gib']:.1f}"
    c = r.get("check")
    verdict = "" if c is None else (f"{c['why']}" if c.get("ok") is None else
                                    f"{'ok' if c['ok'] else 'FAILED'}: {c['max_rel_diff']:.1e} vs {c['ref']} "
                                    f"(<= {c['rtol']:g})")
    return (f"{head} {r['tokens_per_s']:>9,.0f} {r['mfu']:>6.1%} {r['hfu']:>6.1%} {peak:>6} {pr['tensor_gib']:>6.1f}  "
            f"planned {pr['tokens_per_s']:,.0f} tok/s, {pr['mfu']:.1%}; {verdict} {r.get('note', '')}").rstrip()


def markdown(rows: list[tuple[int, Case, dict]]) -> str:
    """The docs/benchmarks.md table of this session: each measurement beside the planner's prediction."""
    machine = next((r for _, _, r in rows if "torch" in r), _common.machine())
    out = [f"device: {machine.get('gpu', 'no GPU (smoke)')}, torch {machine.get('torch', '?')}, "
           f"Python {machine['python']}; command: scripts/bench/gpu_session.py (its docstring)", "",
           "| # | case | model, micro batch x accum | tokens/s | MFU | HFU | peak GiB (allocated) | planned: "
           "tokens/s, MFU, tensor GiB | memory measured/planned | loss check |",
           "|---|---|---|---:|---:|---:|---:|---|---:|---|"]
    for i, case, r in rows:
        if "error" in r or "skipped" in r:
            out.append(f"| {i} | {case.name} | {r.get('model', '-')} | {r.get('error') or r.get('skipped')} "
                       "| | | | | | |")
            continue
        pr, c = r["predicted"], r.get("check") or {}
        peak = r.get("peak_memory_gib")
        ratio = f"{peak / pr['tensor_gib']:.3f}" if peak else "-"
        chk = "-" if not c else c.get("why") or f"{c['max_rel_diff']:.1e} (<= {c['rtol']:g}: " \
                                                f"{'ok' if c['ok'] else 'FAILED'})"
        out.append(f"| {i} | {case.name} | {r['model']}, {r['micro_batch']} x {r['grad_accum']} | "
                   f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['hfu']:.1%} | "
                   f"{'-' if peak is None else f'{peak:.1f}'} | {pr['tokens_per_s']:,.0f}, {pr['mfu']:.1%}, "
                   f"{pr['tensor_gib']:.1f} | {ratio} | {chk} |")
    return "\n".join(out) + "\n"


def prepared(cases: list[tuple[int, Case, str]], gpu: tuple[str, float] | None, runs: str) -> list:
    """(number, case, plan or None, estimate s, note) for each case, planned here (the first plan
    prepares the dataset)."""
    out, plans = [], {}
    for i, case, note in cases:
        like = plans.get(case.like) if case.like else None
        plans[case.name] = plan = None if case.group == "skipped" else plan_case(case, gpu, runs, like)
        out.append((i, case, plan, estimate_s(case, plan) if plan else 0.0, note))
    return out


def session(args, cases: list[tuple[int, Case, str]], gpu: tuple[str, float] | None, env: dict) -> list:
    """Run the cases in order within the budget; print and append each row as it is measured."""
    start, done, rows = time.perf_counter(), {}, []
    with tempfile.TemporaryDirectory() as runs:
        planned = prepared(cases, gpu, runs)
        print(HEADER, flush=True)
        for i, case, plan, est, note in planned:
            left = args.budget_s - (time.perf_counter() - start)
            if case.group == "skipped":
                r, note = {"skipped": note}, ""
            elif plan is None:
                r = {"error": "the planner predicts no micro batch fits"}
            elif est > left:
                r = {"skipped": f"not started: estimated {est:.0f} s, {left:.0f} s of the budget left"}
            else:
                t0 = time.perf_counter()
                r = run_child(plan, left, env, Path(runs))
                r["elapsed_s"] = time.perf_counter() - t0
            if plan is not None:
                r.update(model=plan.model.name, micro_batch=plan.batch.micro_batch,
                         grad_accum=plan.batch.grad_accum, recompute=plan.config.train.recompute,
                         estimate_s=est, hardware=hardware(case, gpu))
            r["check"], r["note"] = check(case, r, done), note
            done[case.name] = r
            rows.append((i, case, r))
            record(args, i, case, r, rows)
    return rows


def record(args, i: int, case: Case, r: dict, rows: list) -> None:
    print(row(i, case, r), flush=True)
    if r.get("gross_peak_gib"):
        print(f"   gross peak {r['gross_peak_gib']:.2f} GiB (reserved {r['reserved_peak_gib']:.2f} + "
              f"{r['outside_allocator_gib']:.2f} outside the allocator), "
              f"printed {r['predicted']['peak_memory_gib']:.2f}")
    for site, gib in r.get("peak_breakdown", {}).get("by_site_gib", {}).items():
        print(f"   at the peak {gib:7.3f} GiB  {site}")
    if r.get("kernels", {}).get("total_ms"):
        k = r["kernels"]
        print(f"   profiled step's GPU time {k['total_ms']:.0f} ms: " + ", ".join(
            f"{kind} {ms:.0f}" for kind, ms in sorted(k["by_kind_ms"].items(), key=lambda kv: -kv[1])), flush=True)
    line = {"n": i, "case": case.name, "group": case.group, "overrides": list(case.overrides),
            **_common.machine(), **r}  # the child's machine (torch, GPU) over this process's
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(line, default=float) + "\n")
    r.pop("stderr_tail", None)  # kept in --out's line only
    if args.md:
        from usp.run.files import write_text_atomic

        write_text_atomic(Path(args.md), markdown(rows))


def plan_only(args, cases: list[tuple[int, Case, str]], gpu: tuple[str, float] | None) -> None:
    """What the session would run on this GPU: model, micro batch, the planner's figures, the time
    estimate of each case and where the budget ends."""
    with tempfile.TemporaryDirectory() as runs:
        planned = prepared(cases, gpu, runs)
    total, lines, out = 0.0, [], {}
    for i, case, plan, est, note in planned:
        if plan is None:
            out[case.name] = {"n": i, "error": "the planner predicts no micro batch fits"}
            lines.append(f"{i:>2} {case.name:<34} the planner predicts no micro batch fits")
            continue
        total += est
        t, peak = plan.timing, plan.memory.stages[plan.memory.peak_stage]
        tensor = (peak.total - peak.overhead) / 2**30
        fits = total <= args.budget_s
        out[case.name] = {"n": i, "model": plan.model.name, "micro_batch": plan.batch.micro_batch,
                          "grad_accum": plan.batch.grad_accum, "steps": case.steps, "estimate_s": est,
                          "cumulative_s": total, "in_budget": fits, "predicted_tokens_per_s": t.tokens_per_s,
                          "predicted_mfu": t.mfu, "predicted_tensor_gib": tensor, "on_cpu": case.on_cpu}
        lines.append(f"{i:>2} {case.name:<34} {plan.model.name:<12} {plan.batch.micro_batch:>2} x "
                     f"{plan.batch.grad_accum:<2} {case.steps:>3} steps  {t.tokens_per_s:>9,.0f} tok/s "
                     f"{t.mfu:>6.1%} {tensor:>6.1f} GiB  ~{est:>4.0f} s (total {total:>4.0f} s"
                     f"{'' if fits else ', past the budget'}) {note}".rstrip())
    head = [f"budget {args.budget_s:.0f} s; per case: model, micro batch x accumulation, steps, the planner's "
            "tokens/s, MFU and tensor memory, the time estimate (ESTIMATE_S + the planned steps)"]
    _common.emit({"budget_s": args.budget_s, "cases": out}, args, head + lines)


# -- what the rows imply for the planner (run here, on the JSONL the device wrote) -------------------

def fit(paths: list[str]) -> list[str]:
    """The constants the measured rows imply (one session's JSONL, or several: the later row of a case
    wins): cluster.timing.eager_overhead and eager_loss_ps_per_logit (eager_fit), cluster.timing.fp8_efficiency
    (the value at which the planner predicts the measured FP8 / bf16 speedup), and measured / planned
    tensor memory per row, as the session planned it and as this checkout's planner does."""
    rows = {r["case"]: r for path in paths for r in map(json.loads, Path(path).read_text().splitlines())
            if "tokens_per_s" in r}
    out = []
    with tempfile.TemporaryDirectory() as runs:
        for name, r in rows.items():
            if r.get("peak_memory_gib"):
                now = _planned_tensor_gib(r, runs)
                out.append(f"{name}: memory measured {r['peak_memory_gib']:.2f} GiB / planned "
                           f"{r['peak_memory_gib'] / r['predicted']['tensor_gib']:.3f} (as run), "
                           f"{r['peak_memory_gib'] / now:.3f} (this planner: {now:.2f} GiB)")
        out += eager_fit(rows, runs)
        for name, r in rows.items():
            ref = rows.get(str((r.get("check") or {}).get("ref")))
            if r["group"] == "fp8" and ref:
                speedup = r["tokens_per_s"] / ref["tokens_per_s"]
                value = _fp8_efficiency(r, ref, speedup, runs)
                out.append(f"{name}: {speedup:.3f}x bf16's tokens/s -> cluster.timing.fp8_efficiency = {value:.3f}")
    return out


def compute_share(row: dict, runs: str) -> float:
    """The share of the compiled step the planner puts in the micro batches' compute (the rest: the
    optimizer step, the fixed cost), the part eager_overhead scales."""
    timing = _common.plan_for(_row_overrides(row), 1, runs).timing
    return timing.compute_s / timing.step_s


def eager_fit(rows: dict, runs: str) -> list[str]:
    """cluster.timing.eager_overhead per model (the eager step's extra time over the compiled step's compute,
    same model and batch: the eager blocks and the eager loss together), and, with two models or more, the
    two apart: the eager step's extra time = eager_overhead x the compiled step's compute (its share planned)
    + eager_loss_ps_per_logit x the step's logits (least squares; the loss's share differs between models,
    the blocks' should not)."""
    matched = [(model, rows.get(f"{model} eager"), rows.get(f"{model} compiled")) for model in ("1b", "largest")]
    matched = [(m, e, c) for m, e, c in matched if e and c and e["model"] == c["model"]]
    out = [f"{m} ({e['model']}): cluster.timing.eager_overhead = "
           f"{(e['step_s'] - c['step_s']) / (c['step_s'] * compute_share(c, runs)):.3f} (blocks and loss together)"
           for m, e, c in matched]
    if len(matched) >= 2:
        pairs = []
        for _, eager, compiled in matched:
            plan = _common.plan_for(_row_overrides(compiled), 1, runs)
            logits = plan.timing.tokens_per_step * plan.model.vocab_size
            share = plan.timing.compute_s / plan.timing.step_s
            pairs.append((compiled["step_s"] * share, logits, eager["step_s"] - compiled["step_s"]))
        # the normal equations of extra = overhead x compute + per_logit x logits
        (tt, tn, tx), (nt, nn, nx) = [[sum(p[i] * p[j] for p in pairs) for j in (0, 1, 2)] for i in (0, 1)]
        det = tt * nn - tn * nt
        overhead, per_logit = (tx * nn - tn * nx) / det, (tt * nx - tx * nt) / det
        out.append(f"eager blocks and eager loss apart ({len(pairs)} models): cluster.timing.eager_overhead = "
                   f"{overhead:.3f}, cluster.timing.eager_loss_ps_per_logit = {per_logit * 1e12:.2f}")
    return out


def _row_overrides(r: dict, *extra: str) -> list[str]:
    """The overrides that plan a row again: the case's, its GPU's, the model, batch and recompute it ran
    (rows before 2026-11-28 have no recompute: they ran the default, none)."""
    chosen = r.get("recompute") and not any(o.startswith("train.recompute=") for o in r["overrides"])
    return [*r["overrides"], *r["hardware"], f"model={r['model']}",
            f"train.global_batch={r['micro_batch'] * r['grad_accum']}", f"train.micro_batch={r['micro_batch']}",
            *([f"train.recompute={r['recompute']}"] if chosen else []), *extra]


def _planned_tensor_gib(r: dict, runs: str) -> float:
    memory = _common.plan_for(_row_overrides(r), 1, runs).memory
    return (memory.peak.total - memory.peak.overhead) / 2**30


def _predicted_tokens_per_s(r: dict, runs: str, *extra: str) -> float:
    return _common.plan_for(_row_overrides(r, *extra), 1, runs).timing.tokens_per_s


def _fp8_efficiency(r: dict, ref: dict, speedup: float, runs: str) -> float:
    """Bisection (log scale) on fp8_efficiency: the planner's FP8/bf16 tokens/s ratio grows with it."""
    base = _predicted_tokens_per_s(ref, runs)
    lo, hi = 0.02, 4.0
    for _ in range(24):
        mid = (lo * hi) ** 0.5
        if _predicted_tokens_per_s(r, runs, f"cluster.timing.fp8_efficiency={mid}") / base < speedup:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--budget-s", type=float, help="stop before this many seconds (default 300; --smoke: 3600)")
    p.add_argument("--cases", help="run only these case numbers, e.g. 1-4,7 (--plan-only lists them)")
    p.add_argument("--plan-only", nargs=2, metavar=("GPU_NAME", "GIB"), help="no GPU needed: the cases, "
                   "their models, micro batches and time estimates on this GPU")
    p.add_argument("--smoke", action="store_true", help="the whole flow on CPU: tiny cases, FP8 skipped")
    p.add_argument("--fit", metavar="JSONL", nargs="+",
                   help="the planner constants a session's rows imply (no GPU needed; several JSONLs: one session)")
    out_dir = os.environ.get("OUT")
    p.add_argument("--out", default=f"{out_dir}/gpu_session.jsonl" if out_dir else None,
                   help="append each row as a JSON line (default: $OUT/gpu_session.jsonl when $OUT is set)")
    p.add_argument("--md", default=f"{out_dir}/gpu_session.md" if out_dir else None,
                   help="the session's table, rewritten after each row (default: $OUT/gpu_session.md)")
    p.add_argument("--run-plan", help=mfu.argparse_hidden())  # a child: train this plan, print its JSON
    args = p.parse_args()
    args.budget_s = args.budget_s or (3600.0 if args.smoke else 300.0)
    if args.run_plan:
        print(json.dumps(run_plan(args.run_plan), default=float))
        return
    if args.fit:
        print("\n".join(fit(args.fit)))
        return
    cases = all_cases()
    chosen = [(i, cases[i - 1], "") for i in select(cases, args.cases)]
    if args.smoke:
        chosen = [(i, *smoke_case(c)) for i, c, _ in chosen]
        chosen = [(i, c, note) if c else (i, Case(cases[i - 1].name, "skipped", (), 0), note) for i, c, note in chosen]
    gpu = (args.plan_only[0], float(args.plan_only[1])) if args.plan_only else None
    if args.plan_only:
        print(f"device command:\n  {DEVICE_COMMAND}\n", flush=True) if not args.json else None
        return plan_only(args, [c for c in chosen if c[1].group != "skipped"], gpu)
    env = dict(os.environ)
    if not args.smoke:
        from usp.launch.local import accelerator_env

        gpu, env = probe_gpu(), {**accelerator_env("cuda"), **env}
    session(args, chosen, gpu, env)


def probe_gpu() -> tuple[str, float]:
    """This GPU's name and memory, asked in a child process: a CUDA context in this one would hold
    ~0.5 GiB of the GPU through every case (exits 2, saying so, without a GPU)."""
    code = ("import json, sys, torch\n"
            "if not torch.cuda.is_available(): sys.exit(2)\n"
            "p = torch.cuda.get_device_properties(0)\n"
            "print(json.dumps([torch.cuda.get_device_name(), p.total_memory / 2**30]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        print("gpu_session.py measures on a GPU and needs a CUDA device; none is visible here (--plan-only and "
              f"--smoke need none){': ' + proc.stderr.strip()[-300:] if proc.returncode != 2 else ''}",
              file=sys.stderr)
        sys.exit(2)
    name, gib = json.loads(proc.stdout.strip().splitlines()[-1])
    return name, float(gib)


DEVICE_COMMAND = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
                  "--target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit; nvidia-smi -L; "
                  "PYTHONUNBUFFERED=1 python3 scripts/bench/gpu_session.py --budget-s 300 2>&1 "
                  "| tee $OUT/gpu_session.log")


if __name__ == "__main__":
    main()
