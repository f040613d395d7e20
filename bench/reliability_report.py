"""The reliability load bench's report: percentiles and counts per phase and action, and the
markdown the bench prints (`bench/reliability_load.py`)."""

from __future__ import annotations

import math
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_requests import MIX, ROLES, SAMPLE_EVERY, Outcome  # noqa: E402


def percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return {"n": len(values), "p50": float(p50), "p95": float(p95), "p99": float(p99),
            "max": float(max(values)), "mean": float(np.mean(values))}


def _times(outcomes: list[Outcome]) -> dict:
    return {name: percentiles([v for o in outcomes if (v := getattr(o, name)) is not None])
            for name in ("ttft_ms", "handoff_ms", "client_ms")}


def summarize(outcomes: list[Outcome], wall_s: float) -> dict:
    """Counts by status, latency percentiles overall and by the action used, throughput."""
    ok = [o for o in outcomes if o.status == "OK"]
    statuses = Counter(o.status for o in outcomes)
    failed = {s: n for s, n in sorted(statuses.items()) if s not in ("OK", "LOST")}
    by_label, by_action = defaultdict(list), defaultdict(list)
    requested = defaultdict(Counter)
    for o in ok:
        by_label[o.label].append(o)
        by_action[o.used].append(o)
        requested[o.label][o.used] += 1
    return {"requests": len(outcomes), "ok": len(ok), "lost": statuses["LOST"],
            "failed": sum(failed.values()), "failed_by_status": failed,
            "fallbacks": sum(bool(o.fallback) for o in ok),
            "checked": sum(o.match is not None for o in outcomes),
            "mismatches": sum(o.match is False for o in outcomes),
            "wall_s": wall_s, "requests_per_s": len(ok) / wall_s,
            "tokens_per_s": sum(len(o.tokens) for o in ok) / wall_s,
            "prompt_tokens_mean": float(np.mean([o.prompt_tokens for o in outcomes])),
            **_times(ok),
            "per_label": {label: {"requests": len(by_label[label]), **_times(by_label[label])}
                          for label, _ in MIX if label in by_label},
            "per_action": {k: {"requests": len(v), **_times(v)}
                           for k, v in sorted(by_action.items())},
            "requested_vs_used": {k: dict(v) for k, v in sorted(requested.items())}}


def _ms(p: dict | None) -> str:
    return " / ".join(f"{p[k]:.0f}" for k in ("p50", "p95", "p99")) if p else "-"


def _latency_rows(name: str, s: dict) -> list[str]:
    rows = [(f"| {name}: all | {s['ok']} | {_ms(s['ttft_ms'])} | {_ms(s['handoff_ms'])} | "
            f"{_ms(s['client_ms'])} |")]
    for label, a in s["per_label"].items():
        rows.append(f"| {name}: {label} | {a['requests']} | {_ms(a['ttft_ms'])} | "
                    f"{_ms(a['handoff_ms'])} | {_ms(a['client_ms'])} |")
    return rows


def _outcome_row(name: str, s: dict) -> str:
    failed = ", ".join(f"{k} {v}" for k, v in s["failed_by_status"].items()) or "0"
    return (f"| {name} | {s['requests']} | {s['ok']} | {failed} | {s['lost']} | "
            f"{s['fallbacks']} | {s['mismatches']} of {s['checked']} | {s['wall_s']:.1f} | "
            f"{s['requests_per_s']:.2f} | {s['tokens_per_s']:.1f} |")


def _curve_rows(curve: list[dict], rows: int = 21) -> list[str]:
    step = max(1, math.ceil((len(curve) - 1) / (rows - 1)))
    points = curve[::step] + ([] if (len(curve) - 1) % step == 0 else curve[-1:])
    return [f"| {p['requests']} | {p['t_s']:.0f} | {p['prefill']['rss_mib']:.0f} | "
            f"{p['decode']['rss_mib']:.0f} | {p['prefill']['threads']} | "
            f"{p['decode']['threads']} | {p['decode'].get('link_gbps') or 0:.4f} |"
            for p in points]


