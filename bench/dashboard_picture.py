"""The overview dashboard (helm/rekv/dashboards/rekv-overview.json) against a real Prometheus
scraping the real services, and its picture: `python bench/dashboard_picture.py [--rounds 3]`.

`running_stack`: Prometheus (bench/prometheus_server.py) on a free loopback port
scraping every second a prefill service, a decode service pointed at it (`ServicePair`) and a
decode service whose prefill address is closed (it falls back). `drive_traffic`: `traffic_plan`'s
requests, to 127.0.0.1 only. `evaluate`: every panel target through the HTTP API, template
variables at "All". `main` draws the panels over the traffic window like the dashboard's grid into
bench/results/dashboard-overview.png (values: .json, the run: .md). tests/system/test_dashboards.py
imports this module and runs one round.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # the bench's own modules beside it

import grpc  # noqa: E402

from rekv_cli.client import generate  # noqa: E402
from rekv_cli.launcher import ServicePair, ServiceProcess  # noqa: E402

from prometheus_server import SCRAPE_S, Prometheus  # noqa: E402

DASHBOARD = ROOT / "helm" / "rekv" / "dashboards" / "rekv-overview.json"
# what the picture measures (`provenance`), beyond the two services as processes
MEASURES = ("bench/dashboard_picture.py", "bench/prometheus_server.py",
            "helm/rekv/dashboards/rekv-overview.json")
MODEL = "smollm2-135m"  # the embedded model
PROFILE = ROOT / "rekv_core" / "plan" / "profiles" / f"{MODEL}.json"
CLOSED_PREFILL = "127.0.0.1:1"  # nothing listens there: the orphan decode worker falls back
PROMPTS = (  # the long one first: a BF16 transfer of it is large enough for a link sample
    "There is important information hidden in this text. The pass key is 4417. Remember it. "
    + "The grass is green. The sky is blue. " * 8 + "What is the pass key? The pass key is",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
)
ALL_FORCED = (("bf16", 30), ("int8", 15), ("bf16", 15), ("bf16", 0), ("int8", 30))
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def service_args(threads: int = 1) -> list[str]:
    """Quick on a CPU: the embedded model, one torch thread per service, the shipped profile
    (no measurement at start)."""
    return ["--dtype", "bfloat16", "--torch-threads", str(threads), "--max-prompt-tokens", "600",
            "--max-new-tokens", "16", "--codecs", "bf16,int8,int4", "--profile", str(PROFILE)]


def load_dashboard(path: Path = DASHBOARD) -> dict:
    return json.loads(Path(path).read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel that draws something (not rows), including those inside collapsed rows."""
    return [q for p in dashboard["panels"]
            for q in (p.get("panels", []) if p["type"] == "row" else [p])]


def variables(window: str, step: str) -> dict[str, str]:
    """What Grafana would substitute with every template variable at "All"."""
    return {"__rate_interval": window, "__interval": step, "__range": window,
            "namespace": ".*", "job": ".*", "instance": ".*"}


def render(expr: str, values: dict[str, str]) -> str:
    """`expr` with each `$name` / `${name}` replaced; KeyError naming an unknown variable."""
    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"template variable ${name} has no value")
        return values[name]
    return VARIABLE.sub(one, expr)


class Stack(NamedTuple):
    pair: ServicePair
    orphan: ServiceProcess  # a decode worker whose prefill address is closed
    prometheus: Prometheus


