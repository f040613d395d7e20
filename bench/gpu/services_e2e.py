#!/usr/bin/env python3
"""Both rekv services as processes on one machine, on a small random Hugging Face checkpoint:
every lossless action must reproduce the single-process greedy reference token for token.

A random Llama checkpoint (fixed seed; head_dim a multiple of 64, as the int8/int4 codecs need) is
built with `transformers` into a temporary directory; `rekv serve prefill` and `rekv serve decode`
load it on `--device` in `--dtype`, talk gRPC on loopback and hand off over UCX. For a few random
token-id prompts each lossless action is forced (full BF16 transfer, BF16 recompute at interior
cuts, token-only) and one request is left to the planner; the new tokens (stop_at_eos off) are
compared with `greedy_generate` on the same checkpoint, device and dtype in this process. Both
services run with UCX_PROTO_INFO=y: their logs name the UCX transports that carried the data.

BF16 is the default dtype on every device: the wire carries h_c and the head in BF16 and the
`bf16` codec is lossless only for a BF16 cache, so under float32 no action is bit-exact.

Usage: bench/gpu/services_e2e.py --out DIR [--device cuda] [--dtype bfloat16] [--dry-run]
Writes DIR/services_e2e.json and the services' logs (DIR/prefill.log, DIR/decode.log); exits 0
only if every judged case matched.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from any folder, rekv installed or not

import torch  # noqa: E402

from rekv_cli.bench.provenance import SERVICES, provenance  # noqa: E402

# what the figures measure (`provenance`): the two services as processes on the device
MEASURES = (*SERVICES, "bench/gpu/services_e2e.py")

UCX_TLS_NAMES = ("cuda_ipc", "cuda_copy", "gdr_copy", "rocm_ipc", "rocm_copy", "tcp", "rc_mlx5",
                 "rc_verbs", "dc_mlx5", "ud_mlx5", "ud_verbs", "rc", "dc", "ud", "posix", "sysv",
                 "xpmem", "cma", "knem", "self", "sm", "shm")
TLS_PATTERN = re.compile(r"(?<![\w/])(" + "|".join(UCX_TLS_NAMES) + r")/[\w.:\-]+")
# "| ucp_context_0 intra-node cfg#1 | tagged message by ucp_tag_send* from host memory |", or
# "... from cuda/GPU0 ...": the memory type of the rows below, which name "tl/device" per range.
MEMORY_PATTERN = re.compile(
    r"\bfrom (host|cuda[- ]managed|cuda|rocm[- ]managed|rocm|ze[- ]\w+|rdma)\b", re.I)
WARMUPS = 3
PROTO_LINE = re.compile(r"^\[\d+\.\d+\]\s+\[[^\]]*\]\s+(?=[|+])")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="folder for services_e2e.json and the logs")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="of both services and the reference")
    for name, default in (("layers", 8), ("hidden", 512), ("heads", 8), ("kv-heads", 2),
                          ("intermediate", 1408), ("vocab", 4096), ("max-positions", 4096),
                          ("new-tokens", 16), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default, help="int")
    p.add_argument("--prompt-lengths", default="64,300,1000", help="comma-separated")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="CPU threads of this process and both services (0: torch's default here)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes: 2 layers, hidden 128, one 24-token prompt, 4 new tokens")
    args = p.parse_args(argv)
    if args.dry_run:
        args.layers, args.hidden, args.heads, args.kv_heads = 2, 128, 2, 1
        args.intermediate, args.vocab, args.prompt_lengths, args.new_tokens = 256, 512, "24", 4
    args.prompt_lengths = [int(n) for n in str(args.prompt_lengths).split(",") if n.strip()]
    if args.hidden % args.heads or (args.hidden // args.heads) % 64:
        p.error(f"--hidden / --heads = head_dim must be a multiple of 64, got "
                f"{args.hidden} / {args.heads}")
    if args.device.startswith("cuda") and args.dtype != "bfloat16":
        p.error("--dtype: CUDA runs bfloat16 only")
    args.torch_threads = args.torch_threads or torch.get_num_threads()
    return args


def build_checkpoint(args: argparse.Namespace, directory: Path) -> dict:
    """A random Llama checkpoint (transformers), saved as config.json + *.safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_positions, tie_word_embeddings=False,
        rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).eval()
    kwargs = ({"safe_serialization": True} if "safe_serialization"
              in inspect.signature(model.save_pretrained).parameters else {})
    model.save_pretrained(str(directory), **kwargs)
    files = sorted(p.name for p in directory.iterdir())
    if not any(name.endswith(".safetensors") for name in files):
        raise RuntimeError(f"save_pretrained wrote no *.safetensors file: {files}")
    params = sum(t.numel() for t in model.parameters())
    return {"dir_name": directory.name, "files": files, "parameters": params,
            "config": json.loads((directory / "config.json").read_text()),
            "loader_check": loader_check(model, directory, args)}