def _map_rows(mem: dict) -> list[str]:
    maps = [mem[when][role] for role in ROLES for when in ("map_ready", "map_end")]
    kinds = sorted({k for m in maps for k, mib in m["rss_mib_by_kind"].items() if mib >= 1},
                   key=lambda k: -maps[-1]["rss_mib_by_kind"].get(k, 0.0))
    rows = ["| kind | prefill ready | prefill end | decode ready | decode end |",
            "|---|---|---|---|---|"]
    for kind in kinds:
        rows.append(f"| {kind} | " + " | ".join(f"{m['rss_mib_by_kind'].get(kind, 0.0):.0f}"
                                                  for m in maps) + " |")
    rows.append("| (64 MiB-aligned arena mappings, count) | " +
                " | ".join(str(m["arena_mappings"]) for m in maps) + " |")
    return rows


def markdown(result: dict) -> str:
    m, b, s, mem = result["meta"], result["burst"], result["sustained"], result["memory"]
    lines = [f"- Machine: {m['cpu']} ({m['cores']} cores); torch {m['torch']}; commit "
             f"{m['commit']}" + (" (with uncommitted changes)" if m["tree_clean"] is False
                                 else ""),
             f"- Command: `{m['command']}`",
             f"- Services: `{' '.join(m['service_args'])}`" + (f", env {m['env']}" if m["env"]
                                                            else ""),
             (f"- Run: {m['wall_s']:.0f} s in all; burst of {b.get('requests', 0)} streams "
             f"(most open at once on the client: {b['most_open_streams']}, peak decode queue "
             f"depth {b['peak_decode_queue_depth']:.0f}); sustained {s['requests']} requests at "
             f"concurrency {m['settings']['concurrency']}, mean prompt "
             f"{s['prompt_tokens_mean']:.0f} tokens"), "",
             ("| phase | requests | ok | failed | lost | fallbacks | mismatches | wall s | req/s "
             "| tokens/s |"), "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_outcome_row(name, p) for name, p in (("burst", b), ("sustained", s))
              if "requests" in p]
    lines += ["", "Milliseconds, p50 / p95 / p99, by the action asked for:", "",
              "| phase: asked | ok | TTFT | handoff | whole call |", "|---|---|---|---|---|"]
    for name, p in (("burst", b), ("sustained", s)):
        if "requests" in p:
            lines += _latency_rows(name, p)
    lines += ["", "Requested -> used (sustained):", ""]
    lines += [f"- {label}: " + ", ".join(f"{k} x{v}" for k, v in used.items())
              for label, used in s["requested_vs_used"].items()]
    lines += ["", f"Memory curve (sustained; RSS MiB, every {SAMPLE_EVERY} requests, thinned):",
              "", ("| requests | t s | prefill RSS | decode RSS | prefill threads | decode threads "
              "| decode link estimate Gb/s |"), "|---|---|---|---|---|---|---|",
              *_curve_rows(mem["curve"]), ""]
    for role, g in mem["growth"].items():
        lines.append(f"- {role}: {g['start_mib']:.0f} -> {g['mid_mib']:.0f} -> "
                     f"{g['end_mib']:.0f} MiB (first half {g['first_half_mib']:+.1f}, last half "
                     f"{g['second_half_mib']:+.1f}); stopped growing: {g['stopped_growing']}")
    lines += ["", "Resident MiB by kind of mapping (/proc/<pid>/smaps), at ready and at the end:",
              "", *_map_rows(mem)]
    t, g, c = result["threads"], result["gauges_end"], result["check"]
    lines += ["", (f"- Threads (prefill, decode): ready {t['ready']}, after the burst "
              f"{t['after_burst']}, end {t['end']}"),
              f"- Gauges at the end (after {g['seconds']} s): " +
              "; ".join(f"{r} {g[r]}" for r in ROLES),
              f"- Exit codes: {result['exit_codes']}",
              (f"- Reference check: {c['mismatches']} mismatches of {c['checked']} lossless "
              f"requests ({c['references']} references, {c['seconds']} s); "
              f"{c['lossy_not_checked']} lossy requests not checked")]
    return "\n".join(lines)