@contextmanager
def running_stack(workdir: Path, threads: int = 1) -> Iterator[Stack]:
    """Prefill + decode (`ServicePair`), the orphan decode worker and Prometheus scraping all
    three; everything stopped on the way out."""
    args = service_args(threads)
    (workdir / "orphan").mkdir(parents=True, exist_ok=True)
    orphan = ServiceProcess(  # random weights of the same shape: it only ever recomputes
        "decode", [*args, "--model", f"synthetic:{MODEL}", "--prefill-address", CLOSED_PREFILL],
        workdir / "orphan")
    pair = prometheus = None
    try:
        # every lossy handoff checked by the quality canary, so that its panels have figures
        pair = ServicePair(args, [*args, "--canary-fraction", "1"], log_dir=workdir / "services",
                           ready_timeout=120)
        orphan.wait_ready(120)
        prometheus = Prometheus(
            {"rekv-decode": [pair.decode.info["metrics"], orphan.info["metrics"]],
             "rekv-prefill": [pair.prefill.info["metrics"]]}, workdir / "prometheus")
        prometheus.wait_scraped_after(time.time(), scrapes=1)  # rates start from before traffic
        yield Stack(pair, orphan, prometheus)
    finally:
        if prometheus is not None:
            prometheus.stop()
        if pair is not None:
            pair.stop()
        orphan.stop()


def traffic_plan(forced=ALL_FORCED, planned: int = 3) -> list[tuple[str, dict]]:
    """One round: forced actions and planner-chosen ones on the pair, between two fallbacks
    (orphan) and two refused requests (max_new_tokens 0), so that every labelled counter moves
    at least twice with scrapes between (a rate needs an increase it saw)."""
    edge = [("fallback", {"prompt": list(range(1000, 1040))}),  # token ids: no tokenizer
            ("invalid", {"prompt": PROMPTS[1]})]
    middle = [("forced", {"prompt": PROMPTS[i % len(PROMPTS)], "forced": f})
              for i, f in enumerate(forced)]
    middle += [("planned", {"prompt": PROMPTS[i % len(PROMPTS)]}) for i in range(planned)]
    return edge + middle + edge


def _one(stack: Stack, kind: str, spec: dict, request_id: str, new_tokens: int) -> dict:
    address = stack.orphan.info["grpc"] if kind == "fallback" else stack.pair.decode_address
    record = {"kind": kind, "request_id": request_id, "forced": spec.get("forced")}
    with grpc.insecure_channel(address) as channel:
        try:
            result = generate(channel, request_id, spec["prompt"],
                              0 if kind == "invalid" else new_tokens,
                              forced_action=spec.get("forced"), timeout=120)
        except grpc.RpcError as error:
            return {**record, "outcome": error.code().name}
    s = result.summary
    return {**record, "outcome": "ok", "action": f"{s.action_kind} {s.action.codec}/"
            f"{s.action.cut}", "fallback": s.fallback, "prompt_tokens": s.prompt_tokens,
            "ttft_ms": round(s.ttft_ms, 1), "handoff_ms": round(s.measured_handoff_ms, 1)}


def drive_traffic(stack: Stack, rounds: int = 1, new_tokens: int = 4, gap_s: float = 0.5,
                  plan: list[tuple[str, dict]] | None = None) -> list[dict]:
    """Every request of `rounds` rounds of `plan`, one at a time, `gap_s` apart; a record each.
    Only 127.0.0.1 is ever called."""
    plan = plan or traffic_plan()
    done = []
    for r in range(rounds):
        for i, (kind, spec) in enumerate(plan):
            done.append(_one(stack, kind, spec, f"dash-{r}-{i}-{kind}", new_tokens))
            time.sleep(gap_s)
    return done


def _series(answer: dict) -> list[dict]:
    return [{"labels": item["metric"], "value": float(item["value"][1])} if "value" in item else
            {"labels": item["metric"], "t": [float(t) for t, _ in item["values"]],
             "v": [float(v) for _, v in item["values"]]}
            for item in answer.get("data", {}).get("result", [])]