def loader_check(hf_model, directory: Path, args: argparse.Namespace) -> dict:
    """rekv's loader reads the checkpoint as transformers meant it: float32 logits of a short
    prompt from both, on the CPU."""
    from rekv_core.model import Model, load_weights, prefill

    ids = torch.randint(0, args.vocab, (32,), generator=torch.Generator().manual_seed(args.seed))
    with torch.inference_mode():
        want = hf_model.float()(ids[None]).logits[0, -1].float()
        got = prefill(Model(load_weights(str(directory))), ids.tolist(), boundaries=()).logits
    diff = float((got - want).abs().max())
    return {"prompt_tokens": len(ids), "max_abs_logit_diff": diff,
            "same_argmax": int(got.argmax()) == int(want.argmax()), "ok": diff < 1e-3}


def lossless_actions(num_layers: int) -> list[tuple[str, tuple[str, int]]]:
    """(label, forced (codec, cut)): full BF16 transfer, BF16 recompute at interior cuts
    (about a third and two thirds of the layers), token-only."""
    cuts = sorted({min(num_layers - 1, max(1, round(num_layers * f))) for f in (1 / 3, 2 / 3)})
    interior = [c for c in cuts if 0 < c < num_layers]
    return ([("bf16_transfer", ("bf16", num_layers))]
            + [(f"bf16_recompute@{c}", ("bf16", c)) for c in interior]
            + [("token_recompute", ("bf16", 0))])


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    generator = torch.Generator().manual_seed(args.seed + 1)
    return [torch.randint(0, args.vocab, (n,), generator=generator).tolist()
            for n in args.prompt_lengths]


def references(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]]
               ) -> tuple[list[list[int]], float]:
    """Greedy tokens of each prompt, single process, on rekv's loader of the same checkpoint."""
    from rekv_core.model import Model, greedy_generate, load_weights
    from rekv_core.settings import DTYPES

    torch.set_num_threads(args.torch_threads)
    started = time.perf_counter()
    model = Model(load_weights(str(model_dir), DTYPES[args.dtype], args.device))
    out = [greedy_generate(model, ids, args.new_tokens) for ids in prompts]
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out, time.perf_counter() - started


def service_args(args: argparse.Namespace, model_dir: Path) -> list[str]:
    return ["--model", str(model_dir), "--device", args.device, "--dtype", args.dtype,
            "--transport", "ucx", "--torch-threads", str(args.torch_threads),
            "--max-prompt-tokens", str(max(args.prompt_lengths)),
            "--max-new-tokens", str(args.new_tokens), "--codecs", "bf16,int8"]


def service_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return {"UCX_PROTO_INFO": "y", "PYTHONPATH": path}


def first_mismatch(got: list[int], want: list[int]) -> int | None:
    end = None if len(got) == len(want) else min(len(got), len(want))
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), end)


def run_case(channel, num_layers: int, request_id: str, ids: list[int], want: list[int],
             label: str, forced: tuple[str, int] | None, args: argparse.Namespace) -> dict:
    """One request; judged when the action it ran is lossless (a forced one must also be the
    action that ran, without a fallback)."""
    import grpc

    from rekv_cli.client import generate
    from rekv_core.handoff import Action

    case = {"request_id": request_id, "prompt_tokens": len(ids), "label": label,
            "forced": list(forced) if forced else None}
    try:
        result = generate(channel, request_id, ids, args.new_tokens, forced_action=forced,
                          stop_at_eos=False, timeout=args.request_timeout)
    except grpc.RpcError as exc:
        return {**case, "judged": True, "match": False, "ok": False,
                "error": f"{exc.code().name}: {exc.details()}"}
    s = result.summary
    action = Action(s.action.codec, s.action.cut, num_layers)
    ran_forced = forced is None or (s.action.codec, s.action.cut) == tuple(forced)
    match = result.token_ids == want
    judged = forced is not None or action.lossless
    case.update({
        "action": {"codec": s.action.codec, "cut": s.action.cut, "kind": s.action_kind,
                   "lossless": action.lossless},
        "judged": judged, "match": match, "first_mismatch": first_mismatch(result.token_ids, want),
        "fallback": s.fallback, "fallback_reason": s.fallback_reason,
        "ok": (not judged) or (match and ran_forced and not s.fallback),
        "tokens": result.token_ids, "reference": want,
        "measured_handoff_ms": round(s.measured_handoff_ms, 3),
        "predicted_handoff_ms": round(s.predicted_handoff_ms, 3),
        "ttft_ms": round(s.ttft_ms, 3), "request_ms": round(s.request_ms, 3),
        "wire_bytes": {"boundary": s.bytes.boundary, "prefix": s.bytes.prefix,
                       "scales": s.bytes.scales, "tokens": s.bytes.tokens, "head": s.bytes.head}})
    return case


