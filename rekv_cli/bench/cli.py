"""`rekv bench handoff`, `rekv bench ttft` and `rekv bench link`: their flags, tables and JSON (the
runs themselves are `rekv_cli.bench.handoff`, `rekv_cli.bench.ttft` and `rekv_cli.bench.link`).
Each command reads its `provenance` before anything else and records it in the JSON's meta."""

from __future__ import annotations

import argparse
import sys

from rekv_cli.bench.provenance import IN_PROCESS, LINK, provenance
from rekv_cli.util import csv_of, write_json


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (results go under bench/results/)")
    which = bench.add_subparsers(dest="bench", required=True)
    handoff = which.add_parser(
        "handoff", help="every handoff action over the throttled in-process link",
        description="Time every handoff action end to end over the throttled in-process link: "
                    "medians with 95%% bootstrap intervals, speedup over full BF16 transfer, "
                    "overlapped vs sequential schedules and the eq. 9 cost model.")
    handoff.add_argument("--model", default=None, help="model source (env REKV_MODEL; default "
                         "the embedded smollm2-135m)")
    handoff.add_argument("--device", default=None, help="cpu, cuda or cuda:N (env REKV_DEVICE)")
    handoff.add_argument("--dtype", default=None, help="auto, float32 or bfloat16 (env REKV_DTYPE)")
    handoff.add_argument("--threads", type=int, default=None,
                         help="torch intra-op threads (env REKV_TORCH_THREADS; 0 = all cores)")
    handoff.add_argument("--prompt-len", type=csv_of(int), default=[512, 2048],
                         help="prompt lengths S, comma-separated (default 512,2048)")
    handoff.add_argument("--link-gbps", type=csv_of(str), default=["x0.5", "x1", "x4"],
                         help="link rates, comma-separated: Gb/s, or xK = K times the rate at "
                              "which all layers' BF16 KV takes as long to send as all layers "
                              "take to compute (default x0.5,x1,x4)")
    handoff.add_argument("--cuts", type=csv_of(int), default=None,
                         help="cuts c for the recompute and joint sweeps (default L/5..4L/5)")
    handoff.add_argument("--quant-codecs", type=csv_of(str), default=["int8", "int4"],
                         help="codecs for transfer-only (default int8,int4)")
    handoff.add_argument("--joint-codecs", type=csv_of(str), default=["int8", "int4"],
                         help="codecs for the joint cut sweep (default int8,int4)")
    handoff.add_argument("--sequential-codecs", type=csv_of(str), default=["int8"],
                         help="prefix codecs whose cut sweep is also run with the sequential "
                              "schedule (default int8)")
    handoff.add_argument("--warmups", type=int, default=3)
    handoff.add_argument("--runs", type=int, default=10)
    handoff.add_argument("--json", metavar="FILE",
                         help="also write meta, rows and summaries (rewritten after each "
                              "case: a run stopped early keeps what it finished, complete=false)")
    handoff.set_defaults(func=cmd_bench_handoff)

    add_ttft_parser(which)

    link = which.add_parser(
        "link", help="the two services across an emulated cross-node link (needs root)",
        description="Run the prefill and decode services in two network namespaces joined by a "
                    "veth pair shaped with tc tbf, and time TTFT from arrival for every action "
                    "under the baseline, the seed's and the streamed schedules, and the "
                    "planner's pick, per prompt length and link rate. Without root it falls "
                    "back to loopback with paced UCX sends. No delay emulation (no netem on "
                    "this kernel).")
    link.add_argument("--model", default=None, help="model source (env REKV_MODEL; default "
                      "smollm2-135m), e.g. synthetic:mini-qwen2.5-7b")
    link.add_argument("--policy", default=None, help="`rekv gate` output the services load "
                      "(default: the policy shipped for the model; none: lossless actions only)")
    link.add_argument("--service-arg", action="append", default=[], metavar="FLAG",
                      help="one more flag for both services, e.g. "
                           "--service-arg=--ucx-loop-nice=0 (repeatable)")
    link.add_argument("--dtype", default="bfloat16", help="service dtype (default bfloat16)")
    link.add_argument("--threads", type=int, default=None, help="torch threads per service")
    link.add_argument("--prompt-len", type=csv_of(int), default=None,
                      help="prompt lengths (default 256,1024; --quick: 256)")
    link.add_argument("--link-gbps", type=csv_of(str), default=None,
                      help="link rates: Gb/s or xK (K times the balanced rate); default "
                           "x1,x4,10 (--quick: x1,10)")
    link.add_argument("--cuts", type=csv_of(int), default=None,
                      help="cuts of the BF16-recompute and joint int8 sweeps (default "
                           "0.3L,0.5L,0.7L; --quick: 0.5L)")
    link.add_argument("--warmups", type=int, default=3)
    link.add_argument("--runs", type=int, default=10)
    link.add_argument("--quick", action="store_true", help="a small sweep, under 5 minutes")
    link.add_argument("--codecs", type=csv_of(str), default=[],
                      help="newer options to time too, streamed at every cut, and offered to the "
                           "planner (e.g. int4h,spectrum50,splitzip: splitzip also codes the "
                           "boundary of the int8 joint actions)")
    link.add_argument("--loopback", action="store_true",
                      help="skip the namespaces: loopback with paced UCX sends")
    link.add_argument("--no-pin", dest="pin", action="store_false",
                      help="let both services use every core (default: each on its own half)")
    link.add_argument("--log-dir", default=None, help="the services' logs")
    link.add_argument("--json", metavar="FILE", help="write meta, rows and per-point summaries")
    link.add_argument("--plot", metavar="PNG", help="write the Fig. 2-style plot")
    link.set_defaults(func=cmd_bench_link)


