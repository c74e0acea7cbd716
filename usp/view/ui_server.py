"""`usp ui`: the plan page served on this machine (stdlib http.server), with a form to pick a recipe, a
model, a cluster and a layout and to edit overrides. Each change is planned in-process by the code `usp plan` runs
(compose, then every rule), and the page is rebuilt by usp/view/plan_page.py; plans are cached by their
composition, so going back to one seen before answers at once. It binds 127.0.0.1; any other address needs
--host and a --token that every request then carries (a page for a network is a page for others)."""
from __future__ import annotations

import hmac
import html
import json
import shlex
import socket
import threading
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from usp.errors import LaunchError, UspError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_BODY = 64 * 1024
_PLANNING = threading.Lock()  # Hydra's compose API keeps global state: one composition (and plan) at a time


def check_bind(host: str, token: str | None) -> None:
    """Loopback needs nothing; any other address a token (refused before the port is opened)."""
    if host not in LOOPBACK and not token:
        raise LaunchError("usp ui on an address other machines can reach needs a token that every request carries",
                          key="--host", value=host, fix="add --token <a secret> (or USP_UI_TOKEN), or drop --host to "
                                                        "bind 127.0.0.1")


GROUPS = ("model", "cluster", "parallelism")  # the groups the page picks an option of (none: the recipe's)


def commands(conf: str, args: list[str]) -> dict[str, str]:
    args = [f"conf={conf}", *args]
    return {f"usp {verb}": shlex.join(["usp", verb, *args]) for verb in ("plan", "train", "submit")}


@lru_cache(maxsize=256)
def planned(conf: str, groups: tuple[str, ...], overrides: tuple[str, ...], cwd: str) -> dict:
    """The page's payload for one composition, or {"error": the rule's message and fix}. groups: the options
    picked (group=option), overrides: the lines typed."""
    from usp.config.compose import compose_config
    from usp.plan.plan import plan_with_failures
    from usp.view.plan_output import plan_json
    from usp.view.plan_page import page_payload
    from usp.view.ui_overrides import checked_overrides, checked_recipe

    try:
        checked = checked_overrides([*groups, *overrides], Path(cwd))
        with _PLANNING:
            composed, choices = compose_config(checked_recipe(conf), checked)
            plan, failures = plan_with_failures(composed, choices)
    except UspError as exc:
        return {"error": str(exc)}
    if plan is None:
        return {"error": "\n".join(str(f) for f in failures)}
    return page_payload(json.loads(plan_json(plan)), [str(f) for f in failures],
                        commands(conf, checked))


def _options(name: str, values: list[str], selected: str, default: str | None) -> str:
    items = [f"<option value=''>{default}</option>"] if default else []
    items += [f"<option value='{html.escape(v)}'{' selected' if v == selected else ''}>{html.escape(v)}</option>"
              for v in values]
    return f"<label>{name} <select id='{name}' data-testid='select-{name}'>{''.join(items)}</select></label>"


def controls(conf: str, error: str = "") -> str:
    """The form; `error`: why the recipe the page opens with has no plan (shown until a change plans)."""
    from usp.config.paths import group_options, recipe_names

    shown = f"<div id='error' class='error' data-testid='error'>{html.escape(error)}</div>" if error else \
        "<div id='error' class='error' data-testid='error' hidden></div>"
    return ("<div class='controls'>" + _options("recipe", recipe_names(), conf, None)
            + "".join(_options(group, group_options(group), "", "(the recipe's)") for group in GROUPS)
            + "<p>overrides, one per line (key=value, as on the command line):</p>"
            "<textarea id='overrides' data-testid='overrides' rows='4'></textarea>"
            "<button id='plan' data-testid='plan-button'>plan</button>" + shown + "</div>")


UI_JS = """
<script>
let uspSeq = 0, uspTimer = null;
async function uspUpdate() {
  const seq = ++uspSeq, start = performance.now();
  const body = {conf: document.getElementById('recipe').value,
                groups: ['model', 'cluster', 'parallelism'].map(g => [g, document.getElementById(g).value]),
                overrides: document.getElementById('overrides').value.split('\\n')};
  const reply = await fetch('/api/plan', {method: 'POST', body: JSON.stringify(body),
                                          headers: {'Content-Type': 'application/json', 'X-Usp-Token': USP_TOKEN}});
  const payload = await reply.json();
  if (seq !== uspSeq) return;  // a newer change is on its way
  const error = document.getElementById('error');
  error.hidden = !payload.error;
  error.textContent = payload.error || '';
  if (!payload.error) uspRender(payload);
  document.body.dataset.took = String(performance.now() - start);  // ms from the change to the page drawn
  document.body.dataset.answered = String(seq);
}
for (const id of ['recipe', 'model', 'cluster', 'parallelism']) {
  document.getElementById(id).addEventListener('change', uspUpdate); }
document.getElementById('plan').addEventListener('click', uspUpdate);
document.getElementById('overrides').addEventListener('input', () => {
  clearTimeout(uspTimer); uspTimer = setTimeout(uspUpdate, 300); });
</script>
"""


