"""A sweep's numbers: one row per point (sweep.json + the point's run dir), scaling efficiency and
batch-size guidance (the heatmap's grid: heatmap.py). Pure data, no plotting.

Scaling efficiency, from measured tokens/s T at world size n, against the smallest world n0
of a group: E(n) = (T(n) / n) / (T(n0) / n0), i.e. tokens/s per rank relative to the baseline
(1.0 = perfect). Strong scaling groups points with the same global batch (more ranks, same
work per step: ideal T grows with n); weak scaling groups points with the same batch per rank
(global batch tokens / world: the work grows with n, ideal T too). A group also shares the value
of every swept key outside ALONG_CURVE (a sweep over two models gives one curve per model). Where a
group has several points at one world size (e.g. micro batches), the fastest one counts."""
from __future__ import annotations

from pathlib import Path

from usp.contract.run_plan import RunPlan
from usp.report.runs import RunData
from usp.run.sweep_record import layout_text

BATCH_KEYS = ("micro_batch", "grad_accum")
# Swept keys that change the device count or only how the batch / the devices are split: a scaling
# curve runs along them (the fastest point per world size counts), every other swept key (the
# model, seq_len, ...) starts a curve of its own. Global batch keys vary along weak-scaling curves.
DEVICE_KEYS = ("cluster.nodes", "cluster.procs_per_node")
ALONG_CURVE = (*DEVICE_KEYS, "parallelism.dp", "parallelism.dp_replicate", "parallelism.dp_shard", "parallelism.tp",
               "parallelism.pp", "parallelism.cp", "parallelism.ep", "train.micro_batch", "train.grad_accum",
               "train.global_batch", "train.global_batch_tokens")


def sweep_rows(sweep: dict, runs: dict[str, RunData]) -> list[dict]:
    """One dict per point: id, swept, status, reason, layout, world, the measured numbers."""
    rows = []
    for p in sweep["points"]:
        run = runs.get(str(Path(p["run_dir"]).resolve())) if p.get("run_dir") else None
        status = p["status"]
        if run and status == "planned":  # e.g. a Slurm array task wrote the run dir ("running": refresh_statuses)
            status = "done" if run.summary else status
        mfu, how = run.mfu() if run else (None, "-")
        rows.append({"id": p["id"], "swept": p.get("swept", {}), "status": status, "reason": p.get("reason"),
                     "info": p, "layout": layout_text(p), "world": p.get("world_size"),
                     "tokens_per_s": run.tokens_per_s() if run and status == "done" else None,
                     "mfu": mfu if status == "done" else None, "mfu_how": how,
                     **dict(zip(("memory_measured_gib", "memory_measured_how"),
                                run.memory_measured() if run else (None, "-"))),
                     "memory_predicted_gib": (p.get("predicted") or {}).get("memory_tensor_gib"),
                     "final_loss": run.final_loss() if run and status == "done" else None,
                     "global_batch_tokens": run.plan.batch.global_batch_tokens if run and run.plan else None,
                     "run": run})
    return rows