def cmd_bench_handoff(args: argparse.Namespace) -> int:
    started = provenance(measures=(*IN_PROCESS, "rekv_cli/bench/handoff.py",
                                   "rekv_cli/bench/stats.py"))
    from rich.console import Console

    from rekv_cli.bench.handoff import BenchConfig, LinkRate, run_bench
    from rekv_core.codecs import get_codec
    from rekv_core.settings import RuntimeSettings

    if args.warmups < 0:
        raise ValueError(f"warmups: must be >= 0, got {args.warmups}")
    if args.runs < 1:
        raise ValueError(f"runs: must be >= 1, got {args.runs}")
    if not args.prompt_len or min(args.prompt_len) < 1:
        raise ValueError(f"prompt-len: need positive lengths, got {args.prompt_len}")
    for codec in (*args.quant_codecs, *args.joint_codecs, *args.sequential_codecs):
        get_codec(codec)
    rates = [LinkRate.parse(text) for text in args.link_gbps]
    settings = RuntimeSettings.from_env(model=args.model, device=args.device, dtype=args.dtype,
                                        torch_threads=args.threads)
    threads = settings.apply_threads()
    console = Console(stderr=True)
    model = settings.load_model()
    config = BenchConfig(prompt_lens=args.prompt_len, link_rates=rates, cuts=args.cuts,
                         quant_codecs=args.quant_codecs, joint_codecs=args.joint_codecs,
                         sequential_codecs=args.sequential_codecs, warmups=args.warmups,
                         runs=args.runs,
                         extra={"command": "rekv " + " ".join(sys.argv[1:])
                                if sys.argv[0].endswith("rekv") else None, **started})
    console.print(f"{model.shape.name}: {model.shape.num_layers} layers, {model.dtype}, "
                  f"{model.device}, {threads} torch threads")
    results = run_bench(model, config, progress=lambda line: console.log(line),
                        on_point=lambda partial: write_json(args.json, partial, indent=1))
    print_results(results)
    write_json(args.json, results, indent=1)
    return 0


