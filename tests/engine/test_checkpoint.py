"""summary.json never holds NaN or Infinity (not JSON): the trainer writes null instead."""
from __future__ import annotations

import json


def _no_nan(name: str):
    raise AssertionError(f"{name} in summary.json (not JSON)")


def test_summary_never_holds_nan():
    from usp.engine.trainer import finite_or_null

    summary = finite_or_null({"steps": 3, "final_loss": float("nan"), "first_loss": float("inf"), "tokens_per_s": 2.5,
                              "final_val_loss": None})
    assert summary == {"steps": 3, "final_loss": None, "first_loss": None, "tokens_per_s": 2.5, "final_val_loss": None}
    json.loads(json.dumps(summary, allow_nan=False), parse_constant=_no_nan)
