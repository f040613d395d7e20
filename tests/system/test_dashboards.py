"""The operator's overview dashboard, helm/rekv/dashboards/rekv-overview.json (shipped by the chart
as a ConfigMap for Grafana's sidecar).

Structure, without Prometheus: Grafana JSON on a recent schema, the data source only through the
`${datasource}` variable, panels on the 24-column grid with unique ids, every target an expression
over metrics services/metrics.py exports, every exported metric on the dashboard.

End to end, with a real Prometheus (Debian's `prometheus` package; `.ci/install-prometheus.sh`):
`bench/dashboard_picture.py` starts it scraping the real services on loopback, drives one round
of traffic (forced actions, planner-chosen ones, refused requests, fallbacks), and every panel
target, its template variables substituted, must parse and return at least one series with a
number through the HTTP API. Skipped, saying why, only where the binary is missing.
"""

import http.server
import importlib.util
import math
import re
import shutil
import sys
import threading
import time

import pytest

from services.metrics import ServiceMetrics
from tests.support.paths import ROOT

SPEC = importlib.util.spec_from_file_location("dashboard_picture",
                                              ROOT / "bench" / "dashboard_picture.py")
bench = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = bench
SPEC.loader.exec_module(bench)

DASHBOARD = bench.load_dashboard()
PANELS = bench.panels(DASHBOARD)
TARGETS = [(panel, target) for panel in PANELS for target in panel["targets"]]
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
METRIC = re.compile(r"\brekv_[a-z0-9_]+\b")


def _walk(node, path=""):
    """Every (path, key, value) of a JSON tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield path, key, value
            yield from _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{path}/{index}")


def _exported() -> dict[str, str]:
    """Every series name either role exports -> its metric family's name."""
    names = {}
    for role in ("prefill", "decode"):
        for family in ServiceMetrics(role).registry.collect():
            if not family.name.startswith("rekv_"):  # the process collector's standard ones
                continue
            suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",),
                        "gauge": ("",)}[family.type]
            names.update({family.name + suffix: family.name for suffix in suffixes})
    return names


def test_the_dashboard_is_recent_grafana_json():
    assert DASHBOARD["schemaVersion"] >= 39
    assert DASHBOARD["uid"] == "rekv-overview" and DASHBOARD["title"]
    assert DASHBOARD.get("id") is None and "__inputs" not in DASHBOARD  # provisioned, not imported
    assert {p["type"] for p in DASHBOARD["panels"]} <= {"row", "timeseries", "stat"}
    assert {p["type"] for p in DASHBOARD["panels"] if p["type"] != "row"} == {"timeseries", "stat"}


def test_panels_sit_on_the_grid_with_unique_ids():
    everything = DASHBOARD["panels"] + [q for p in DASHBOARD["panels"] for q in p.get("panels", [])]
    ids = [p["id"] for p in everything]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    taken = {}
    for panel in DASHBOARD["panels"]:
        x, y, w, h = (panel["gridPos"][k] for k in "xywh")
        assert w > 0 and h > 0 and x >= 0 and y >= 0 and x + w <= 24, panel["title"]
        for cell in ((cx, cy) for cx in range(x, x + w) for cy in range(y, y + h)):
            assert cell not in taken, f"{panel['title']} overlaps {taken[cell]}"
            taken[cell] = panel["title"]


def test_the_data_source_is_only_the_template_variable():
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for path, key, value in _walk(DASHBOARD):
        if key == "datasource" and isinstance(value, str):
            assert value == "${datasource}", path
        elif key == "datasource" and value.get("type") != "grafana":  # the built-in annotations
            assert value == {"type": "prometheus", "uid": "${datasource}"}, path
        elif key == "uid" and path:
            assert value in ("${datasource}", "-- Grafana --"), f"fixed uid {value!r} at {path}"
    for panel in PANELS:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_panel_has_expressions_and_every_variable_a_value():
    names = {v["name"] for v in DASHBOARD["templating"]["list"]}
    for panel in PANELS:
        assert panel["targets"], f"{panel['title']}: no targets"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), f"{panel['title']} {target['refId']}: empty expr"
            used = {a or b for a, b in bench.VARIABLE.findall(target["expr"])}
            assert used <= names | GRAFANA_BUILTINS, f"{panel['title']}: {used - names}"
            assert "$" not in bench.render(target["expr"], bench.variables("1m", "1s"))
    for variable in DASHBOARD["templating"]["list"][1:]:  # label filters that keep unlabelled
        assert variable["includeAll"] and variable["allValue"] == ".*", variable["name"]


