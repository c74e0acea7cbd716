"""A cluster's time constants (`cluster.timing`): the GPU's and the network's figures the planner's
time model (usp/perf/timing.py) needs beyond the datasheet's peak FLOP/s, memory and link
bandwidths, and what they were fitted on. A training stack's own constants (host costs, fused
kernels, overlaps) are not here: they belong to its profile (usp/perf/stack_profile.py), so a fit of
one stack's runs on one cluster cannot move another hardware's prediction. `usp calibrate`
(usp/perf/calibration/calibrate.py) fits them from measured runs; docs/planner.md says where each
catalogue value comes from. Pure Python."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Calibrated:
    """What the constants were fitted on: `usp plan` derives its uncertainty band from the residuals
    and says when a layout lies outside (a node count or a feature never measured)."""

    source: str = ""  # "" = never calibrated
    runs: int = 0
    nodes: tuple = ()  # node counts measured
    features: tuple = ()  # layout features measured (usp.perf.timing.layout_features of each run)
    fitted: tuple = ()  # the constants the fit moved (cluster.timing fields, <profile>.<field> for a stack's)
    stacks: tuple = ()  # the profiles the runs were trained with
    mfu_abs_err_p50: float = 0.0  # MFU points, fit residuals
    mfu_abs_err_p90: float = 0.0
    rel_err_p50: float = 0.0  # median |predicted / measured - 1|
    ratio_p10: float = 1.0  # predicted / measured MFU, 10th and 90th percentile
    ratio_p90: float = 1.0


@dataclass(frozen=True)
class TimeConstants:
    # --- the GPU: a matmul of M x K by K x N takes 2MNK / (peak x clock x gemm_efficiency x K/(K + gemm_half_k))
    # + gemm_fixed_us (usp.perf.timing.gemm_s); docs/planner.md "Time per step"
    gemm_efficiency: float = 0.5  # share of the peak a matmul with a long reduction (K) reaches
    gemm_half_k: float = 0.0  # reduction length K at which a matmul runs at half that rate
    gemm_fixed_us: float = 0.0  # fixed cost per matmul kernel (launch, ramp, tail)
    fp8_efficiency: float = 1.0  # an FP8 matmul's gemm_efficiency relative to bf16's, at the FP8 peak
    fp8_half_k: float = 0.0  # gemm_half_k of FP8 matmuls (0: gemm_half_k)
    attention_half_seq: float = 0.0  # sequence length at which flash attention reaches half its plateau (0: none)
    clock: float = 1.0  # sustained tensor-core clock / the one the peak is quoted at (a power-capped part < 1)
    interference: float = 0.0  # compute slowed by this many seconds per second of communication it hides
    # --- the network (NCCL): a collective of S bytes over n ranks, g per node (usp.perf.timing.collective_s)
    nvlink_efficiency: float = 1.0  # bus bandwidth / intra_node_gbps inside a node
    nic_efficiency: float = 1.0  # bus bandwidth / inter_node_gbps per NIC
    intra_latency_us: float = 10.0  # latency per ring step inside a node
    inter_latency_us: float = 25.0  # latency per ring step across nodes
    all_reduce: str = "auto"  # ring | tree | auto (the faster of the two for each message, as NCCL's tuner picks)
    in_network_reduction: bool = False  # all-reduce through NVLS / SHARP: S on the wire instead of 2(n-1)/n S
    # --- usp's own engine on this GPU, measured (docs/planner.md "Compile and FP8"): only profiles that follow
    # train.compile (usp) read them
    eager_overhead: float = 0.0  # eager blocks: (1 + this) x a compiled micro batch's time; 0 = not modelled
    eager_loss_ps_per_logit: float = 0.0  # an eager loss's extra time per logit over the compiled loss
    calibrated: Calibrated = field(default_factory=Calibrated)

    @classmethod
    def from_config(cls, node) -> TimeConstants:
        if node is None:
            return cls()

        def g(key: str, default=None):
            return getattr(node, key, default)

        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name != "calibrated":
                kind = bool if isinstance(f.default, bool) else str if isinstance(f.default, str) else float
                kw[f.name] = kind(g(f.name, f.default))
        return cls(**kw, calibrated=_calibrated(g("calibrated")))

    def fitted(self) -> dict:
        """The constants by name (what `usp calibrate` writes)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "calibrated"}


def _calibrated(node) -> Calibrated:
    if node is None:
        return Calibrated()

    def g(key: str, default=None):
        return getattr(node, key, default)

    return Calibrated(source=str(g("source", "") or ""), runs=int(g("runs", 0) or 0),
                      nodes=tuple(int(n) for n in (g("nodes", ()) or ())),
                      features=tuple(str(f) for f in (g("features", ()) or ())),
                      fitted=tuple(str(f) for f in (g("fitted", ()) or ())),
                      stacks=tuple(str(f) for f in (g("stacks", ()) or ())),
                      mfu_abs_err_p50=float(g("mfu_abs_err_p50", 0.0)),
                      mfu_abs_err_p90=float(g("mfu_abs_err_p90", 0.0)),
                      rel_err_p50=float(g("rel_err_p50", 0.0)),
                      ratio_p10=float(g("ratio_p10", 1.0)), ratio_p90=float(g("ratio_p90", 1.0)))
