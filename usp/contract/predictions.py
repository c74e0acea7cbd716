"""What the planner predicts, as the plan records it: memory per rank and pipeline stage
(usp/perf/memory.py computes it), the step time and its parts (usp/perf/timing.py). Plain records:
`usp plan` renders them, plan.yaml keeps them, the engine's memory probe and `usp report` compare a
run against them."""
from __future__ import annotations

from dataclasses import dataclass, field

TERMS = ("parameters", "gradients", "optimizer", "activations", "logits", "gathered", "copies", "comm_buffers",
         "overhead")
TERM_LABELS = {
    "parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer states",
    "activations": "activations", "logits": "logits + loss", "gathered": "FSDP all-gathered params",
    "copies": "bf16 weight copies (autocast)",
    "comm_buffers": "comm buffers (DDP buckets)", "overhead": "framework overhead",
}


@dataclass
class LocalBytes:
    """What one rank allocates for its model states, each whole, whatever the peak phase: what
    `usp plan --build-check` measures on the engine's real (meta) build."""

    params: float  # elements of its parameters: its shards under FSDP2 (ZeRO-2/3, HSDP), else whole tensors
    parameters: float  # bytes
    gradients: float  # bytes of their gradients after the step's reduction (each shaped as its parameter)
    optimizer: float  # bytes of the optimizer's states (sharded under ZeRO-1/2/3)


@dataclass
class StageMemory:
    stage: int  # pp rank
    first_rank: int
    n_ranks: int  # ranks of this pp rank (all with the same memory)
    virtual_stages: list[int]
    layers: int
    holds_embedding: bool
    holds_head: bool
    params: int  # parameters on one rank of this stage (after TP / EP slicing, before data-parallel sharding)
    in_flight: float  # micro batches alive at the peak (units of this rank's layers)
    activation_per_layer: float  # bytes, one layer, one micro batch (stored between forward and backward)
    peak_phase: str = ""  # "loss backward" | "layer backward": the moment of the peak (module docstring)
    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    gathered: float = 0.0
    copies: float = 0.0
    comm_buffers: float = 0.0
    overhead: float = 0.0
    total: float = 0.0
    build: BuildMemory | None = None  # while the engine builds (and loads) this rank's part: memory_plan
    local: LocalBytes | None = None  # its model states as allocated (the build check's comparison)

    def top(self, n: int = 3) -> list[tuple[str, float]]:
        terms = sorted(((TERM_LABELS[t], getattr(self, t)) for t in TERMS), key=lambda kv: -kv[1])
        return terms[:n]

    def key(self) -> tuple:
        return (*(round(getattr(self, t)) for t in TERMS), round(self.build.total) if self.build else 0)


@dataclass
class MemoryPlan:
    dtype: str
    dp_kind: str
    zero_stage: int
    shard_degree: int
    recompute: str
    capacity_gib: float
    device_name: str
    stages: list[StageMemory]
    peak_stage: int
    peak_gib: float
    fits: bool
    activation_formula: str
    assumptions: list[str] = field(default_factory=list)
    build_peak_stage: int = 0  # the pp rank whose build needs the most (StageMemory.build)
    build_peak_gib: float = 0.0
    build_fits: bool = True

    @property
    def peak(self) -> StageMemory:
        return self.stages[self.peak_stage]

    def distinct_stages(self) -> list[StageMemory]:
        """Stage 0, the peak and the last stage, without repeats (what the tables show)."""
        picks = sorted({0, self.peak_stage, len(self.stages) - 1})
        out, seen = [], set()
        for i in picks:
            key = self.stages[i].key()
            if key not in seen:
                seen.add(key)
                out.append(self.stages[i])
        return out