def test_every_metric_used_exists_and_every_metric_is_used():
    exported = _exported()
    used = {name for _, target in TARGETS for name in METRIC.findall(target["expr"])}
    assert used <= set(exported), f"not exported by services/metrics.py: {used - set(exported)}"
    families = set(exported.values())
    assert families == {exported[name] for name in used}, (
        f"on no panel: {families - {exported[name] for name in used}}")


def test_the_api_reader_takes_a_starting_servers_plain_text_error_as_an_error():
    """A Prometheus still starting answers 503 in plain text; the readiness loop must read that
    as "not ready" (status error), not crash parsing it as JSON (seen in CI)."""
    answers = {"/plain": (503, b"Service Unavailable"), "/json": (400, b'{"status": "error"}'),
               "/ok": (200, b'{"status": "success", "data": 1}')}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            code, body = answers[self.path]
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reader = object.__new__(bench.Prometheus)
        reader.url = f"http://127.0.0.1:{server.server_address[1]}"
        assert reader.api("/plain") == {"status": "error", "error": "Service Unavailable"}
        assert reader.api("/json") == {"status": "error"}
        assert reader.api("/ok") == {"status": "success", "data": 1}
    finally:
        server.shutdown()
        server.server_close()
    assert reader.api("/ok") == {}  # nothing answers: not ready yet, no exception


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One round of traffic through the real services, Prometheus scraping them every second;
    every panel target evaluated at the end over a window covering the traffic."""
    if shutil.which("prometheus") is None:
        pytest.skip("the `prometheus` binary is not on PATH: install Debian's prometheus package "
                    "(.ci/install-prometheus.sh does, as root)")
    started = time.monotonic()
    with bench.running_stack(tmp_path_factory.mktemp("dashboard")) as stack:
        begin = time.time()
        traffic = bench.drive_traffic(stack, plan=bench.traffic_plan(bench.ALL_FORCED[:4], 2))
        stack.prometheus.wait_scraped_after(time.time())
        at = time.time()
        results = bench.evaluate(stack.prometheus, DASHBOARD, f"{int(at - begin) + 10}s", at)
        broken = stack.prometheus.query("sum(rate(rekv_request_seconds_count[1m])", at)
    print(f"dashboard end to end: {len(traffic)} requests, {time.monotonic() - started:.1f} s")
    return {"traffic": traffic, "results": results, "broken": broken}


def test_the_traffic_made_every_kind_of_event(live):
    outcomes = {}
    for record in live["traffic"]:
        outcomes.setdefault(record["kind"], []).append(record)
    assert all(r["outcome"] == "ok" and not r["fallback"] for k in ("forced", "planned")
               for r in outcomes[k])
    assert [r["action"].split()[1] for r in outcomes["forced"]] == [
        f"{codec}/{cut}" for codec, cut in bench.ALL_FORCED[:4]]
    assert all(r["outcome"] == "ok" and r["fallback"] for r in outcomes["fallback"])
    assert {r["outcome"] for r in outcomes["invalid"]} == {"INVALID_ARGUMENT"}
    assert len(outcomes["fallback"]) == len(outcomes["invalid"]) == 2


def test_a_parse_error_comes_back_as_an_error(live):
    """What the next test relies on: the API refuses an expression that does not parse."""
    assert live["broken"]["status"] == "error" and live["broken"]["errorType"] == "bad_data"


def test_every_panel_expression_parses_and_returns_series(live):
    results = live["results"]
    assert len(results) == len(TARGETS)
    errors = [f"{r['title']} {r['ref']}: {r['error']}\n  {r['expr']}" for r in results
              if r["status"] != "success"]
    assert not errors, "\n".join(errors)
    empty = [f"{r['title']} {r['ref']}: {len(r['series'])} series, none a number\n  {r['expr']}"
             for r in results if not any(math.isfinite(s["value"]) for s in r["series"])]
    assert not empty, "\n".join(empty)


def test_the_action_mix_shows_every_action_that_ran(live):
    mix = next(r for r in live["results"] if r["title"].startswith("Action mix"))
    shown = {bench.legend(mix["legend"], s["labels"]) for s in mix["series"]}
    ran = {r["action"] for r in live["traffic"] if r["kind"] in ("forced", "planned")}
    assert ran <= shown, f"ran {ran}, the panel shows {shown}"
