"""`usp plan --json` / `--html` and `usp ui` without a browser (docs/ui.md; the browser test is
tests/e2e/test_ui_browser.py): the JSON is plan.yaml's content, the schedule's idle time is the plan's
bubble, and `usp ui` refuses a bind others can reach without a token, a request without it, and overrides
that call Hydra or point outside the working directory and the catalogue."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers import usp_cli
from usp.errors import UspError
from usp.perf.pipeline_split import stage_ranks
from usp.perf.pipeline_timeline import timeline
from usp.view.ui_overrides import checked_overrides
from usp.view.ui_server import check_bind, make_server, page_url, planned


def test_plan_json_is_plan_yaml(tmp_path):
    """--json prints exactly what --save writes to plan.yaml, and nothing else on stdout."""
    args = ("plan", "conf=mixtral_8x7b", f"train.runs_dir={tmp_path}", "--json")
    proc = usp_cli(*args, "--save", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    saved = yaml.safe_load((tmp_path / "mixtral_8x7b" / "plan.yaml").read_text())
    assert json.loads(proc.stdout) == json.loads(json.dumps(saved))
    assert json.loads(proc.stdout)["pipeline"]["schedule"] == "1f1b"


def test_plan_json_is_one_plan_alone(tmp_path):
    proc = usp_cli("plan", "--search", "--json", cwd=tmp_path)
    assert proc.returncode == 2 and "--json" in proc.stderr and proc.stdout == ""


def test_plan_html_writes_one_page_and_replaces_only_its_own(tmp_path):
    page = tmp_path / "plan.html"
    proc = usp_cli("plan", "conf=tiny_demo", "--html", str(page), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    assert "data-testid='step-time'" in text and "usp plan conf=tiny_demo" in text
    assert "<script src" not in text and "https://" not in text.split("<script>uspRender", 1)[1]
    assert usp_cli("plan", "conf=tiny_demo", "--html", str(page), cwd=tmp_path).returncode == 0
    other = tmp_path / "notes.html"
    other.write_text("mine")
    proc = usp_cli("plan", "conf=tiny_demo", "--html", str(other), cwd=tmp_path)
    said = " ".join(proc.stderr.split())  # the console wraps at its width, wherever the path's length puts it
    assert proc.returncode == 2 and other.read_text() == "mine" and "not a page usp wrote" in said


def test_search_html_is_the_best_layouts_plan(tmp_path):
    page = tmp_path / "search.html"
    proc = usp_cli("plan", "--search", "conf=tiny_ddp", "--html", str(page), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    best = proc.stdout.split("use it: usp plan ", 1)[1].split("\n")[0].split()
    text = page.read_text()
    assert "data-testid='search'" in text and "data-testid='step-time'" in text
    assert f"usp plan conf=tiny_ddp {' '.join(best)}" in text  # the command that plans the page's layout


@pytest.mark.parametrize("schedule,pp,virtual,micro", [("1f1b", 4, 1, 8), ("afab", 4, 1, 8),
                                                        ("interleaved_1f1b", 4, 2, 8), ("interleaved_1f1b", 8, 4, 32),
                                                        ("interleaved_zb", 2, 2, 4), ("1f1b", 1, 1, 3)])
def test_schedule_idle_time_is_the_bubble(schedule, pp, virtual, micro):
    """Each pp rank's idle time over its compute is (pp - 1) / (v m), the bubble the planner predicts."""
    slots = timeline(schedule, stage_ranks(pp, virtual, schedule), micro, 1.0, 2.0)
    assert len(slots) == 2 * pp * virtual * micro
    busy = micro * virtual * 3.0
    assert max(s.end for s in slots) - busy == pytest.approx(busy * (pp - 1) / (virtual * micro))
    for rank in range(pp):  # one thing at a time per rank
        mine = sorted((s for s in slots if s.rank == rank), key=lambda s: s.start)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))


def test_the_schedule_of_a_planned_run_has_its_bubble(tmp_path):
    payload = planned("mixtral_8x7b", (), (), str(tmp_path))
    fig = payload["figures"]["chart-schedule"]
    idle = [t for t in fig["data"] if t["name"] == "idle"][0]
    timing = json.loads(usp_cli("plan", "conf=mixtral_8x7b", "--json", cwd=tmp_path).stdout)["timing"]
    pp_rank0 = sum(x for x, y in zip(idle["x"], idle["y"]) if y == "pp 0")
    # the plan's bubble is that fraction of the compute path (its exposed TP/CP/EP/PP included); the chart draws compute
    assert pp_rank0 / timing["compute_s"] == pytest.approx(timing["bubble_fraction"], rel=1e-9)