def evaluate(prometheus: Prometheus, dashboard: dict, window: str, at: float,
             span: tuple[float, float] | None = None, step: float = 1.0) -> list[dict]:
    """Every panel target, template variables substituted (`window` for `$__rate_interval`):
    an instant query at `at`, or with `span` = (start, end) a range query ending at `at`. One
    entry a target: the expression sent, the API's status and error, the series returned."""
    values = variables(window, f"{step:g}s")
    results = []
    for panel in panels(dashboard):
        for target in panel["targets"]:
            expr = render(target["expr"], values)
            answer = (prometheus.query_range(expr, span[0], span[1], step) if span
                      else prometheus.query(expr, at))
            results.append({"panel": panel["id"], "title": panel["title"],
                            "ref": target["refId"], "legend": target.get("legendFormat", ""),
                            "expr": expr, "status": answer.get("status"),
                            "error": answer.get("error"), "series": _series(answer)})
    return results


def legend(template: str, labels: dict) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    return text if text and text != "__auto" else json.dumps(labels)


SCALES = {"s": ((1e-3, "ms"), (1, "s")), "bytes": ((1, "B"), (1024, "KiB"), (1 << 20, "MiB")),
          "bps": ((1e6, "Mb/s"), (1e9, "Gb/s")), "Gbits": ((1, "Gb/s"),),
          "reqps": ((1, "req/s"),), "percentunit": ((0.01, "%"),)}


def scale(unit: str, values) -> tuple[float, str]:
    """The largest of the unit's scales that keeps the biggest value at or above 1."""
    top = max((abs(v) for v in values if v == v), default=0.0)
    options = SCALES.get(unit, ((1, ""),))
    return next(((f, n) for f, n in reversed(options) if top >= f), options[0])