def scaling(rows: list[dict]) -> tuple[list[dict], str]:
    """(rows of the efficiency table, note). See the module docstring for the definitions."""
    done = [r for r in rows if r["tokens_per_s"] and r["world"] and r["global_batch_tokens"]]
    if len({r["world"] for r in done}) < 2:
        return [], "The sweep does not vary the world size (among the points that ran): no scaling efficiency."
    out = []
    for kind, key, name in (("strong", lambda r: r["global_batch_tokens"], "global batch {} tokens"),
                            ("weak", lambda r: r["global_batch_tokens"] // r["world"], "{} tokens per rank")):
        groups: dict[tuple, dict[int, dict]] = {}
        for r in done:
            group = (key(r), fixed_keys_text(r.get("swept") or {}))
            best = groups.setdefault(group, {}).get(r["world"])
            if best is None or r["tokens_per_s"] > best["tokens_per_s"]:
                groups[group][r["world"]] = r
        for (value, fixed), by_world in sorted(groups.items()):
            if len(by_world) < 2:
                continue
            n0 = min(by_world)
            t0 = by_world[n0]["tokens_per_s"]
            for n, r in sorted(by_world.items()):
                t = r["tokens_per_s"]
                out.append({"kind": kind, "group": ", ".join(filter(None, (name.format(value), fixed))), "world": n,
                            "point": r["id"], "tokens_per_s": t, "per_rank": t / n, "speedup": t / t0,
                            "efficiency": (t / n) / (t0 / n0)})
    note = "" if out else ("The world size varies, but no two ranks counts share a global batch (strong scaling) "
                           "or a batch per rank (weak scaling) with the same other swept values.")
    return out, note


def bare(key: str) -> str:
    """A swept key without Hydra's +/++/~ prefix."""
    return key.lstrip("+~")


def fixed_keys_text(swept: dict[str, str]) -> str:
    """The swept values a scaling curve holds fixed ("model=a seq_len=256"): all but ALONG_CURVE."""
    return " ".join(f"{bare(k).split('.')[-1]}={v}" for k, v in sorted(swept.items()) if bare(k) not in ALONG_CURVE)


def batch_guidance(sweep: dict, rows: list[dict]) -> list[str]:
    """Sentences: per layout, the fastest micro batch that fits the predicted memory, and the
    measured tokens/s of the alternatives. [] when the sweep doesn't vary the batch split."""
    if not any(k.split(".")[-1] in BATCH_KEYS for k in sweep.get("swept") or {}):
        return []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["tokens_per_s"] and r["info"].get("degrees"):
            key = (r["world"], tuple(sorted(r["info"]["degrees"].items())), r["info"].get("global_batch"))
            groups.setdefault(key, []).append(r)
    out = []
    for (world, degrees, global_batch), group in groups.items():
        if len({(r["info"]["micro_batch"], r["info"]["grad_accum"]) for r in group}) < 2:
            continue
        fits = [r for r in group if _fits(r)] or group
        best = max(fits, key=lambda r: r["tokens_per_s"])
        layout = " ".join(f"{d}={v}" for d, v in degrees if v > 1) or "one rank"
        others = "; ".join(f"micro_batch={r['info']['micro_batch']} (grad_accum {r['info']['grad_accum']}): "
                           f"{r['tokens_per_s']:,.0f} tokens/s "
                           f"({100 * (r['tokens_per_s'] / best['tokens_per_s'] - 1):+.0f}%)"
                           for r in sorted(group, key=lambda r: r["info"]["micro_batch"]) if r is not best)
        pred = best["info"].get("predicted") or {}
        mem = f", predicted peak {pred['memory_gib']:.2f} GiB per rank" if pred.get("memory_gib") is not None else ""
        out.append(f"**{layout}, world {world}, global batch {global_batch}:** use `train.micro_batch="
                   f"{best['info']['micro_batch']}` (grad_accum {best['info']['grad_accum']}): "
                   f"{best['tokens_per_s']:,.0f} tokens/s measured{mem}, the fastest that fits the planner's memory "
                   f"prediction. Measured alternatives: {others}.")
    rejected = [r for r in rows if r["status"] == "rejected"
                and any(k.split(".")[-1] in BATCH_KEYS for k in r["swept"])]
    if rejected:
        out.append("Not run (rejected by the planner): " + "; ".join(
            f"{r['id']} ({', '.join(f'{k}={v}' for k, v in r['swept'].items())}): {r['reason']}" for r in rejected))
    return out


def row_plan(row: dict) -> RunPlan | None:
    """The plan of a row's run (None without one)."""
    return row["run"].plan if row.get("run") else None


def _fits(row: dict) -> bool:
    plan = row_plan(row)
    return plan is None or plan.memory is None or plan.memory.fits