@pytest.mark.parametrize("override,key", [
    ("model.init_from=/etc", "model.init_from"), ("cluster=/tmp/elsewhere.yaml", "cluster"),
    ("checkpoint.dir=../../outside", "checkpoint.dir"), ("data.paths=[ok.txt,/etc/passwd]", "data.paths"),
    ("model.init_from=~/x", "model.init_from"), ("hydra.run.dir=/tmp", "hydra.run.dir"),
    ("+train.extra=1", "train.extra"), ("~train.steps", "train.steps"), ("train.name=${oc.env:HOME}", "train.name"),
    ("conf=/etc/x.yaml", "conf"), ("parallelism.tp", "parallelism.tp")])
def test_ui_refuses_overrides_outside_what_it_takes(tmp_path, override, key):
    with pytest.raises(UspError) as info:
        checked_overrides([override], tmp_path)
    assert info.value.key == key and info.value.fix


def test_ui_takes_plain_overrides_and_paths_inside(tmp_path):
    lines = ["parallelism.tp=2", "", "cluster=h200", "model.init_from=./ckpt", f"data.paths=[{tmp_path}/a.txt]"]
    assert checked_overrides(lines, tmp_path) == [line for line in lines if line]


def test_ui_shows_the_rule_and_its_fix(tmp_path):
    outside = planned("tiny_demo", (), ("model.init_from=/etc",), str(tmp_path))
    assert "outside the working directory" in outside["error"] and "fix:" in outside["error"]
    rule = planned("tiny_demo", (), ("parallelism.tp=2",), str(tmp_path))
    assert "does not divide the world size" in rule["error"] and "fix:" in rule["error"]
    good = planned("tiny_demo", ("cluster=local_cpu2",), ("parallelism.tp=2",), str(tmp_path))
    assert "error" not in good
    assert good["sections"]["commands"].count("cluster=local_cpu2 parallelism.tp=2") == 3  # plan, train, submit


def test_ui_refuses_a_bind_others_reach_without_a_token():
    with pytest.raises(UspError) as info:
        check_bind("0.0.0.0", None)
    assert info.value.key == "--host" and "--token" in info.value.fix
    check_bind("0.0.0.0", "secret")
    check_bind("127.0.0.1", None)
    proc = usp_cli("ui", "--host", "0.0.0.0", cwd=Path.cwd())
    assert proc.returncode == 2 and "--token" in proc.stderr


def _get(url: str, **headers) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_ui_plans_a_request_and_refuses_what_it_does_not_read(tmp_path):
    server = make_server("127.0.0.1", 0, None, "tiny_demo")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = page_url(server, None) + "api/plan"
        ask = {"conf": "tiny_ddp", "groups": [["model", "moe_tiny"], ["cluster", ""]], "overrides": ["train.steps=7"]}
        status, answer = _post(api, json.dumps(ask).encode())
        assert status == 200 and "data-testid='step-time'" in answer["sections"]["figures"]
        assert "usp train conf=tiny_ddp model=moe_tiny train.steps=7" in answer["sections"]["commands"]
        assert _post(api, json.dumps({**ask, "groups": [["hydra", "x"]]}).encode())[0] == 400
        status, answer = _post(api, json.dumps({"conf": "/etc/passwd"}).encode())
        assert status == 200 and answer["error"].startswith("conf='/etc/passwd'")
        assert _post(api, b"{not json")[0] == 400
        assert _post(api, json.dumps({"overrides": []}).encode())[0] == 400
    finally:
        server.shutdown()
        server.server_close()


def test_ui_answers_only_with_its_token(tmp_path):
    server = make_server("127.0.0.1", 0, "s3cret", "tiny_demo")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = page_url(server, "s3cret")
        assert _get(url) == 200
        assert _get(url.split("?")[0]) == 403
        assert _get(url.split("?")[0], **{"X-Usp-Token": "wrong"}) == 403
    finally:
        server.shutdown()
        server.server_close()


def test_ui_without_token_answers_loopback_names_only(tmp_path):
    server = make_server("127.0.0.1", 0, None, "tiny_demo")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = page_url(server, None)
        assert _get(url) == 200
        assert _get(url, Host="attacker.example") == 403  # a rebound DNS name
    finally:
        server.shutdown()
        server.server_close()
