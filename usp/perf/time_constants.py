"""A cluster's time constants (`cluster.timing`): the few physical figures the planner's time model
(usp/perf/timing.py) needs beyond the nominal peak FLOP/s and link bandwidths, and what they were
fitted on. `usp calibrate` (usp/perf/calibration/calibrate.py) fits them from measured runs; the defaults are
uncalibrated round figures. Pure Python."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class Calibrated:
    """What the constants were fitted on: `usp plan` derives its uncertainty band from the residuals
    and says when a layout lies outside (a node count or a feature never measured)."""

    source: str = ""  # "" = never calibrated
    runs: int = 0
    nodes: tuple = ()  # node counts measured
    features: tuple = ()  # layout features measured (usp.perf.timing.layout_features of each run)
    mfu_abs_err_p50: float = 0.0  # MFU points, fit residuals
    mfu_abs_err_p90: float = 0.0
    ratio_p10: float = 1.0  # predicted / measured MFU, 10th and 90th percentile
    ratio_p90: float = 1.0


@dataclass(frozen=True)
class TimeConstants:
    kernel_efficiency: float = 0.50  # fraction of peak a large matmul reaches
    kernel_half_tokens: float = 128.0  # tokens per micro batch (b·s/cp) at which a matmul reaches half of it
    kernel_half_dim: float = 128.0  # output width (h/tp, ffn/tp, V/tp) at which a matmul reaches half of it
    intra_hop_us: float = 10.0  # latency of one ring step inside a node
    inter_hop_us: float = 25.0  # latency of one ring step between nodes
    call_overhead_us: float = 0.0  # fixed cost per collective call (launch, stream sync, host)
    p2p_us: float = 0.0  # extra fixed cost of a pipeline send/recv pair (handshake, host sync)
    layer_overhead_us: float = 0.0  # fixed cost per layer and micro batch, forward + backward (launches, host)
    step_overhead_ms: float = 0.0  # fixed cost per optimizer step (gradient clipping, host sync, logging)
    # a blocking pipeline send/recv's stall (usp.perf.timing.pipeline_stall_s): up to p2p_stall_ms per op,
    # growing steeply with the job's node count and as the fullest stage's memory nears the device's
    p2p_stall_ms: float = 0.0  # 0 = none
    p2p_stall_nodes: float = 32.0  # node count at which the stall reaches half of p2p_stall_ms
    p2p_stall_headroom: float = 0.1  # free share of device memory at which it reaches half of it
    p2p_stall_exp: float = 4.0  # how steeply it grows (both causes)
    optimizer_gbps: float = 0.0  # memory bandwidth the optimizer step streams its states at; 0 = not modelled
    # the LM head's loss (softmax cross-entropy, forward + backward) streams the micro batch's logits
    # (tokens x vocabulary/tp) through memory several times, in fp32 where the recipe upcasts them
    loss_ps_per_logit: float = 0.0  # picoseconds per logit on the last stage; 0 = not modelled
    # train.compile off: an eager micro batch takes (1 + eager_overhead) x a compiled one's time (unfused
    # elementwise kernels, launches); measured per GPU (docs/planner.md "Compile and FP8"); 0 = not modelled
    eager_overhead: float = 0.0
    # where the loss runs eagerly (train.compile off, or TP's vocab-parallel loss): its extra time per logit
    # over the compiled loss (usp/engine/loss.py), which reads the bf16 logits once where eager writes and
    # reads fp32 copies; measured per GPU like eager_overhead; 0 = not modelled
    eager_loss_ps_per_logit: float = 0.0
    # train.fp8: a converted matmul reaches fp8_efficiency x kernel_efficiency of the FP8 peak (its casts and
    # scales included); 1.0 = uncalibrated (the same share of its peak as a bf16 matmul)
    fp8_efficiency: float = 1.0
    calibrated: Calibrated = field(default_factory=Calibrated)

    @classmethod
    def from_config(cls, node) -> TimeConstants:
        if node is None:
            return cls()
        def g(key: str, default=None):
            return getattr(node, key, default)

        cal = g("calibrated")
        kw = {f.name: float(g(f.name, f.default)) for f in fields(cls) if f.name != "calibrated"}
        return cls(**kw, calibrated=_calibrated(cal))

    def fitted(self) -> dict:
        """The fitted numbers, by name (what `usp calibrate` writes)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "calibrated"}


def _calibrated(node) -> Calibrated:
    if node is None:
        return Calibrated()
    def g(key: str, default=None):
        return getattr(node, key, default)

    return Calibrated(source=str(g("source", "") or ""), runs=int(g("runs", 0) or 0),
                      nodes=tuple(int(n) for n in (g("nodes", ()) or ())),
                      features=tuple(str(f) for f in (g("features", ()) or ())),
                      mfu_abs_err_p50=float(g("mfu_abs_err_p50", 0.0)),
                      mfu_abs_err_p90=float(g("mfu_abs_err_p90", 0.0)),
                      ratio_p10=float(g("ratio_p10", 1.0)), ratio_p90=float(g("ratio_p90", 1.0)))