def run_services(args: argparse.Namespace, model_dir: Path, out: Path, prompts: list[list[int]],
                 wanted: list[list[int]]) -> tuple[list[dict], dict]:
    """Start both services, run every case, stop them; returns the cases and service facts."""
    import grpc

    from rekv_cli.launcher import ServicePair

    settings = service_args(args, model_dir)
    started = time.perf_counter()
    pair = ServicePair(settings, settings, log_dir=out, env=service_env(),
                       ready_timeout=args.ready_timeout)
    facts = {"startup_s": round(time.perf_counter() - started, 2), "args": settings,
             "env": service_env(), "ready": {"prefill": pair.prefill.info,
                                             "decode": pair.decode.info}}
    cases: list[dict] = []
    try:
        with grpc.insecure_channel(pair.decode_address) as channel:
            facts["warmup"] = warm_up(channel, args, prompts[0], wanted[0])
            for index, (ids, want) in enumerate(zip(prompts, wanted)):
                plan = [*lossless_actions(args.layers), ("planned", None)]
                for label, forced in plan:
                    cases.append(run_case(channel, args.layers, f"p{index}-{label}", ids, want,
                                          label, forced, args))
    finally:
        facts["exit_codes"] = pair.stop()
    return cases, facts


def warm_up(channel, args: argparse.Namespace, ids: list[int], want: list[int]) -> list[dict]:
    """Unjudged full transfers until one completes without a fallback (at most WARMUPS): the
    first handoff connects the prefill side's UCX endpoint (and on a GPU warms CUDA up), which
    on a busy machine can outlast ucxx's 5 s connect timeout and fall back."""
    attempts = []
    for attempt in range(WARMUPS):
        case = run_case(channel, args.layers, f"warmup-{attempt}", ids, want, "warmup",
                        ("bf16", args.layers), args)
        attempts.append({k: case.get(k) for k in ("request_id", "match", "fallback",
                                                  "fallback_reason", "measured_handoff_ms",
                                                  "error")})
        if case.get("ok"):
            break
    return attempts


def parse_proto_tables(text: str) -> dict[str, list[str]]:
    """UCX_PROTO_INFO tables in a log: operation ("tagged message by ucp_tag_send* from host
    memory") -> its rows, "range | protocol | tl/device" (the transports it selects)."""
    tables: dict[str, dict[str, None]] = {}  # rows as an ordered set
    operation = None
    for line in text.splitlines():
        if not PROTO_LINE.match(line):
            continue
        cells = [cell.strip() for cell in PROTO_LINE.sub("", line, count=1).split("|")]
        cells = [re.sub(r"\s+", " ", cell) for cell in cells if cell]
        if len(cells) >= 2 and cells[0].startswith("ucp_context"):
            operation = cells[1]
            tables.setdefault(operation, {})
        elif operation is not None and TLS_PATTERN.search(line):
            tables[operation][" | ".join(cells)] = None
    return {operation: list(rows) for operation, rows in tables.items()}


def transports(rows: list[str]) -> set[str]:
    return {m.group(1) for row in rows for m in TLS_PATTERN.finditer(row)}


def ucx_report(out: Path) -> dict:
    """The UCX transports the services' logs name, from UCX_PROTO_INFO's protocol-selection
    tables: in all, by role, by operation, and for the data plane (rekv's transport sends every
    part with ucp_tag_send, so the tag-send tables name what carried the KV), by memory type."""
    by_role, by_operation = {}, {}
    data_plane: dict[str, set[str]] = {}
    data_rows: dict[str, dict[str, None]] = {}
    for role in ("prefill", "decode"):
        path = out / f"{role}.log"
        tables = parse_proto_tables(path.read_text(errors="replace") if path.exists() else "")
        by_role[role] = sorted(set().union(*map(transports, tables.values())))
        for operation, rows in tables.items():
            by_operation.setdefault(operation, set()).update(transports(rows))
            memory = MEMORY_PATTERN.search(operation)
            if "ucp_tag_send" in operation and memory:
                kind = re.sub(r"[- ]", "_", memory.group(1).lower())
                data_plane.setdefault(kind, set()).update(transports(rows))
                data_rows.setdefault(kind, {}).update(dict.fromkeys(
                    f"{operation}: {row}" for row in rows))
    return {"ucx_transports_seen": sorted(set().union(*by_role.values())), "by_role": by_role,
            "data_plane_by_memory": {k: sorted(v) for k, v in sorted(data_plane.items())},
            "data_plane_rows": {k: list(v)[:40] for k, v in sorted(data_rows.items())},
            "by_operation": {k: sorted(v) for k, v in sorted(by_operation.items())},
            "UCX_TLS": os.environ.get("UCX_TLS")}


