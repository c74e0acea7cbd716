"""The rules behind the engine's choices, each once: the planner calls them (its memory and time
model, and `decisions`, usp/plan/plan.py) and records the outcome in the plan (RunPlan.decisions);
the engine reads that record and never calls these (tests/unit/test_architecture.py). Pure
Python, from plain values: a plan.yaml of the previous format is brought up to date with them
(usp/contract/plan_file.py)."""
from __future__ import annotations

import math
from pathlib import Path

from usp.contract.config_schema import UspConfig
from usp.contract.dims import FSDP_KINDS, data_parallel_kind
from usp.contract.run_plan import HangWindow
from usp.contract.schedule import OptimSettings

COMPILE_CHOICES = ("auto", "true", "false")  # train.compile
ATTENTION_CHOICES = ("sdpa", "flash_attn")  # model.attention (usp/engine/accel.py installs them)


def uses_bf16(dtype: str, device: str) -> bool:
    """train.dtype=auto means bf16 on an accelerator, fp32 on CPU."""
    return dtype == "bf16" or (dtype == "auto" and device != "cpu")


def compile_choice(value) -> str | None:
    """train.compile as one of COMPILE_CHOICES ("auto", "true", "false"), or None for anything else
    (YAML and the command line give booleans; a string works too)."""
    text = str(value).lower()
    return text if text in COMPILE_CHOICES else None


# torch.distributed.pipelining refuses stage modules that went through torch.compile under these
# schedules (_check_torch_compile_compatibility in torch 2.13: ScheduleInterleavedZeroBubble,
# ScheduleZBVZeroBubble): found by `usp plan --build-check` of a zbv layout on CUDA
NO_COMPILE_SCHEDULES = ("interleaved_zb", "zbv")


def uses_compile(value, device: str, pp_schedule: str = "1f1b", pp: int = 1) -> bool:
    """train.compile: per-block torch.compile, or eager. auto is on for CUDA, where it measured faster
    (Llama-3.2 1B on an H200: 49.0 % MFU compiled, 40.8 % eager, docs/benchmarks.md), and off elsewhere:
    on CPU inductor's C++ build costs more than a short run gains, XPU was never measured; and off
    under a zero-bubble pipeline schedule, which torch runs only eager (true is refused there)."""
    choice = compile_choice(value)
    eager_schedule = int(pp) > 1 and str(pp_schedule) in NO_COMPILE_SCHEDULES
    return choice == "true" or (choice == "auto" and device == "cuda" and not eager_schedule)


def compiles_loss(compiled: bool, tp: int) -> bool:
    """The loss is compiled with the blocks, unless TP shards the vocabulary (loss_parallel's cross
    entropy runs on DTensors eagerly; usp/engine/loss.py)."""
    return compiled and tp == 1


def autocast_weight_cache(recompute: str) -> bool:
    """Does the trainer's autocast keep its cache of bf16 weight copies (each weight cast once per
    forward, the copy held until the context exits)? Only without recompute: a recomputed layer
    casts again anyway, and a cache would hold every layer's copy through the loss (a pipeline's
    context: the whole step). Without recompute each linear saves its copy for backward anyway,
    and a pipeline's in-flight micro batches share the cached one."""
    return recompute == "none"


def uses_deterministic(configured: bool | None, device: str) -> bool:
    """train.deterministic, or by default: on for CPU (exact parity, resume), off on an accelerator
    (its deterministic kernels are slower). The engine sets the flag, the launcher its environment."""
    return device == "cpu" if configured is None else bool(configured)


def bf16_by_fsdp_policy(dp_kind: str, pp: int, ep: int) -> bool:
    """Under bf16, does FSDP2's MixedPrecisionPolicy compute in bf16 (parameters gathered in bf16,
    gradients reduced in fp32) rather than the trainer's autocast? FSDP/HSDP layouts without pipeline
    or expert parallelism, as torchtitan: stage boundaries and expert all-to-alls expect the fp32
    parameters' dtype."""
    return dp_kind in FSDP_KINDS and pp == 1 and ep == 1


def gathers_parameters(dp_kind: str, ep: int, group_dp_kind: str | None = None) -> bool:
    """Does a rank allocate and free parameter-sized blocks every step? FSDP2 does (its gathered units,
    also inside a torchft replica group: group_dp_kind), and so do expert-parallel experts (their own
    FSDP2 units). DDP, ZeRO-1, TP and PP keep their parameters and gradient buckets all run long. A CPU
    rank's glibc thresholds follow it (usp/run/allocator.py; usp.perf.memory counts what they keep)."""
    return dp_kind in FSDP_KINDS or group_dp_kind in FSDP_KINDS or ep > 1