def print_results(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    rows = results["rows"]
    for point in results["points"]:
        S = point["prompt_len"]
        for link in dict.fromkeys(r["link"] for r in rows if r["prompt_len"] == S):
            here = [r for r in rows if r["prompt_len"] == S and r["link"] == link]
            table = Table(title=f"S = {S} tokens, link {link} = {here[0]['link_gbps']:.3g} Gb/s "
                                f"(all layers compute in {point['compute_all_ms']:.0f} ms)")
            for column in ("action", "codec", "cut", "sched", "KiB", "Q", "H", "X", "R", "J",
                           "median ms", "95% CI", "model ms", "× bf16"):
                table.add_column(column, justify="left" if column in ("action", "codec", "sched")
                                 else "right")
            for r in here:
                table.add_row(r["action"], r["codec"], str(r["cut"]), r["schedule"][:3],
                              f"{r['bytes'] / 1024:.0f}",
                              *(f"{r[f'{p}_ms']:.0f}" for p in ("Q", "H", "X", "R", "J")),
                              f"{r['median_ms']:.0f}",
                              f"{r['ci95_ms'][0]:.0f}–{r['ci95_ms'][1]:.0f}",
                              f"{r['model_ms']:.0f}", f"{r['speedup_vs_bf16']:.2f}")
            console.print(table)
    pairs = Table(title="Overlapped vs sequential schedule at the same cut (ms)")
    for column in ("S", "link", "action", "codec", "cut", "overlap", "sequential", "seq/ov",
                   "ov model", "ov measured/model"):
        pairs.add_column(column, justify="right")
    for p in results["overlap_vs_sequential"]:
        pairs.add_row(str(p["prompt_len"]), p["link"], p["action"], p["codec"], str(p["cut"]),
                      f"{p['overlap_ms']:.0f}", f"{p['sequential_ms']:.0f}",
                      f"{p['sequential_over_overlap']:.2f}", f"{p['overlap_model_ms']:.0f}",
                      f"{p['overlap_measured_over_model']:.2f}")
    console.print(pairs)
    shared = Table(title="Suffix compute per layer, alone vs beside the prefix branch (ms)")
    for column in ("S", "link", "alone", "overlapped", "slowdown"):
        shared.add_column(column, justify="right")
    for c in results["contention"]:
        shared.add_row(str(c["prompt_len"]), c["link"], f"{c['suffix_ms_per_layer_alone']:.1f}",
                       f"{c['suffix_ms_per_layer_overlapped']:.1f}", f"{c['slowdown']:.2f}")
    console.print(shared)


def add_ttft_parser(which) -> None:
    ttft = which.add_parser(
        "ttft", help="TTFT from arrival: P/D baseline, the seed's handoff, streamed, chunked, "
                     "colocated",
        description="Time to first token from the request's arrival over the throttled "
                    "in-process link, five ways side by side: (a) full prefill then BF16 "
                    "transfer, (b) full prefill then the seed's overlapped handoff, (c) the "
                    "handoff streamed from inside a prefill that stops at the cut, (d) the same "
                    "with the boundary in chunks, (e) a colocated prefill (the bound).")
    ttft.add_argument("--model", default=None, help="model source (env REKV_MODEL; default "
                      "the embedded smollm2-135m), e.g. synthetic:mini-qwen2.5-7b")
    ttft.add_argument("--device", default=None, help="cpu, cuda or cuda:N (env REKV_DEVICE)")
    ttft.add_argument("--dtype", default=None, help="auto, float32 or bfloat16 (env REKV_DTYPE)")
    ttft.add_argument("--threads", type=int, default=None,
                      help="torch intra-op threads (env REKV_TORCH_THREADS; 0 = all cores)")
    ttft.add_argument("--prompt-len", type=csv_of(int), default=[512, 1024],
                      help="prompt lengths, comma-separated (default 512,1024)")
    ttft.add_argument("--link-gbps", type=csv_of(str), default=["x1", "x4", "10"],
                      help="link rates: Gb/s or xK, K times the balanced rate (default x1,x4,10)")
    ttft.add_argument("--cuts", type=csv_of(int), default=None,
                      help="cuts of the joint and recompute actions (default L/5..4L/5)")
    ttft.add_argument("--codecs", type=csv_of(str), default=["int8"],
                      help="prefix codecs of the joint actions besides BF16 (default int8)")
    ttft.add_argument("--chunk-tokens", type=int, default=256,
                      help="the boundary's chunk size for (d) (a multiple of 256; default 256)")
    ttft.add_argument("--warmups", type=int, default=1, help="untimed rounds (default 1)")
    ttft.add_argument("--runs", type=int, default=5, help="timed rounds (default 5)")
    ttft.add_argument("--json", metavar="FILE",
                      help="also write meta, rows and points (rewritten after each point: a run "
                           "stopped early keeps its finished points, complete=false)")
    ttft.set_defaults(func=cmd_bench_ttft)


def cmd_bench_ttft(args: argparse.Namespace) -> int:
    started = provenance(measures=(*IN_PROCESS, "rekv_cli/bench/handoff.py",
                                   "rekv_cli/bench/ttft.py", "rekv_cli/bench/stats.py"))
    from rich.console import Console
    from rich.table import Table

    from rekv_cli.bench.handoff import LinkRate
    from rekv_cli.bench.ttft import PAIRED, SCHEDULES, TtftConfig, run_ttft_bench
    from rekv_core.codecs import get_codec
    from rekv_core.model.blocks import chunk_bounds
    from rekv_core.settings import RuntimeSettings

    if args.warmups < 0 or args.runs < 1:
        raise ValueError("warmups/runs: need warmups >= 0 and runs >= 1")
    if not args.prompt_len or min(args.prompt_len) < 1:
        raise ValueError(f"prompt-len: need positive lengths, got {args.prompt_len}")
    chunk_bounds(1, args.chunk_tokens)  # ValueError naming chunk_tokens
    for codec in args.codecs:
        get_codec(codec)
    settings = RuntimeSettings.from_env(model=args.model, device=args.device, dtype=args.dtype,
                                        torch_threads=args.threads)
    threads = settings.apply_threads()
    model = settings.load_model()
    console = Console(stderr=True)
    console.print(f"{model.shape.name}: {model.shape.num_layers} layers, {model.dtype}, "
                  f"{model.device}, {threads} torch threads")
    config = TtftConfig(prompt_lens=args.prompt_len,
                        link_rates=[LinkRate.parse(t) for t in args.link_gbps], cuts=args.cuts,
                        codecs=args.codecs, chunk_tokens=args.chunk_tokens,
                        warmups=args.warmups, runs=args.runs,
                        extra={"command": "rekv " + " ".join(sys.argv[1:]), **started})
    results = run_ttft_bench(model, config, progress=console.log,
                             on_point=lambda partial: write_json(args.json, partial, indent=1))
    table = Table(title="TTFT from arrival, best action of each schedule (median ms)")
    for column in ("S", "link", "Gb/s", *SCHEDULES, *(name for name, _ in PAIRED)):
        table.add_column(column, justify="right")
    for p in results["points"]:
        best = p["best"]
        table.add_row(str(p["prompt_len"]), p["link"], f"{p['link_gbps']:.3g}",
                      *(f"{best[s]['median_ms']:.0f} {best[s]['label'].partition(' ')[2]}"
                        for s in SCHEDULES),
                      *(f"{p[key]:.2f}" for _, key in PAIRED))
    Console(width=180).print(table)
    print_paired(results["points"], PAIRED, Console(width=180))
    print_codec_gains(results["points"], Console(width=180))
    write_json(args.json, results, indent=1)
    return 0


def print_paired(points: list[dict], ratios, console) -> None:
    """Each point's ratios taken round by round (`points[i]["paired"]`): median [95% CI]."""
    from rich.table import Table

    table = Table(title="The same ratios, of the samples of each round (median [95% CI])")
    for column in ("S", "link", *(name for name, _ in ratios)):
        table.add_column(column, justify="right")
    for p in points:
        cells = []
        for _, key in ratios:
            r = p["paired"].get(key)
            cells.append("—" if r is None else
                         f"{r['median']:.2f} [{r['ci95'][0]:.2f}–{r['ci95'][1]:.2f}]")
        table.add_row(str(p["prompt_len"]), p["link"], *cells)
    console.print(table)


def print_codec_gains(points: list[dict], console) -> None:
    """The points' `codec_gains` (`rekv_cli.bench.ttft.codec_gains`), where they have them."""
    from rich.table import Table

    if not any(p.get("codec_gains") for p in points):
        return
    gains = Table(title="The best handoff with bf16/int8/int4 only, and with each newer option "
                        "allowed (median ms; × = before / after)")
    for column in ("S", "link", "option", "best", "ms", "×"):
        gains.add_column(column, justify="right")
    for p in points:
        for option, g in (p.get("codec_gains") or {}).items():
            gains.add_row(str(p["prompt_len"]), p["link"], option, g["label"],
                          f"{g['median_ms']:.0f}", f"{g.get('base_over_best', 1.0):.2f}")
    console.print(gains)


def cmd_bench_link(args: argparse.Namespace) -> int:
    started = provenance(measures=LINK)
    from rich.console import Console
    from rich.table import Table

    from rekv_cli.bench.handoff import LinkRate
    from rekv_cli.bench.link.report import LINK_PAIRED, plot
    from rekv_cli.bench.link.sweep import LinkBenchConfig, run_link_bench
    from rekv_core.settings import RuntimeSettings

    if args.warmups < 0 or args.runs < 1:
        raise ValueError("warmups/runs: need warmups >= 0 and runs >= 1")
    lengths = args.prompt_len or ([256] if args.quick else [256, 1024])
    rates = [LinkRate.parse(t) for t in (args.link_gbps or (["x1", "10"] if args.quick
                                                             else ["x1", "x4", "10"]))]
    settings = RuntimeSettings.from_env(model=args.model, dtype=args.dtype,
                                        torch_threads=args.threads)
    threads = settings.apply_threads()
    model = settings.load_model()
    L = model.shape.num_layers
    cuts = args.cuts or ([L // 2] if args.quick else None)
    service_args = ["--dtype", args.dtype, "--model", settings.model, "--device",
                    settings.device]
    if args.policy:
        service_args += ["--policy", args.policy]
    if args.codecs:
        service_args += ["--codecs", ",".join(dict.fromkeys(["bf16", "int8", *args.codecs]))]
    service_args += args.service_arg
    if not args.pin or args.threads:  # pinned services default to one thread per core
        service_args += ["--torch-threads", str(threads)]
    console = Console(stderr=True)
    config = LinkBenchConfig(prompt_lens=lengths, rates=rates, cuts=cuts, warmups=args.warmups,
                             runs=args.runs, service_args=service_args, log_dir=args.log_dir,
                             loopback=args.loopback, pin=args.pin, codecs=args.codecs)
    results = run_link_bench(model, config, progress=console.log)
    results["meta"].update(command="rekv " + " ".join(sys.argv[1:]), **started)
    out = Console(width=160)
    for point in results["points"]:
        S, link = point["prompt_len"], point["link"]
        table = Table(title=f"S = {S}, link {link} = {point['link_gbps']:.3g} Gb/s: TTFT from "
                            f"arrival")
        for column in ("case", "median ms", "95% CI", "predicted ms", "× baseline",
                       "handoff ms", "Q", "H", "X", "R", "J"):
            table.add_column(column, justify="left" if column == "case" else "right")
        for r in results["rows"]:
            if r["prompt_len"] == S and r["link"] == link:
                table.add_row(r["label"], f"{r['median_ms']:.1f}",
                              f"{r['ci95_ms'][0]:.1f}–{r['ci95_ms'][1]:.1f}",
                              f"{r['predicted_ms']:.1f}", f"{r['speedup_vs_bf16']:.2f}",
                              f"{r['handoff_median_ms']:.0f}",
                              *(f"{r['parts_median_ms'][k]:.0f}" for k in "QHXRJ"))
        out.print(table)
    summary = Table(title="Per point, TTFT of each way's best case (ms): (a) baseline, (b) the "
                          "seed's, (c) streamed, (d) streamed + chunked, (d') the same pipelined, "
                          "(e) local prefill; the planner against the best forced case")
    for column in ("S", "link", "Gb/s", "(a)", "(b)", "(c)", "(d)", "(d')", "(e)", "(d)/(e)",
                   "(a)/(d)", "(b)/(d)", "(d')/(e)", "(a)/(d')", "(b)/(d')", "planner", "ms",
                   "within 10%"):
        summary.add_column(column, justify="right")
    for p in results["points"]:
        ways = p["ways"]
        summary.add_row(str(p["prompt_len"]), p["link"], f"{p['link_gbps']:.3g}",
                        *(f"{ways[w]['median_ms']:.0f}" if w in ways else "—" for w in
                          ("baseline", "seed", "streamed", "chunked", "pipelined",
                           "local_prefill")),
                        *(f"{p[key]:.2f}" if key in p else "—" for _, key in LINK_PAIRED),
                        p["planner"]["label"],
                        f"{p['planner']['median_ms']:.1f}",
                        "yes" if p["planner_within_10pct"] else "NO")
    out.print(summary)
    print_paired(results["points"], LINK_PAIRED, out)
    print_codec_gains(results["points"], out)
    write_json(args.json, results, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0