def _draw_panel(ax, panel: dict, entries: list[dict], start: float) -> None:
    defaults = panel["fieldConfig"]["defaults"]
    unit, stack = defaults.get("unit", "none"), defaults.get("custom", {}).get("stacking", {})
    lines = [(legend(e["legend"], s["labels"]), [t - start for t in s["t"]], s["v"])
             for e in entries for s in e["series"]]
    ax.tick_params(labelsize=7)
    if panel["type"] == "stat":  # Grafana's stat: the last value that is not null
        values = [v for _, _, vs in lines for v in vs if v == v]
        factor, name = scale(unit, values[-1:])
        ax.text(0.5, 0.45, f"{values[-1] / factor:.3g} {name}" if values else "no traffic",
                ha="center", va="center", fontsize=20, transform=ax.transAxes, color="#1f77b4")
        ax.set_xticks([]), ax.set_yticks([])
        return
    factor, name = scale(unit, [v for _, _, vs in lines for v in vs])
    if stack.get("mode") in ("normal", "percent") and lines:
        grid = sorted({t for _, ts, _ in lines for t in ts})  # series start at different times
        ys = [[0.0 if v != v else v / factor for v in map({**dict.fromkeys(grid, 0.0),
                                                          **dict(zip(ts, vs))}.get, grid)]
              for _, ts, vs in lines]
        if stack["mode"] == "percent":
            totals = [sum(column) or 1.0 for column in zip(*ys)]
            ys, name = [[100 * v / t for v, t in zip(y, totals)] for y in ys], "% of handoffs"
        ax.stackplot(grid, ys, labels=[label for label, _, _ in lines], alpha=0.8)
    else:
        for label, t, vs in lines:
            ax.plot(t, [v / factor for v in vs], label=label, linewidth=1.4)
    ax.set_ylabel(name, fontsize=8)
    if defaults["custom"].get("scaleDistribution", {}).get("type") == "log":
        ax.set_yscale("log", base=defaults["custom"]["scaleDistribution"]["log"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left", ncol=2 if len(lines) > 3 else 1, framealpha=0.7)


def draw(dashboard: dict, series: list[dict], start: float, path: Path, subtitle: str) -> None:
    """The panels where the dashboard's gridPos puts them (24 columns), titles, legends, units."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    top = bottom + 2  # two grid units for the title
    fig = plt.figure(figsize=(22, top * 0.5))
    fig.suptitle(f"{dashboard['title']}  ({subtitle})", fontsize=15, y=1 - 0.6 / top)
    for panel in dashboard["panels"]:
        x, y, w, h = (panel["gridPos"][k] for k in "xywh")
        if panel["type"] == "row":
            fig.text(0.005, 1 - (y + 2.6) / top, panel["title"], fontsize=13, fontweight="bold")
            continue
        ax = fig.add_axes([x / 24 + 0.025, 1 - (y + 1.55 + h) / top, w / 24 - 0.035,
                           (h - 1.0) / top])
        ax.set_title(panel["title"], fontsize=10, loc="left")
        _draw_panel(ax, panel, [e for e in series if e["panel"] == panel["id"]], start)
        if panel["type"] != "stat" and y + h >= bottom:
            ax.set_xlabel("seconds since the first request", fontsize=8)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_results(out: Path, dashboard: dict, run: dict) -> None:
    """dashboard-overview.png, .json (`run`: traffic, instant and range values) and .md."""
    traffic, instants = run["traffic"], run["instant"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "dashboard-overview.json").write_text(json.dumps(run) + "\n")
    draw(dashboard, run["range"], run["start"], out / "dashboard-overview.png",
         f"{len(traffic)} requests over {run['end'] - run['start']:.0f} s, {run['machine']}")
    kinds: dict[str, int] = {}
    for r in traffic:
        key = f"{r['kind']}: {r.get('action', r['outcome'])}"
        kinds[key] = kinds.get(key, 0) + 1
    rows = "\n".join(f"| {r['title']} | " + ", ".join(
        f"{legend(r['legend'], s['labels'])} = {s['value']:.4g}" for s in r["series"]) + " |"
        for r in instants)
    (out / "dashboard-overview.md").write_text(
        f"# The overview dashboard on real traffic\n\nMachine: {run['machine']}. Commit: "
        f"{run['commit']}. Command: `{run['command']}`. Prometheus {run['prometheus']} scraped "
        f"a prefill service, a decode service and a decode service whose prefill address is "
        f"closed every {SCRAPE_S:g} s. Traffic, one request at a time over "
        f"{run['end'] - run['start']:.0f} s:\n\n"
        + "\n".join(f"- {n} x {k}" for k, n in sorted(kinds.items()))
        + f"\n\n![dashboard](dashboard-overview.png)\n\nThe picture draws range queries with "
        f"`$__rate_interval` = {run['window']}; the table has every target at the end, over "
        f"the whole traffic window.\n\n| panel | series = value |\n| --- | --- |\n{rows}\n")


def main(argv: list[str] | None = None) -> int:
    import argparse

    from rekv_cli.bench.machine import cpu_model
    from rekv_cli.bench.provenance import SERVICES, provenance

    started = provenance(measures=(*SERVICES, *MEASURES))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", default="15s", help="$__rate_interval of the picture")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    if shutil.which("prometheus") is None:
        print("no prometheus binary: run .ci/install-prometheus.sh", file=sys.stderr)
        return 2
    dashboard = load_dashboard()
    with tempfile.TemporaryDirectory(prefix="rekv-dashboard-") as tmp, \
            running_stack(Path(tmp)) as stack:
        start = time.time()
        traffic = drive_traffic(stack, rounds=args.rounds, gap_s=1.0)
        stack.prometheus.wait_scraped_after(time.time())
        end = time.time()
        prom = stack.prometheus
        run = {"dashboard": str(DASHBOARD.relative_to(ROOT)), "prometheus": prom.version,
               "machine": f"{cpu_model()}, {os.cpu_count()} cores", **started,
               "command": " ".join(["python bench/dashboard_picture.py", *(argv or [])]),
               "window": args.window, "start": start, "end": end, "traffic": traffic,
               "instant": evaluate(prom, dashboard, f"{int(end - start) + 5}s", end),
               "range": evaluate(prom, dashboard, args.window, end, (start - 2, end))}
    write_results(args.out_dir, dashboard, run)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
