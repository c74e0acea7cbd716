"""`usp plan --json` and `usp plan --html`: the plan's plain values (plan.yaml's fields, from
RunPlan.to_dict, the serialisation plan.yaml is written from) as JSON, and the page built from them."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from usp.errors import UspError
from usp.run.files import write_text_atomic
from usp.run.writable import check_new_output


def plan_json(plan) -> str:
    return json.dumps(plan.to_dict(), indent=1, allow_nan=False)


def plan_command(args: list[str]) -> str:
    """The command line that plans this again."""
    return shlex.join(["usp", "plan", *args])


def write_plan_page(plan, refusals: list, args: list[str], target: str, search=None) -> Path:
    """The plan as one self-contained HTML file at `target`: a new file, or a page usp wrote before.
    search: `usp plan --search`'s result, whose best layout `plan` is (its table above the plan)."""
    from usp.view.plan_charts import require_plotly
    from usp.view.plan_page import MARK, html_page, page_payload, search_table

    require_plotly("--html")
    path = Path(target).expanduser()
    if path.exists() and not (path.is_file() and _starts_with(path, MARK)):
        raise UspError(f"{path} exists and is not a page usp wrote: usp replaces only its own pages", key="--html",
                       value=str(path), fix="another --html file (or remove this one)")
    if not path.exists():
        check_new_output(path, force=False, key="--html")
    payload = page_payload(json.loads(plan_json(plan)), [str(r) for r in refusals], {"usp plan": plan_command(args)})
    if search is not None:
        payload["sections"]["search"] = search_table(search_rows(search), f"{search.fitting} fitting layouts of "
                                                     f"{search.evaluated} memory predictions")
    write_text_atomic(path, html_page(payload, f"usp plan: {plan.name}"))
    return path


def search_rows(result) -> list[dict]:
    """The search's ranked layouts as the console's table has them."""
    rows = []
    for i, c in enumerate(result.top, 1):
        lay, tim = c.layout, c.timing
        rows.append({"#": i, "layout": c.describe(), "peak GiB": f"{c.peak_gib:.1f}", "step s": f"{tim.step_s:.3g}",
                     "tokens/s/device": f"{tim.tokens_per_s_per_device:,.0f}", "MFU": f"{tim.mfu:.1%}",
                     "overrides": " ".join(lay.overrides())})
    return rows


def _starts_with(path: Path, mark: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return mark in f.read(200)
    except OSError as exc:
        raise UspError(f"can't read {path}: {exc.strerror}", key="--html", value=str(path),
                       fix="another file for --html") from None