@dataclass
class BuildMemory:
    """One rank of a pp rank while the engine builds its part (usp/engine/parallel/materialize.py:
    its shards allocated, then every parameter's whole value made and cut one at a time), or loads
    model.init_from into them, each rank reading its own part (usp/engine/hf_checkpoint.py)."""

    params: float  # elements this rank allocates: its shards (FSDP2 kinds), else its stages whole
    parameters: float  # their bytes (fp32)
    largest: str  # the largest parameter the rank holds, by name (its whole tensor is made at once)
    largest_params: int  # that whole tensor's elements
    read_buffer: float  # model.init_from: the largest part of a parameter as read (stacked experts: twice)
    transient: float  # bytes alive besides the parameters: the whole fp32 value (x DTENSOR_TRANSIENT), or the load's
    overhead: float
    total: float


@dataclass
class CommTerm:
    name: str
    dims: str  # mesh dims of the group
    group: int  # ranks in the group
    crosses_nodes: bool
    gbps: float  # the bandwidth the group's traffic runs at, per rank
    calls: int  # collective calls per step
    bytes_per_step: float  # on the wire, per rank
    seconds: float
    window_s: float  # compute it can hide behind
    exposed_s: float


@dataclass
class TimingPlan:
    dtype: str
    peak_tflops: float
    tokens_per_step: int
    model_flops_per_token: float  # 6·N_active + 12·L·h·s (the MFU numerator)
    hw_flops_per_token: float  # + the recomputed forward
    model_flops_per_step: float
    hw_flops_per_step: float
    efficiency: float  # FLOPs / (peak x matmul time) on the busiest pp rank
    efficiency_terms: dict
    micro_batch_s: float  # busiest pp rank, one micro batch forward + backward (+ recompute) + fixed cost
    compute_s: float  # m micro batches on the busiest pp rank
    bubble_fraction: float
    bubble_s: float
    comm: list[CommTerm]
    exposed_path_comm_s: float  # TP / CP / EP / PP, on the pipeline's critical path
    exposed_dp_comm_s: float
    fixed_s: float  # optimizer step + per-step fixed cost
    step_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    mfu: float
    hfu: float
    world: int
    profile: str = "usp"
    mfu_band: tuple | None = None  # (low, high) from the calibration's residuals; None = never calibrated
    calibration: list[str] = field(default_factory=list)  # how far to trust the figures (calibration notes)
    assumptions: list[str] = field(default_factory=list)


@dataclass
class TorchftGoodput:
    """The same plan's goodput if its replica groups trained through a failure (torchft)."""
    groups: int  # replica groups: the data-parallel replicate degree
    group_restart_s: float  # one group's restart: job start, rendezvous, build, heal (no load)
    heal_s: float  # a rank's state copied from a live peer over the inter-node link
    goodput: float


@dataclass
class GoodputPlan:
    """Failures, checkpoints and restarts (usp/perf/goodput.py): what share of the wall time trains."""
    node_mtbf_hours: float  # cluster.reliability.node_mtbf_hours
    job_mtbf_s: float  # mean seconds between failures of the whole job (node MTBF / nodes)
    failures_per_day: float
    written_bytes: float  # one checkpoint, each tensor once
    read_bytes: float  # one load, every rank its own state
    save_write_s: float  # the checkpoint's write (in the background under async)
    save_blocking_s: float  # what a save stops training for
    load_s: float
    restart_s: float  # a failure to training again: the restart_terms' sum
    restart_terms: dict[str, float]
    interval_auto: bool  # checkpoint.interval=auto: interval_steps is the Young–Daly interval
    interval_steps: int  # steps between checkpoints (0: only at the end, or none)
    interval_s: float  # training between saves (the whole run when there are none in between)
    young_daly_s: float  # √(2 · save_blocking_s · job_mtbf_s)
    young_daly_steps: int
    lost_per_failure_s: float  # the restart plus half a checkpoint period
    goodput: float  # expected training time / wall time when every failure restarts the job
    torchft: TorchftGoodput | None = None  # a layout with replica groups: the same with torchft
    notes: list[str] = field(default_factory=list)
    mode: str = "restart"  # restart (every rank restarts from the checkpoint) | torchft (fault_tolerance=torchft)

    @property
    def expected(self) -> float:
        """The goodput this run expects: torchft's under fault_tolerance=torchft, else restart-only's."""
        return self.torchft.goodput if self.mode == "torchft" and self.torchft is not None else self.goodput