class UiHandler(BaseHTTPRequestHandler):
    server_version = "usp-ui"
    token: str | None = None
    start_conf = "tiny_demo"
    cwd = "."

    def log_message(self, format, *args):  # noqa: A002 (http.server's name): requests are not news
        pass

    def _allowed(self) -> bool:
        if self.token:
            given = self.headers.get("X-Usp-Token") or parse_qs(urlparse(self.path).query).get("token", [""])[0]
            return hmac.compare_digest(given.encode(), self.token.encode())
        # loopback without a token: only pages this machine names by loopback (no DNS rebinding)
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]")
        return host in LOOPBACK

    def _reply(self, status: int, body: str, kind: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", f"{kind}; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 (http.server's name)
        if not self._allowed():
            return self._reply(403, "forbidden: usp ui answers to its token, or without one to 127.0.0.1 and "
                                    "localhost only", "text/plain")
        if urlparse(self.path).path != "/":
            return self._reply(404, "not found", "text/plain")
        self._reply(200, self.page(), "text/html")

    def do_POST(self):  # noqa: N802
        if not self._allowed():
            return self._reply(403, json.dumps({"error": "forbidden: usp ui needs its token"}), "application/json")
        length = self.headers.get("Content-Length") or "0"
        if urlparse(self.path).path != "/api/plan" or not length.isdigit() or int(length) > MAX_BODY:
            return self._reply(404, json.dumps({"error": "not found"}), "application/json")
        try:
            ask = json.loads(self.rfile.read(int(length)))
            picked = {str(group): str(option) for group, option in ask.get("groups") or []}
            if set(picked) - set(GROUPS):
                raise ValueError(picked)
            key = (str(ask["conf"]), tuple(f"{g}={picked[g]}" for g in GROUPS if picked.get(g)),
                   tuple(str(line) for line in ask.get("overrides") or []))
        except (ValueError, KeyError, TypeError):
            return self._reply(400, json.dumps({"error": "a request usp ui does not read"}), "application/json")
        self._reply(200, json.dumps(planned(*key, self.cwd)), "application/json")

    def page(self) -> str:
        from usp.view.plan_page import FIGURES, SECTIONS, html_page

        first = planned(self.start_conf, (), (), self.cwd)
        payload = first if "error" not in first else {"sections": dict.fromkeys(SECTIONS, ""),
                                                      "figures": dict.fromkeys(FIGURES)}
        script = f"<script>const USP_TOKEN = {json.dumps(self.token or '')};</script>{UI_JS}"
        return html_page(payload, "usp ui", controls(self.start_conf, first.get("error", "")), script)


class UiServer(ThreadingHTTPServer):  # its threads are daemons: Ctrl-C never waits on a browser

    def handle_error(self, request, client_address):
        """A browser that went away mid-answer (a page left, a request superseded) is no error to print."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def make_server(host: str, port: int, token: str | None, conf: str) -> UiServer:
    """The page's server, its port open (port 0: a free one); refused before that off loopback without a token."""
    from usp.view.plan_charts import require_plotly
    from usp.view.ui_overrides import checked_recipe

    check_bind(host, token)
    require_plotly("usp ui")
    handler = type("Handler", (UiHandler,), {"token": token, "start_conf": checked_recipe(conf),
                                            "cwd": str(Path.cwd().resolve())})
    server_class = type("Server", (UiServer,), {"address_family": socket.AF_INET6} if ":" in host else {})
    try:
        return server_class((host, port), handler)
    except OSError as exc:
        raise LaunchError(f"can't listen on {host}:{port}: {exc.strerror}", key="--port", value=port,
                          fix="another --port (0 picks a free one)") from None


def page_url(server: UiServer, token: str | None) -> str:
    host = str(server.server_address[0])
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{server.server_address[1]}/" + (f"?token={token}" if token else "")


def serve(host: str, port: int, token: str | None, conf: str, ready=None) -> None:
    """Serve until interrupted. ready(url): called once the port is open (the CLI prints it)."""
    server = make_server(host, port, token, conf)
    if ready is not None:
        ready(page_url(server, token))
    with server:
        server.serve_forever()