def cpu_memory_first(dp_kind: str, ep: int, pp: int, group_dp_kind: str | None = None) -> bool:
    """Does a CPU rank train under a low glibc mmap threshold, its large blocks mapped and unmapped each step
    (memory first), rather than glibc's ceiling, its activations reused from the heap (speed first)? Where
    it gathers parameters, and where it pipelines: the schedule frees micro batches' activations out of the
    order it allocated them, and a heap that kept them kept their holes too (pp 2: stage 1 at 1.09 of its
    plan under the ceiling, 1.03-1.04 under the low threshold, whose plan counts no heap top; docs/benchmarks.md
    "Heap holes").
    usp/run/allocator.py sets the thresholds, usp.perf.memory counts what they keep."""
    return gathers_parameters(dp_kind, ep, group_dp_kind) or pp > 1


def padded_vocab(vocab: int, tp: int) -> int:
    """The embedding's (and LM head's) rows: the vocabulary rounded up to a multiple of tp, so TP's
    vocabulary shards are even; the padded rows are masked out of the loss."""
    return -(-vocab // tp) * tp


def engine_choices(config: UspConfig, degrees: dict[str, int], device: str, vocab: int, run_dir: str) -> dict:
    """What the engine does with a resolved config on `degrees` and `device`, the vocabulary `vocab`, in
    `run_dir`: RunPlan.decisions' fields (usp/contract/run_plan.py)."""
    train, model = config.train, config.model
    kind = data_parallel_kind(degrees, bool(config.parallelism.zero1))
    bf16 = uses_bf16(str(train.dtype), device)
    by_fsdp = bf16 and bf16_by_fsdp_policy(kind, int(degrees["pp"]), int(config.parallelism.ep))
    compiled = uses_compile(train.compile, device, str(config.parallelism.pp_schedule), int(degrees["pp"]))
    recompute = str(train.recompute)
    return {"dp_kind": kind, "bf16": bf16, "fsdp_mixed_precision": by_fsdp, "autocast": bf16 and not by_fsdp,
            "autocast_weight_cache": autocast_weight_cache(recompute), "compile": compiled,
            "compiled_loss": compiles_loss(compiled, int(degrees["tp"])), "fp8": str(train.fp8),
            "deterministic": uses_deterministic(train.deterministic, device), "recompute": recompute,
            "attention": str(model.attention), "moe": int(model.n_experts) > 0,
            "embedding_rows": padded_vocab(int(vocab), int(degrees["tp"])),
            "optimizer": OptimSettings.from_config(config.optimizer, config.train.steps),
            "checkpoint_dir": str(Path(config.checkpoint.dir or Path(run_dir) / "checkpoints").expanduser()),
            "tokenizer": str(config.data.tokenizer),
            "straggler_measure": "" if replica_groups(config) else
            straggler_measure(kind, math.prod(int(d) for d in degrees.values()), device)}


def replica_groups(config: UspConfig) -> bool:
    """fault_tolerance=torchft: the straggler detector is off (each replica group runs its own loop,
    usp/engine/fault_tolerance.py, and compares no work with the others); the hang watchdog watches each
    group's ranks on their own, its files named by replica group (docs/hangs.md#under-torchft)."""
    return str(config.fault_tolerance.kind) == "torchft"


def torchft_wait_s(timeout_s: float, join_timeout_s: float, heartbeat_timeout_s: float) -> float:
    """fault_tolerance=torchft: how long a live replica group's step may wait for a group that stopped,
    before it trains on without it: a collective between the groups times out (fault_tolerance.timeout_s),
    then the quorum leaves out a group that heartbeats but does not join (join_timeout_s) or that went
    silent (heartbeat_timeout_s), all fault_tolerance.*. A hang window at most this long would call the
    live groups hung too."""
    return float(timeout_s) + float(join_timeout_s) + float(heartbeat_timeout_s)


def straggler_measure(dp_kind: str, world: int, device: str) -> str:
    """What each rank times to find a straggler: the work in its steps, never its waits for the
    others (in a synchronous step every rank takes the same wall time: the collectives make the fast
    ones wait for the slowest). On CPU, "runnable": the time its threads ran or waited for a CPU
    (Linux schedstat), which a rank blocked in a collective doesn't accrue. On an accelerator, the
    parts of a step that wait for no other rank: reading the batch and the optimizer step (device
    events), "data+optimizer"; "data" under ZeRO-1, whose optimizer step broadcasts inside it. ""
    on one process: nothing to compare (docs/hangs.md#stragglers)."""
    if world < 2:
        return ""
    if device == "cpu":
        return "runnable"
    return "data" if dp_kind == "zero1" else "data+optimizer"


HANG_FLOOR_S = 120.0  # a derived window is never shorter: a GC pause, a slow NFS read or a page-cache miss is no hang
HANG_TIMEOUT_SHARE = 0.5  # a derived window stays under half of cluster.timeout_s, so the watchdog speaks first
PHASE_TIMEOUT_SHARE = 0.75  # no phase's allowance reaches the collective timeout either
FIRST_STEP_FACTOR = 10.0  # the first step of a launch compiles, warms up and initialises communicators lazily
CHECKPOINT_BYTES_PER_S = 1e9  # a slow shared file system's write rate, for a checkpoint's own allowance
GRACE_MAX_S = 60.0


def hang_window(config: UspConfig, world: int, predicted_step_s: float | None,
                checkpoint_bytes: float) -> tuple[HangWindow | None, str | None]:
    """When a rank counts as hung (RunPlan.decisions.hang), and a plan warning when the derived window
    had to be shortened below the collective timeout. None: one process (no collective to hang in),
    train.hang_timeout_s=0. The window is train.hang_timeout_s, else train.hang_factor x the predicted
    step time x the calibration's worst measured/predicted ratio (cluster.timing.calibrated ratio_p90), at
    least HANG_FLOOR_S (under torchft also twice torchft_wait_s) and at most HANG_TIMEOUT_SHARE x
    cluster.timeout_s. `world`: the ranks of one replica group under torchft."""
    train = config.train
    if world < 2 or train.hang_timeout_s == 0:
        return None, None
    if train.hang_timeout_s is not None:
        step_s, source, warning = float(train.hang_timeout_s), "train.hang_timeout_s", None
    else:
        step_s, source, warning = _derived_window(config, float(predicted_step_s or 0.0))
    # A phase that outlasts the collective timeout fails the run anyway (a peer waits in a collective
    # meanwhile): its allowance ends before, so the watchdog still names the rank.
    ceiling = max(step_s, PHASE_TIMEOUT_SHARE * float(config.cluster.timeout_s))
    window = HangWindow(step_s=step_s, first_step_s=min(ceiling, FIRST_STEP_FACTOR * step_s),
                        eval_s=min(ceiling, step_s * (1 + int(train.eval_batches))),
                        checkpoint_s=min(ceiling, step_s + checkpoint_bytes / CHECKPOINT_BYTES_PER_S),
                        grace_s=min(step_s, GRACE_MAX_S), poll_s=min(5.0, max(0.1, step_s / 20)), source=source)
    return window, warning


def _derived_window(config: UspConfig, predicted: float) -> tuple[float, str, str | None]:
    """train.hang_factor x the predicted step (x the calibration's slack), floored and capped."""
    train, cluster = config.train, config.cluster
    calibrated = cluster.timing.calibrated
    slack = max(1.0, float(calibrated.ratio_p90)) if calibrated.source else 1.0
    derived = float(train.hang_factor) * predicted * slack
    ft = config.fault_tolerance
    floor = max(HANG_FLOOR_S, 2 * torchft_wait_s(ft.timeout_s, ft.join_timeout_s, ft.heartbeat_timeout_s)) \
        if replica_groups(config) else HANG_FLOOR_S
    step_s = max(floor, derived)
    source = (f"train.hang_factor={train.hang_factor:g} x predicted step {predicted:.3g} s"
              + (f" x calibration slack {slack:.2f}" if slack > 1 else "") + f" = {derived:.3g} s"
              + (f", raised to the {floor:g} s floor" if derived < floor else ""))
    cap = HANG_TIMEOUT_SHARE * float(cluster.timeout_s)
    if step_s <= cap:
        return step_s, source, None
    warning = (f"the hang window ({step_s:.0f} s) is shortened to {cap:g} s, half of cluster.timeout_s="
               f"{cluster.timeout_s}, so that a hang is named before the collective times out (docs/hangs.md); "
               "set train.hang_timeout_s, or raise cluster.timeout_s")
    return cap, f"{source}, shortened to half of cluster.timeout_s", warning


def fault_tolerance_plan(config: UspConfig, degrees: dict[str, int], nodes: int, procs_per_node: int) -> dict | None:
    """RunPlan.fault_tolerance's fields (None for fault_tolerance=none): the dp_replicate ranks become
    replica groups, each a job of its own with the rest of the layout (the rules have checked that the
    groups fill whole nodes, or share one node evenly)."""
    ft = config.fault_tolerance
    if str(ft.kind) != "torchft":
        return None
    groups = int(degrees["dp_replicate"])
    group = {**degrees, "dp_replicate": 1}
    group_world = nodes * procs_per_node // groups
    group_nodes = nodes // groups if nodes >= groups else 1
    return {"kind": "torchft", "replica_groups": groups, "min_replicas": int(ft.min_replicas),
            "group_world_size": group_world, "group_nodes": group_nodes,
            "group_procs_per_node": group_world // group_nodes, "group_degrees": group,
            "group_dp_kind": data_parallel_kind(group, bool(config.parallelism.zero1)),
            "timeout_s": int(ft.timeout_s), "heartbeat_timeout_s": float(ft.heartbeat_timeout_s),
            "quorum_timeout_s": int(ft.quorum_timeout_s), "join_timeout_s": float(ft.join_timeout_s),
            "start_timeout_s": int(ft.start_timeout_s), "max_group_restarts": int(ft.max_group_restarts),
            "lighthouse_port": int(ft.lighthouse_port)}
