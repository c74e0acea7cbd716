#!/usr/bin/env python
"""The planner's out-of-memory verdict on real runs: each row of a measured sweep (the Ultra-Scale
Playbook's nanotron runs on 8xH100 nodes: model, nodes, dp/tp/pp, gas, mbs, zero, status, mem_gb)
becomes a usp layout (model shape from the archs CSV next to it, dp -> dp_replicate, zero=1 ->
parallelism.zero1=true, seq 4096, bf16, no recompute, 1F1B, cluster=slurm_h100 with the run's node
count), and the planner's memory model (usp.plan.memory.memory_plan, no rules: a layout the
engine refuses still has a predicted peak) says whether it fits. Counts the runs that measured
ok but are predicted out of memory, per (zero, tp/pp) group. Pure Python, no torch.

    python scripts/bench/calibration_sweep.py SWEEP.csv [--archs ARCHS.csv] [--json] [--list]

--archs defaults to playbook_model_archs.csv beside SWEEP.csv; --list prints every such run.
"""
from __future__ import annotations

import csv
import sys
from collections import Counter
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from usp.config.compose import compose_config  # noqa: E402
from usp.plan.context import planner_context  # noqa: E402
from usp.plan.memory import memory_plan  # noqa: E402
from usp.plan.specs import Layout  # noqa: E402

SEQ_LEN = 4096


def model_overrides(arch: dict) -> list[str]:
    """One row of the archs CSV as model.* overrides (a Llama shape; nanotron's are Llama's)."""
    return ["model=llama3_2_1b", f"model.name={arch['model']}", f"model.dim={arch['hidden']}",
            f"model.n_layers={arch['layers']}", f"model.n_heads={arch['heads']}",
            f"model.n_kv_heads={arch['kv_heads']}", f"model.ffn_dim={arch['ffn']}",
            f"model.vocab_size={arch['vocab']}", f"model.tie_embeddings={arch['tie_word_embeddings'].lower()}"]


@cache
def context(arch_items: tuple, nodes: int):
    overrides = model_overrides(dict(arch_items)) + [
        "cluster=slurm_h100", f"cluster.nodes={nodes}", f"train.seq_len={SEQ_LEN}", "train.dtype=bf16"]
    cfg, _ = compose_config(None, overrides)
    return planner_context(cfg)


def predict(row: dict, archs: dict) -> tuple[bool, float, str]:
    """(fits, predicted peak GiB incl. overhead, the planner's data-parallel label) for one run."""
    ctx = context(tuple(sorted(archs[row["model"]].items())), int(row["nodes"]))
    layout = Layout(pp=int(row["pp"]), dp_replicate=int(row["dp"]), tp=int(row["tp"]), zero1=row["zero"] == "1",
                    micro_batch=int(row["mbs"]), grad_accum=int(row["gas"]), pp_schedule="1f1b")
    mem = memory_plan(ctx.arch, layout, SEQ_LEN, ctx.hw, ctx.prec)
    return mem.fits, mem.peak_gib, layout.dp_label()


def group(row: dict) -> str:
    par = "+".join(d for d in ("tp", "pp") if int(row[d]) > 1) or "dp only"
    return f"zero={row['zero']}, {par}"


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("sweep", type=Path)
    p.add_argument("--archs", type=Path, default=None)
    p.add_argument("--list", action="store_true", help="print every run measured ok but predicted OOM")
    args = p.parse_args()
    archs_path = args.archs or args.sweep.with_name("playbook_model_archs.csv")
    archs = {a["model"]: a for a in csv.DictReader(archs_path.open())}
    rows = list(csv.DictReader(args.sweep.open()))
    ok, wrong, listed = Counter(), Counter(), []
    for row in (r for r in rows if r["status"] == "ok"):
        fits, peak, label = predict(row, archs)
        ok[group(row)] += 1
        if not fits:
            wrong[group(row)] += 1
            listed.append(f"{row['model']} nodes={row['nodes']} dp={row['dp']} tp={row['tp']} pp={row['pp']} "
                          f"mbs={row['mbs']} gas={row['gas']} zero={row['zero']}: measured {row['mem_gb']} GB, "
                          f"predicted {peak:.1f} GiB ({label})")
    result = {"runs": len(rows), "ok": sum(ok.values()), "ok_predicted_oom": sum(wrong.values()),
              "by_group": {g: {"ok": ok[g], "predicted_oom": wrong[g]} for g in sorted(ok)}}
    lines = [f"{result['ok']} of {result['runs']} runs measured ok; {result['ok_predicted_oom']} of them predicted "
             "out of memory", "| runs | measured ok | predicted OOM |", "|---|---:|---:|"]
    lines += [f"| {g} | {v['ok']} | {v['predicted_oom']} |" for g, v in result["by_group"].items()]
    _common.emit(result, args, (listed if args.list else []) + lines)


if __name__ == "__main__":
    main()
