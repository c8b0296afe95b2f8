"""The live A/B page and the Grafana dashboard against a real server on the script model.

Requests go to both arms (header X-Specdec-Speculative on / off); the draft is the target itself,
so at temperature 0 every draft is accepted. Then: /dashboard/data has both arms' points and the
controller's state; /dashboard, loaded in headless Chromium, draws non-empty charts for both arms
(skipped without Chromium: `apt-get install chromium`); every metric the Grafana JSON queries is
in /metrics.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser

import httpx
import pytest
from helpers_server import REPO_ROOT, ServerProcess, build_script_model, start_servers

MODEL = "script"
NUM_PER_ARM = 4
MAX_TOKENS = 12
GRAFANA = REPO_ROOT / "docs" / "grafana" / "specdec.json"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Set by .ci/run, which installs Chromium: there a missing browser is a failure, not a skip.
REQUIRE_CHROMIUM = os.environ.get("SPECDEC_REQUIRE_CHROMIUM") == "1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard")
    build_script_model(root / MODEL)
    args = ["--ab-split", "0.5", "--ab-seed", "3"]
    srv = ServerProcess(root / MODEL, root / MODEL, args, root / "server.log")
    start_servers(srv)
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        for i in range(NUM_PER_ARM):
            for mode in ("on", "off"):
                r = http.post(
                    "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": f"hi {i}"}],
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                    },
                    headers={"X-Specdec-Speculative": mode},
                )
                assert r.status_code == 200, r.text
        # One refused request, so the refusal counter has a sample.
        assert (
            http.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
        )
    yield srv
    srv.stop()


def test_data_has_both_arms_and_the_controller(server):
    r = httpx.get(f"{server.url}/dashboard/data", timeout=10)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    data = r.json()
    assert data["models"] == [MODEL, f"{MODEL}-draft"]
    assert data["window_s"] == 300 and data["bin_s"] == 5
    arms = {s["arm"]: s for s in data["series"] if s["model"] == MODEL}
    assert set(arms) == {"spec", "plain"}
    for arm, s in arms.items():
        whole = s["window"]
        assert s["points"], arm
        assert whole["requests_finished"] == NUM_PER_ARM, arm
        assert whole["output_tokens"] == NUM_PER_ARM * MAX_TOKENS, arm
        assert 0 < whole["ttft_p50"] <= whole["ttft_p90"] <= whole["ttft_p99"], arm
        assert 0 < whole["tpot_p50"] <= whole["tpot_p99"], arm
        assert whole["tokens_per_s"] > 0, arm
    spec, plain = arms["spec"]["window"], arms["plain"]["window"]
    assert spec["acceptance_rate"] == 1.0 and spec["accepted_length"] > 1.0
    assert plain["acceptance_rate"] is None and plain["accepted_length"] == 1.0
    engine = data["engine"]
    assert engine["alive"] is True and engine["ab_split"] == 0.5
    assert engine["speculative_policy"] == "adaptive" and engine["num_speculative_tokens"] == 6
    assert len(engine["acceptance_estimate"]) == 6
    assert "machine_pace" in engine["cost_model"]
    assert data["controller_series"] and all(
        0 <= c["mean_k"] <= 6 and 0 <= c["speculating_fraction"] <= 1
        for c in data["controller_series"]
    )


def test_page_is_self_contained(server):
    r = httpx.get(f"{server.url}/dashboard", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    # No external resource: no script or style files, no URLs but the SVG namespace name.
    assert "<script src" not in page and "<link" not in page and "url(" not in page
    assert re.findall(r"https?://[^\s\"']+", page) == ["http://www.w3.org/2000/svg"]
    assert "/data" in page  # what it polls


class _Dom(HTMLParser):
    """The dumped DOM's body attributes, and per chart the drawn polylines and points."""

    def __init__(self) -> None:
        super().__init__()
        self.body: dict[str, str] = {}
        self.chart: str | None = None
        self.lines: dict[str, list[dict[str, str]]] = {}
        self.circles: dict[str, int] = {}
        self.summary_rows: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        elif tag == "svg" and "data-chart" in a:
            self.chart = a["data-chart"]
        elif tag == "polyline" and self.chart:
            self.lines.setdefault(self.chart, []).append(a)
        elif tag == "circle" and self.chart:
            self.circles[self.chart] = self.circles.get(self.chart, 0) + 1
        elif tag == "tr" and "data-series" in a:
            self.summary_rows.append(a["data-series"])

    def handle_endtag(self, tag):
        if tag == "svg":
            self.chart = None


@pytest.mark.skipif(
    CHROMIUM is None and not REQUIRE_CHROMIUM, reason="needs Chromium: apt-get install chromium"
)
def test_page_draws_both_arms_in_headless_chromium(server, tmp_path):
    assert CHROMIUM is not None, "SPECDEC_REQUIRE_CHROMIUM=1 but no chromium on PATH"
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
        # Virtual time runs the page's polls (every 2 s) without waiting for them in real time.
        "--virtual-time-budget=6000", "--dump-dom", f"{server.url}/dashboard",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = _Dom()
    dom.feed(proc.stdout)
    assert dom.body.get("data-state") == "ok", proc.stdout[-3000:]
    assert int(dom.body["data-updates"]) >= 1
    assert set(dom.body["data-series"].split(",")) == {"spec", "plain"}
    assert sorted(dom.summary_rows) == ["plain", "spec"]
    for chart in ("ttft", "tpot", "tokens", "accepted-length"):
        drawn = {
            line["data-series"]
            for line in dom.lines.get(chart, [])
            if int(line["data-points"]) > 0 and line["points"]
        }
        assert drawn == {"spec", "plain"}, chart
        assert dom.circles.get(chart, 0) >= 2, chart
    acceptance = {line["data-series"]: int(line["data-points"]) for line in dom.lines["acceptance"]}
    assert acceptance["spec"] > 0 and acceptance["plain"] == 0  # plain decode drafts nothing
    controller = [int(line["data-points"]) for line in dom.lines["controller"]]
    assert controller and min(controller) > 0
    assert dom.circles.get("acceptance-estimate", 0) == 0  # bars, not points
    assert 'data-position="5"' in proc.stdout  # one bar per draft position (k = 6)


def _exposed_names(text: str) -> set[str]:
    return {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_grafana_dashboard_queries_only_exposed_metrics(server):
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    queried = {name for e in exprs for name in re.findall(r"specdec:[A-Za-z0-9_:]+", e)}
    exposed = _exposed_names(server.metrics())
    assert queried and queried <= exposed, sorted(queried - exposed)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