def meta(args: argparse.Namespace, started: dict) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def package(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    device = (torch.cuda.get_device_name(torch.device(args.device))
              if args.device.startswith("cuda") else "cpu")
    ucxx = next((v for v in map(package, ("ucxx-cu13", "ucxx-cu12", "ucxx")) if v), None)
    return {**started, "device": args.device, "device_name": device, "dtype": args.dtype,
            "torch": torch.__version__, "cuda": torch.version.cuda, "ucxx": ucxx,
            "transformers": package("transformers"), "python": sys.version.split()[0],
            "torch_threads": args.torch_threads, "dry_run": args.dry_run}


def print_table(cases: list[dict], ucx: dict) -> None:
    print(f"{'request':<26} {'S':>5} {'action':<24} {'match':<6} {'fallback':<8} "
          f"{'handoff ms':>10}")
    for c in cases:
        action = c.get("action") or {}
        ran = f"{action.get('kind', '-')}({action.get('codec', '')},{action.get('cut', '')})"
        verdict = ("yes" if c["match"] else "NO") if c["judged"] else "n/a"
        print(f"{c['request_id']:<26} {c['prompt_tokens']:>5} {ran:<24} {verdict:<6} "
              f"{str(c.get('fallback', '-')):<8} {c.get('measured_handoff_ms', float('nan')):>10}"
              + (f"  {c['error']}" if "error" in c else ""))
    print(f"UCX transports seen: {', '.join(ucx['ucx_transports_seen']) or 'none'} "
          f"(by role {ucx['by_role']}); data plane (tag sends) by memory type: "
          f"{ucx['data_plane_by_memory'] or 'none logged'}; UCX_TLS={ucx['UCX_TLS']}")


def collect(args: argparse.Namespace, out: Path, report: dict) -> list[dict]:
    """Checkpoint, references, services; a failure on the way is recorded in `report["error"]`
    (the services' logs stay in `out`) and ends the run with the cases so far (none)."""
    try:
        with tempfile.TemporaryDirectory(prefix="rekv-e2e-") as tmp:
            model_dir = Path(tmp) / "rekv-e2e-random-llama"
            model_dir.mkdir()
            report["checkpoint"] = build_checkpoint(args, model_dir)
            prompts = make_prompts(args)
            wanted, ref_s = references(args, model_dir, prompts)
            report["reference_s"] = round(ref_s, 2)
            cases, report["services"] = run_services(args, model_dir, out, prompts, wanted)
            return cases
    except Exception as exc:  # noqa: BLE001 (reported in the JSON, and the run fails)
        report["error"] = "".join(traceback.format_exception(exc))[-6000:]
        print(report["error"], file=sys.stderr)
        return []


def main(argv: list[str] | None = None) -> int:
    started = provenance(measures=MEASURES)
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"meta": meta(args, started), "settings": dict(vars(args))}
    report["cases"] = cases = collect(args, out, report)
    report["ucx"] = ucx_report(out)
    report["ucx_transports_seen"] = report["ucx"]["ucx_transports_seen"]
    judged = [c for c in cases if c["judged"]]
    forced = [c for c in cases if c["forced"] is not None]
    loader = report.get("checkpoint", {}).get("loader_check", {})
    report["summary"] = summary = {
        "cases": len(cases), "judged": len(judged), "matched": sum(c["ok"] for c in judged),
        "all_lossless_forced_matched": bool(forced) and all(c["ok"] for c in forced),
        "all_judged_matched": bool(judged) and all(c["ok"] for c in judged),
        "loader_check_ok": bool(loader.get("ok")), "error": "error" in report,
        "services_exit_codes": report.get("services", {}).get("exit_codes")}
    (out / "services_e2e.json").write_text(json.dumps(report, indent=1, default=str))
    print_table(cases, report["ucx"])
    passed = summary["all_judged_matched"] and summary["loader_check_ok"]
    print(f"loader check (rekv vs transformers, float32 logits): {loader or 'not run'}")
    print(f"{summary['matched']}/{len(judged)} judged cases matched the reference; "
          f"services exit codes {summary['services_exit_codes']}; "
          f"{'PASS' if passed else 'FAIL'}; wrote {out / 'services_e2e.json'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
