"""The plan page: `usp plan --html` writes it as one self-contained file (plotly.js inside, nothing fetched),
and `usp ui` serves it with a form around it. Built from the plan's plain values (`usp plan --json`, the
fields of plan.yaml): a payload of HTML sections and Plotly figures that one small script puts in place, so
the file and the live page show the same thing and no number is computed in the browser. Each key figure
carries the plan's exact value (data-value) next to its rounded text, for readers and tests."""
from __future__ import annotations

import html
import json

from usp.contract.dims import ParallelDims
from usp.view.plan_charts import GIB, memory_figure, schedule_figure, time_figure

MARK = "<!-- usp plan page -->"  # an existing file with this mark is a page usp wrote: --html replaces it
MAX_RANK_ROWS = 64
FIGURES = ("chart-memory", "chart-time", "chart-schedule")
SECTIONS = ("search", "figures", "schedule-note", "warnings", "mesh", "commands")


def page_payload(plan: dict, refusals: list[str], commands: dict[str, str]) -> dict:
    """What the page shows of one plan: {"sections": id -> HTML, "figures": id -> Plotly figure or None}.
    refusals: the engine rules `usp train` would refuse it by; commands: label -> the command line."""
    try:
        schedule, note = schedule_figure(plan), ""
    except ValueError as exc:
        schedule, note = None, f"<p class='note'>pipeline schedule not drawn: {html.escape(str(exc))}</p>"
    return {"sections": {"search": "", "figures": key_figures(plan), "schedule-note": note,
                         "warnings": warnings_list(plan["warnings"], refusals), "mesh": mesh_tables(plan),
                         "commands": commands_block(commands)},
            "figures": {"chart-memory": memory_figure(plan["memory"]), "chart-time": time_figure(plan["timing"]),
                        "chart-schedule": schedule}}


def _cell(testid: str, value, text: str) -> str:
    return f"<td data-testid='{testid}' data-value='{html.escape(repr(value))}'>{html.escape(text)}</td>"


def key_figures(plan: dict) -> str:
    timing, memory = plan["timing"], plan["memory"]
    rows = [("step time", _cell("step-time", timing["step_s"], f"{timing['step_s']:.4g} s")),
            ("MFU", _cell("mfu", timing["mfu"], f"{timing['mfu'] * 100:.1f}%")),
            ("tokens / s", _cell("tokens-per-s", timing["tokens_per_s"], f"{timing['tokens_per_s']:,.0f}")),
            ("peak memory", _cell("peak-memory", memory["peak_gib"],
                                  f"{memory['peak_gib']:.2f} GiB of {memory['capacity_gib']:g} GiB "
                                  f"({'fits' if memory['fits'] else 'does not fit'})"))]
    rows += [(f"memory, {stage_label_text(s)}", _cell(f"stage-total-{s['stage']}", s["total"],
                                                      f"{s['total'] / GIB:.2f} GiB")) for s in memory["stages"]]
    layout = html.escape(ParallelDims.of(plan["degrees"], plan["config"]["parallelism"]["ep"]).describe())
    head = (f"<p><b>{html.escape(plan['name'])}</b>: {html.escape(plan['model']['name'])}, {layout}, "
            f"{plan['world_size']} ranks on {plan['nodes']} node(s) of {html.escape(memory['device_name'])}</p>")
    body = "".join(f"<tr><th>{html.escape(name)}</th>{cell}</tr>" for name, cell in rows)
    return f"{head}<table class='figures'>{body}</table>"


def stage_label_text(stage: dict) -> str:
    return f"pp rank {stage['stage']} (each of {stage['n_ranks']} rank(s))"


def warnings_list(warnings: list[str], refusals: list[str]) -> str:
    items = [f"<li class='refusal'>usp train would refuse: {html.escape(r)}</li>" for r in refusals]
    items += [f"<li>{html.escape(w)}</li>" for w in warnings]
    return f"<ul data-testid='warnings'>{''.join(items)}</ul>" if items else "<p>no warnings</p>"


