"""The sweep heatmap's grid, like the playbook's: model (rows, ordered by parameter count) x node
count (columns; the world size when cluster.nodes is not swept), colour = the best MFU of the
cell's points (max over the other swept keys). An axis the sweep does not vary is replaced by the
most-varied remaining swept key. No MFU anywhere (no `mfu` in the records and no peak FLOP/s in
the plans): colour = tokens/s, and the grid says so. Pure data; sweep_plots.py draws it."""
from __future__ import annotations

from usp.report.sweep_tables import DEVICE_KEYS, bare, row_plan


def heatmap_grid(sweep: dict, rows: list[dict]) -> dict | None:
    """{"rows", "cols": axis names; "row_values", "col_values", "row_labels"; "values": [[float|None]];
    "best": [[point id]]; "notes": [[status of an empty cell]]; "metric": "MFU" | "tokens/s";
    "caption_extra"}. None when the sweep swept nothing or no point has a number."""
    swept = sweep.get("swept") or {}
    metric = "mfu" if any(r["mfu"] is not None for r in rows) else "tokens_per_s"
    if not swept or not any(r[metric] is not None for r in rows):
        return None
    model, scale = _model_axis(swept, rows), _scale_axis(swept, rows)
    used = set((model or {}).get("keys", ())) | set((scale or {}).get("keys", ()))
    rest = sorted((k for k in swept if k not in used), key=lambda k: -len(swept[k]))  # stable: grid order on ties
    row_axis = model or (_key_axis(rest.pop(0), swept) if rest else _constant_axis(rows))
    col_axis = scale or (_key_axis(rest.pop(0), swept) if rest else {"name": None, "of": lambda r: "", "values": [""]})
    rv, cv = row_axis["values"], col_axis["values"]
    values = [[None] * len(cv) for _ in rv]
    best = [[None] * len(cv) for _ in rv]
    statuses: list[list[list[str]]] = [[[] for _ in cv] for _ in rv]
    unplaced = 0
    for r in rows:
        i, j = row_axis["of"](r), col_axis["of"](r)
        if i not in rv or j not in cv:  # e.g. a rejected point: no world size known
            unplaced += 1
            continue
        i, j, v = rv.index(i), cv.index(j), r[metric]
        if v is None:
            statuses[i][j].append("no data" if r["status"] == "done" else r["status"])
        elif values[i][j] is None or v > values[i][j]:
            values[i][j], best[i][j] = v, r["id"]
    notes = [["" if values[i][j] is not None else ", ".join(dict.fromkeys(statuses[i][j])) or "no point"
              for j in range(len(cv))] for i in range(len(rv))]
    collapsed = [k for k in swept if k not in used | set(row_axis.get("keys", ())) | set(col_axis.get("keys", ()))]
    extra = [f"Each cell shows the best of its points over {', '.join(collapsed)}." if collapsed else ""]
    if metric == "tokens_per_s":
        extra.append("No point has an MFU (no `mfu` in metrics.jsonl and no peak FLOP/s in plan.yaml): the colour "
                     "is measured tokens/s instead.")
    elif any(r["mfu_how"] == "derived" for r in rows if r["mfu"] is not None):
        extra.append("Some MFUs are derived from measured tokens/s (their runs logged no `mfu`).")
    if unplaced:
        extra.append(f"{unplaced} point(s) without a {col_axis['name'] or row_axis['name']} (rejected before "
                     f"planning) are not placed.")
    return {"rows": row_axis["name"], "cols": col_axis["name"], "row_values": rv, "col_values": cv,
            "row_labels": row_axis.get("labels", rv), "values": values, "best": best, "notes": notes,
            "metric": "MFU" if metric == "mfu" else "tokens/s", "caption_extra": " ".join(filter(None, extra))}


def _key_axis(key: str, swept: dict) -> dict:
    return {"name": key, "keys": [key], "of": lambda r: r["swept"].get(key), "values": list(swept[key])}


def _model_axis(swept: dict, rows: list[dict]) -> dict | None:
    """The swept model keys (the `model` group and/or model.* values), ordered by parameter count
    (sweep.json's planned `params`, else plan.yaml's; unknown ones last)."""
    keys = [k for k in swept if bare(k) == "model" or bare(k).startswith("model.")]
    if not keys:
        return None

    def of(r: dict) -> str:
        if len(keys) == 1:
            return str(r["swept"].get(keys[0]))
        return " ".join(f"{bare(k).split('.')[-1]}={r['swept'].get(k)}" for k in keys)

    params: dict[str, int] = {}
    for r in rows:
        plan = row_plan(r)
        n = r["info"].get("params") or (plan.model.params if plan is not None else None)  # planned, or from plan.yaml
        if n:
            params.setdefault(of(r), int(n))
    names = sorted(dict.fromkeys(of(r) for r in rows), key=lambda m: (m not in params, params.get(m, 0)))
    labels = [f"{m} ({_count(params[m])})" if m in params else m for m in names]
    return {"name": "model", "keys": keys, "of": of, "values": names, "labels": labels}


def _scale_axis(swept: dict, rows: list[dict]) -> dict | None:
    """cluster.nodes when swept, else the world size when the points' world sizes differ."""
    nodes = next((k for k in swept if bare(k) == "cluster.nodes"), None)
    if nodes:
        return {"name": "nodes (cluster.nodes)", "keys": [nodes], "of": lambda r: r["swept"].get(nodes),
                "values": sorted(swept[nodes], key=_number)}
    worlds = sorted({int(r["world"]) for r in rows if r["world"]})
    if len(worlds) < 2:
        return None
    return {"name": "world size (ranks)", "keys": [k for k in swept if bare(k) in DEVICE_KEYS],
            "of": lambda r: str(r["world"]) if r["world"] else None, "values": [str(w) for w in worlds]}


def _constant_axis(rows: list[dict]) -> dict:
    """One row when nothing else is swept: named after the model of the runs."""
    names = {plan.model.name for r in rows if (plan := row_plan(r)) is not None}
    name = ", ".join(sorted(str(n) for n in names)) or "all points"
    return {"name": "model", "of": lambda r: name, "values": [name]}


def _number(value: str) -> tuple:
    try:
        return 0, float(value)
    except ValueError:
        return 1, value


def _count(n: int) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)
