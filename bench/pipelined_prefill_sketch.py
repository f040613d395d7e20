"""How much a pipelined handoff could take off TTFT, measured in process with no link: the
prefill side runs layers [0, c) in token chunks (one thread, one core) and hands each chunk's h_c
rows to the decode side (another thread, the other core), which runs layers [c, L) on each as it
comes; against the same model's whole prefill on one core (the colocated bound).

    python bench/pipelined_prefill_sketch.py [--prompt-len 2048] [--cuts 10,15,20]
        [--chunk 256] [--rounds 3] [--json FILE]

Only compute is timed: the prefix KV and the boundary would still have to cross a link, so this
is the ceiling of the idea on two equal cores, not a handoff. Cases alternate per round.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rekv_cli.bench.provenance import provenance  # noqa: E402
from rekv_core.model import KVCache, executor, prefill, run_layers_chunk  # noqa: E402
from rekv_core.model.blocks import chunk_bounds  # noqa: E402
from rekv_core.model.shapes import DEFAULT_MODEL  # noqa: E402
from rekv_core.model.weights import load_weights  # noqa: E402

# what the figures measure (`provenance`): the executor's chunked prefill and suffix, no link
MEASURES = ("rekv_core/model", "bench/pipelined_prefill_sketch.py")


def _pinned(core: int):
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)


def colocated(model, ids) -> float:
    started = time.perf_counter()
    prefill(model, ids, boundaries=())
    return time.perf_counter() - started


def pipelined(model, ids, cut: int, chunk: int) -> float:
    L, S = model.shape.num_layers, len(ids)
    rows: queue.Queue = queue.Queue()
    started = time.perf_counter()

    def produce():
        _pinned(0)
        cache = KVCache(L, model.shape.num_kv_heads, model.shape.head_dim, S, model.dtype)
        with torch.inference_mode():
            for s0, s1 in chunk_bounds(S, chunk):
                rows.put((s0, run_layers_chunk(model, executor.embed(model, ids[s0:s1]), 0, s0,
                                               cache, stop=cut)))
        rows.put(None)

    producer = threading.Thread(target=produce)
    producer.start()
    _pinned(1)
    cache = KVCache(L, model.shape.num_kv_heads, model.shape.head_dim, S, model.dtype)
    while (item := rows.get()) is not None:
        s0, h = item
        h = run_layers_chunk(model, h, cut, s0, cache)
    executor.final_logits(model, h[-1])
    producer.join()
    return time.perf_counter() - started


def main(argv=None) -> int:
    started = provenance(measures=MEASURES)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--cuts", default="10,15,20")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    model = executor.Model(load_weights(DEFAULT_MODEL, torch.bfloat16))
    ids = torch.randint(0, model.shape.vocab_size, (args.prompt_len,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    cuts = [int(c) for c in args.cuts.split(",")]
    _pinned(1)
    colocated(model, ids)  # warm-up
    samples: dict[str, list[float]] = {"colocated": [], **{f"cut {c}": [] for c in cuts}}
    for round_ in range(args.rounds):
        order = list(samples) if round_ % 2 == 0 else list(reversed(samples))
        for case in order:
            _pinned(1)
            seconds = colocated(model, ids) if case == "colocated" else pipelined(
                model, ids, int(case.split()[1]), args.chunk)
            samples[case].append(seconds * 1e3)
    base = statistics.median(samples["colocated"])
    result = {case: {"median_ms": statistics.median(v), "over_colocated":
                     statistics.median(v) / base, "samples_ms": v} for case, v in samples.items()}
    for case, r in result.items():
        print(f"{case:10s} {r['median_ms']:8.0f} ms  {r['over_colocated']:.2f} of colocated")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": started, "args": vars(args),
                                               "result": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
