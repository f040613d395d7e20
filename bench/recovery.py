"""What a failed handoff's fallback adds on the decode side: recomputing only the lost layers
(partial) against recomputing the whole prompt (full), on the embedded model.

    python bench/recovery.py [--prompt-lens 512,1024] [--cut 15] [--repeats 5] [--threads 1]
                             [--dtype bfloat16] [--json bench/results/recovery-cpu.json]

For each prompt length, one handoff per fault over the in-process link, the prefill side's
faults the services inject (`services/prefill/faults.py`, as `--fault-inject by_request`), the
receiver keeping what verified (`Receiving(keep_verified=True)`):

- `flip_bit`, streamed: a bit of the first payload, layer 0 (m = 0);
- `flip_late_bit`, streamed: a bit of the last prefix layer (m = c − 1);
- `hold_prefix`, the seed's schedule (the boundary first): held after half of the prefix, the
  rest missing when the receiver's stall limit (`STALL_S`) passes (m = c − 1);
- `killed`, the seed's schedule: the sender gives up its transfer where `hold_prefix` holds (as a
  prefill killed there: nothing more is sent) (m = c − 1).

Each salvage is checked: layers 0..m recomputed over it (`recompute_lost`) must give the
single-process prefill's cache bit for bit (BF16 on the wire) before anything is timed. Then
`--repeats` rounds time, once each, the full recompute (`prefill` of the prompt and its cache, as
`DecodeConnector.recompute`) and every case's partial recompute, in order on even rounds and in
reverse on odd ones. Reported: medians, each partial's ratio to the full recompute's median, and
the bound (m + 1)/L that a recompute of m + 1 of L layers can reach (the embedding and the final
norm and head are shared overheads: the full recompute runs them once, the partial the embedding
alone). The fallback's added time is this recompute: the time to notice the failure (a MAC at
once, a stall at the deadline) is the same either way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rekv_cli.bench.machine import machine_info
from rekv_cli.bench.provenance import IN_PROCESS, provenance
from rekv_cli.util import csv_of, write_json
from rekv_core.handoff import (Action, Delivery, HandoffPlan, Receiving, Sealing, receive_handoff,
                               send_handoff)
from rekv_core.handoff.recovery import PartialHandoff, recompute_lost, recovery
from rekv_core.handoff.source import FinishedPrefill, LivePrefill
from rekv_core.handoff.transfer import Transfer
from rekv_core.model import KVCache, Model, load_weights, prefill
from rekv_core.transport.inprocess import InProcessLink
from services.prefill.faults import Faults

# what the figures measure (`provenance`): a handoff in process, the prefill side's faults injected
MEASURES = (*IN_PROCESS, "services/prefill/faults.py", "bench/recovery.py")

CASES = {"flip_bit": True, "flip_late_bit": True, "hold_prefix": False, "killed": False}
STALL_S = 5.0  # the receiver's stall limit after a finished prefill: a held prefix is given up
STREAMED_STALL_S = 600.0  # a streamed boundary waits for the prefill's layers 0..c-1


class _Dying(Faults):
    """The prefill side's faults, where a hold is the sender giving up its transfer instead (as a
    process killed there: nothing more leaves)."""

    def hold(self, request_id: str, transfer: Transfer, point: str) -> None:
        transfer.cancel()


def salvage_of(model: Model, ids: list[int], cut: int, case: str):
    """The `Salvage` of one handoff sent with the fault `case`."""
    streamed = CASES[case]
    action = Action("bf16", cut, model.shape.num_layers)
    source = LivePrefill(model, ids, cut) if streamed else FinishedPrefill(
        prefill(model, ids), ids, cut)
    plan = HandoffPlan(action, len(ids), model.shape, Delivery(streamed))
    fault = "hold_prefix" if case == "killed" else case
    faults = (_Dying if case == "killed" else Faults)("by_request", hold_s=60.0)
    sent, sealing = Transfer("r"), Sealing.fresh()  # sealed, as between the services
    with InProcessLink() as link:
        link.receiver.open("r")
        hooks = faults.for_handoff(f"{fault}/bench", sent, cut, link.sender)
        sender = threading.Thread(target=_quietly, args=(send_handoff, link.sender, plan, source,
                                                         sent, sealing, hooks))
        sender.start()
        try:
            receive_handoff(model, link.receiver,
                            Transfer("r", stall_s=STREAMED_STALL_S if streamed else STALL_S),
                            sealing, Receiving(keep_verified=True))
        except PartialHandoff as partial:
            return partial.salvage
        finally:
            sent.cancel()  # ends a hold
            sender.join()
            close = getattr(source, "close", None)
            if close is not None:
                close()
    raise AssertionError(f"{case}: the handoff did not lose only prefix layers")


def _quietly(function, *args) -> None:
    try:
        function(*args)
    except Exception:  # noqa: BLE001 - a sender that a fault stops
        pass


def check(model: Model, ids: list[int], salvage, reference) -> None:
    cache = recompute_lost(model, ids, salvage)
    for layer in range(model.shape.num_layers):
        k, v = cache.layer(layer)
        if not (torch.equal(k, reference.keys[layer]) and torch.equal(v, reference.values[layer])):
            raise AssertionError(f"layer {layer} differs from the reference after the recompute")


def full_recompute(model: Model, ids: list[int]) -> None:
    out = prefill(model, ids, boundaries=())
    KVCache.from_layers(out.keys, out.values, len(ids))


def measure(model: Model, prompt_len: int, cut: int, repeats: int) -> list[dict]:
    ids = torch.randint(0, model.shape.vocab_size, (prompt_len,),
                        generator=torch.Generator().manual_seed(prompt_len)).tolist()
    reference = prefill(model, ids, boundaries=())
    salvages = {case: salvage_of(model, ids, cut, case) for case in CASES}
    for salvage in salvages.values():
        check(model, ids, salvage, reference)
    work = {"full": lambda: full_recompute(model, ids)}
    for case, salvage in salvages.items():
        work[case] = lambda salvage=salvage: recompute_lost(model, ids, salvage)
    samples = {name: [] for name in work}
    order = list(work)
    for round_ in range(repeats):
        for name in order if round_ % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            work[name]()
            samples[name].append(time.perf_counter() - start)
    L = model.shape.num_layers
    full_s = statistics.median(samples["full"])
    rows = []
    for name, seconds in samples.items():
        layers = L if name == "full" else recovery(salvages[name], ids, L).layers
        median = statistics.median(seconds)
        rows.append({"prompt_len": prompt_len, "cut": cut, "case": name,
                     "scope": "full" if name == "full" else "partial",
                     "lost": [] if name == "full" else salvages[name].lost,
                     "layers": layers, "median_s": median, "ratio_to_full": median / full_s,
                     "bound": layers / L, "min_s": min(seconds), "max_s": max(seconds),
                     "samples_s": seconds})
    return rows


def run(args: argparse.Namespace) -> dict:
    started = provenance(measures=MEASURES)
    dtype = getattr(torch, args.dtype)
    model = Model(load_weights("smollm2-135m", dtype))
    rows = [row for n in args.prompt_lens for row in measure(model, n, args.cut, args.repeats)]
    return {
        "meta": {**machine_info(model.device, dtype, torch.get_num_threads()), **started,
                 "command": " ".join(["python", *sys.argv]), "model": "smollm2-135m",
                 "repeats": args.repeats, "stall_s": STALL_S, "note": args.note},
        "rows": rows,
    }


def print_table(result: dict) -> None:
    m = result["meta"]
    print(f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, torch "
          f"{m['torch']}, {m['dtype']}, commit {m['commit']}"
          + (f"; {m['note']}" if m["note"] else ""))
    print()
    print("| tokens | cut | case | scope | layers recomputed | median s | of full | bound |")
    print("|-------:|----:|:-----|:------|------------------:|---------:|--------:|------:|")
    for r in result["rows"]:
        print(f"| {r['prompt_len']} | {r['cut']} | {r['case']} | {r['scope']} | {r['layers']} | "
              f"{r['median_s']:.3f} | {r['ratio_to_full']:.1%} | {r['bound']:.1%} |")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=csv_of(int), default=[512, 1024],
                        help="prompt lengths in tokens, comma-separated (default 512,1024)")
    parser.add_argument("--cut", type=int, default=15, help="the handoffs' cut c (default 15)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--note", default="", help="recorded with the result (e.g. shared "
                        "machine)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    problems = {"--prompt-lens: need one or more positive lengths":
                not args.prompt_lens or min(args.prompt_lens) < 1,
                "--cut: must lie in [2, 30): half of the prefix is held": not 2 <= args.cut < 30,
                "--repeats: must be positive": args.repeats < 1,
                "--threads: must be positive": args.threads is not None and args.threads < 1}
    for problem in (p for p, found in problems.items() if found):
        parser.error(problem)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    result = run(args)
    write_json(args.json, result)  # before the table: the figures are kept whatever it prints
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