def mesh_tables(plan: dict) -> str:
    dims = ParallelDims.of(plan["degrees"], plan["config"]["parallelism"]["ep"])
    mesh = "".join(f"<tr><th>{html.escape(d)}</th><td>{n}</td></tr>" for d, n in zip(plan["mesh_dims"],
                                                                                        plan["mesh_shape"]))
    ranks = dims.rank_table(plan["procs_per_node"])
    head = "".join(f"<th>{h}</th>" for h in ("rank", "node", "local rank", *plan["mesh_dims"]))
    rows = "".join(f"<tr><td>{r.rank}</td><td>{r.node}</td><td>{r.local_rank}</td>"
                   + "".join(f"<td>{r.coords[d]}</td>" for d in plan["mesh_dims"]) + "</tr>"
                   for r in ranks[:MAX_RANK_ROWS])
    more = f"<p class='note'>... and {len(ranks) - MAX_RANK_ROWS} more ranks</p>" if len(ranks) > MAX_RANK_ROWS else ""
    return (f"<table class='mesh' data-testid='mesh'><tr><th>mesh dim</th><th>degree</th></tr>{mesh}</table>"
            f"<table class='ranks' data-testid='rank-table'><tr>{head}</tr>{rows}</table>{more}")


def commands_block(commands: dict[str, str]) -> str:
    """Each command line with a button that copies it."""
    copy = "<button onclick='navigator.clipboard.writeText(this.nextElementSibling.textContent)'>copy</button>"
    return "".join(f"<div>{html.escape(label)} {copy}<pre data-testid='command-{html.escape(label.replace(' ', '-'))}'>"
                   f"{html.escape(line)}</pre></div>" for label, line in commands.items())


def search_table(rows: list[dict], caption: str) -> str:
    """`usp plan --search --html`: the ranked layouts (the page below is the first one's plan)."""
    keys = list(rows[0]) if rows else []
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(row[k]))}</td>" for k in keys) + "</tr>" for row in rows)
    return (f"<h2>Layouts that fit, best first</h2><table data-testid='search'><tr>{head}</tr>{body}</table>"
            f"<p class='note'>{html.escape(caption)}</p><h2>The best layout's plan</h2>")


def _script_json(value) -> str:
    """JSON safe inside a <script> element."""
    return json.dumps(value, allow_nan=False).replace("</", "<\\/")


RENDER_JS = """
const uspShown = {};
function uspRender(p) {
  for (const [id, html] of Object.entries(p.sections)) document.getElementById(id).innerHTML = html;
  for (const [id, fig] of Object.entries(p.figures)) {
    const el = document.getElementById(id), key = JSON.stringify(fig);
    if (uspShown[id] === key) continue;  // the same figure: nothing to draw again
    uspShown[id] = key;
    if (fig) { el.hidden = false; Plotly.react(el, fig.data, fig.layout, {displaylogo: false, responsive: true}); }
    else { Plotly.purge(el); el.hidden = true; }
  }
  document.body.dataset.rendered = String(Number(document.body.dataset.rendered || 0) + 1);
}
"""

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0; } th, td { border: 1px solid #ccc; padding: 2px 8px; }
th { text-align: left; background: #f4f4f4; } td { text-align: right; }
pre { background: #f4f4f4; padding: 0.5em; white-space: pre-wrap; } .note { color: #666; }
.refusal, .error { color: #b00020; } .error { white-space: pre-wrap; border: 1px solid #b00020; padding: 0.5em; }
.ranks { font-size: 85%; } .controls label { margin-right: 1em; } textarea { width: 100%; }
"""


def html_page(payload: dict, title: str, controls: str = "", script: str = "") -> str:
    """The whole page: plotly.js and the payload inside, nothing fetched. controls, script: usp ui's form."""
    from plotly.offline import get_plotlyjs  # usp[ui]; only a page needs it

    charts = "".join(f"<div id='{name}' class='chart'></div>" for name in FIGURES)
    sections = {name: f"<div id='{name}'></div>" for name in SECTIONS}
    return (f"<!DOCTYPE html>\n{MARK}\n<html><head><meta charset='utf-8'><link rel='icon' href='data:,'>"
            f"<title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style><script>{get_plotlyjs()}</script><script>{RENDER_JS}</script></head><body>"
            f"<h1>{html.escape(title)}</h1>{controls}{sections['search']}{sections['figures']}"
            f"{charts}{sections['schedule-note']}<h2>Warnings</h2>{sections['warnings']}"
            f"<h2>Device mesh and ranks</h2>{sections['mesh']}<h2>Command</h2>{sections['commands']}"
            f"<script>uspRender({_script_json(payload)});</script>{script}</body></html>\n")
