"""The optimizers and learning-rate schedules a config may name (usp.plan.rules checks the values; the
settings and the curve the engine builds from are usp/contract/schedule.py's)."""
from __future__ import annotations

OPTIMIZERS = ("adamw", "adam", "sgd")
# Known, but refused, with the reason measured (2 ranks, FSDP2 on gloo, torch 2.13).
REFUSED_OPTIMIZERS = {
    "adafactor": "torch.optim.Adafactor fails on the DTensor parameters of FSDP2 (and TP): its factored row / "
                 "column statistics are partial norms that it updates in place (\"aten.pow_.Scalar: in-place "
                 "operations that require placement changes are not supported\"; the same with foreach)",
}
SCHEDULES = ("cosine", "linear", "constant", "wsd")  # wsd: warmup, stable (flat), decay
