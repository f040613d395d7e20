"""`rekv bench handoff`: every handoff action, timed end to end over the throttled in-process link.

For each prompt length S the runner prefills one deterministic prompt (token ids drawn from a
seeded generator: timing does not depend on the text) and keeps every layer's K, V and hidden
state: the sender's side of every action. It also times the recompute of all L layers from the
embedding alone (median of 3 after a warm-up): `compute_all_ms`. A link rate is either Gb/s or
`xK`, K times this prompt length's *balanced* rate, at which all layers' BF16 KV takes as long on
the link as computing all layers (the regime of the seed's H100 TCP path).

One timed run = one request on one `InProcessLink`: the sender (`send_handoff`) runs on its own
thread, so quantizing layer i+1 overlaps the wire carrying layer i; the receiver
(`receive_handoff`) runs on the calling thread, with its own prefix thread in the overlapped
schedule. Total = from starting the sender to the receiver's return with the complete cache and
first-token logits. Each (action, schedule, S, link) point has `warmups` untimed and `runs` timed
runs; reported: medians of Q, H, X, R, J and total, the total's 95% bootstrap interval, speedup over
full BF16 transfer at the same point, and the cost model Q + H + max(X, R) + J (eq. 9; eq. 8 adds
X and R for the sequential schedule) computed from the same run's measured parts. Each sample also
keeps when its run started (`samples_started_s`, this process's perf_counter), so two equal
samples can be told apart from one sample written twice.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rekv_cli.bench.machine import machine_info
from rekv_cli.bench.stats import median_ci
from rekv_core.codecs import get_codec
from rekv_core.handoff import (Action, Delivery, HandoffPlan, ReceiveMode, Receiving, Sealing,
                               receive_handoff, send_handoff)
from rekv_core.handoff.action import WireBytes, wire_bytes
from rekv_core.handoff.seal import new_key
from rekv_core.handoff.source import FinishedPrefill
from rekv_core.handoff.transfer import Transfer
from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.model.executor import Model, PrefillOutput, embed, prefill, run_layers
from rekv_core.timing import median_seconds
from rekv_core.transport.inprocess import InProcessLink

PARTS = ("Q", "H", "X", "R", "J")


@dataclass(frozen=True)
class LinkRate:
    """A link rate: absolute Gb/s, or a multiple of the prompt length's balanced rate."""

    value: float
    relative: bool

    @classmethod
    def parse(cls, text: str) -> LinkRate:
        relative = text.startswith("x")
        try:
            value = float(text[1:] if relative else text)
        except ValueError:
            raise ValueError(f"link-gbps: {text!r} is neither a number nor xK") from None
        if value <= 0:
            raise ValueError(f"link-gbps: must be positive, got {text!r}")
        return cls(value, relative)

    @property
    def label(self) -> str:
        return f"x{self.value:g}" if self.relative else f"{self.value:g}"

    def gbps(self, balanced_gbps: float) -> float:
        return self.value * balanced_gbps if self.relative else self.value


@dataclass(frozen=True)
class Case:
    action: Action
    mode: ReceiveMode = ReceiveMode.OVERLAP


@dataclass
class BenchConfig:
    prompt_lens: Sequence[int] = (512, 2048)
    link_rates: Sequence[LinkRate] = (LinkRate(0.5, True), LinkRate(1, True), LinkRate(4, True))
    cuts: Sequence[int] | None = None  # None: L/5, 2L/5, 3L/5, 4L/5
    quant_codecs: Sequence[str] = ("int8", "int4")  # transfer-only
    joint_codecs: Sequence[str] = ("int8", "int4")
    sequential_codecs: Sequence[str] = ("int8",)  # also timed with the eq. 8 schedule
    split_codecs: Sequence[str] = ("int8",)  # KVPR's token split, l = `SPLIT_TOKENS`, every cut
    warmups: int = 3
    runs: int = 10
    seed: int = 0
    extra: dict = field(default_factory=dict)  # recorded in the results' meta


SPLIT_TOKENS = EXEC_BLOCK  # the token split's l in this sweep: one block, below every prompt


def default_cuts(num_layers: int) -> list[int]:
    return sorted({max(1, min(num_layers - 1, round(num_layers * k / 5))) for k in (1, 2, 3, 4)})


def cases_for(num_layers: int, config: BenchConfig) -> list[Case]:
    cuts = list(config.cuts) if config.cuts else default_cuts(num_layers)
    for c in cuts:
        if not 0 < c < num_layers:
            raise ValueError(f"cuts: each must lie in [1, {num_layers - 1}], got {c}")
    cases = [Case(Action.full_bf16(num_layers))]
    cases += [Case(Action(codec, num_layers, num_layers)) for codec in config.quant_codecs]
    cases.append(Case(Action.token_only(num_layers)))
    for codec in ("bf16", *config.joint_codecs):
        for c in cuts:
            cases.append(Case(Action(codec, c, num_layers)))
            if codec in config.sequential_codecs:
                cases.append(Case(Action(codec, c, num_layers), ReceiveMode.SEQUENTIAL))
    for codec in config.split_codecs:
        cases += [Case(Action(codec, c, num_layers, split=SPLIT_TOKENS)) for c in cuts]
    return cases


def prompt_ids(vocab_size: int, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def time_compute_all(model: Model, ids: Sequence[int], repeats: int = 3) -> float:
    """Seconds to compute all L layers of the prompt (median of `repeats`, after one warm-up)."""
    h0 = embed(model, ids)
    return median_seconds(lambda: run_layers(model, h0, start=0), repeats, model.device)


@dataclass(frozen=True)
class Sample:
    """One timed handoff: the seed's parts and the total, in seconds."""

    Q: float
    H: float
    X: float
    R: float
    J: float
    total: float
    bytes: WireBytes  # received
    started: float  # perf_counter seconds at the sender's start: tells samples of runs apart

    def modelled(self, mode: ReceiveMode) -> float:
        """The cost model on this run's own parts: eq. 9 overlapped, eq. 8 sequential."""
        overlap = max(self.X, self.R) if mode is ReceiveMode.OVERLAP else self.X + self.R
        return self.Q + self.H + overlap + self.J


def run_once(model: Model, link: InProcessLink, case: Case, ids: Sequence[int],
             state: PrefillOutput) -> Sample:
    """One handoff, timed from starting the sender to the complete cache."""
    request_id, key = uuid.uuid4().hex, new_key()  # sealed, as the services' handoffs are
    link.receiver.open(request_id)
    outcome: dict = {}

    def send() -> None:
        try:
            plan = HandoffPlan(case.action, len(ids), model.shape, Delivery.seed())
            source = FinishedPrefill(state, ids, case.action.cut, case.action.sent_layers)
            outcome["sender"] = send_handoff(link.sender, plan, source, Transfer(request_id),
                                             Sealing(key))
        except BaseException as exc:  # re-raised below, after the receiver is done
            outcome["error"] = exc

    sender = threading.Thread(target=send, name="rekv-bench-sender")
    start = time.perf_counter()
    sender.start()
    try:
        result = receive_handoff(model, link.receiver, Transfer(request_id, stall_s=30.0),
                                 Sealing(key), Receiving(case.mode))
    finally:
        sender.join()
    total = time.perf_counter() - start
    if "error" in outcome:
        raise outcome["error"]
    t = result.timings
    return Sample(outcome["sender"].quantize_seconds, t.h_s, t.x_s, t.r_s, t.j_s, total,
                  result.bytes, start)


def summarize(case: Case, shape, prompt_len: int, link: LinkRate, gbps: float,
              samples: list[Sample]) -> dict:
    action = case.action
    totals = [s.total * 1e3 for s in samples]
    median, (low, high) = median_ci(totals)
    modelled = statistics.median(s.modelled(case.mode) * 1e3 for s in samples)
    received = samples[0].bytes
    expected = wire_bytes(action, shape, prompt_len)
    if received != expected:
        raise AssertionError(f"{action}: received {received}, byte model says {expected}")
    row = {"action": action.kind.value, "codec": action.codec if action.cut else "tokens",
           "cut": action.cut, "split": action.split, "schedule": case.mode.value,
           "prompt_len": prompt_len,
           "link": link.label, "link_gbps": round(gbps, 6), "bytes": received.total,
           "bytes_by_kind": received.as_dict(), "runs": len(samples)}
    for part in PARTS:
        row[f"{part}_ms"] = statistics.median(getattr(s, part) * 1e3 for s in samples)
    row.update({"median_ms": median, "ci95_ms": [low, high], "model_ms": modelled,
                "measured_over_model": median / modelled if modelled else None,
                "samples_ms": totals, "samples_started_s": [s.started for s in samples]})
    return row


def run_bench(model: Model, config: BenchConfig,
              progress: Callable[[str], None] = lambda _: None,
              on_point: Callable[[dict], None] | None = None) -> dict:
    """Run the whole sweep; returns `{meta, points, rows, overlap_vs_sequential, contention,
    complete}`. `on_point` gets the results so far (`complete` False) after each case, so that a
    run stopped early still leaves every case it finished."""
    shape = model.shape
    L = shape.num_layers
    cases = cases_for(L, config)
    rows, points = [], []
    for S in config.prompt_lens:
        ids = prompt_ids(shape.vocab_size, S, config.seed)
        window = max(get_codec(c.action.codec).importance_window for c in cases)
        state = prefill(model, ids, boundaries=None, importance_window=window)
        compute_all = time_compute_all(model, ids)
        kv_bf16 = wire_bytes(Action.full_bf16(L), shape, S).prefix
        balanced = kv_bf16 * 8 / compute_all / 1e9
        points.append({"prompt_len": S, "compute_all_ms": compute_all * 1e3,
                       "bf16_kv_bytes": kv_bf16, "balanced_gbps": balanced})
        progress(f"S={S}: all {L} layers compute in {compute_all * 1e3:.0f} ms; "
                 f"{kv_bf16 / 2**20:.1f} MiB BF16 KV; balanced link {balanced:.3f} Gb/s")
        for rate in config.link_rates:
            gbps = rate.gbps(balanced)
            point_rows = []
            with InProcessLink(bandwidth_gbps=gbps) as link:
                for case in cases:
                    if case.action.split >= S:  # a split needs tokens past it
                        continue
                    for _ in range(config.warmups):
                        run_once(model, link, case, ids, state)
                    samples = [run_once(model, link, case, ids, state)
                               for _ in range(config.runs)]
                    point_rows.append(summarize(case, shape, S, rate, gbps, samples))
                    progress(f"S={S} link={rate.label} ({gbps:.3f} Gb/s) {case.action} "
                             f"{case.mode.value}: {point_rows[-1]['median_ms']:.0f} ms")
                    if on_point is not None:
                        on_point(_results(model, config, points,
                                          rows + with_speedups(point_rows), complete=False))
            rows += with_speedups(point_rows)
        del state
    return _results(model, config, points, rows, complete=True)


def with_speedups(point_rows: list[dict]) -> list[dict]:
    """The rows of one (S, link) point, each with its speedup over full BF16 transfer there (the
    sweep's first case: a row timed before it has none yet)."""
    baseline = next((r for r in point_rows if r["action"] == "bf16_transfer"), None)
    for row in point_rows:
        if baseline is not None:
            row["speedup_vs_bf16"] = baseline["median_ms"] / row["median_ms"]
    return point_rows


def _results(model: Model, config: BenchConfig, points: list[dict], rows: list[dict],
             complete: bool) -> dict:
    shape = model.shape
    return {"meta": {**machine_info(model.device, model.dtype, torch.get_num_threads()),
                     "model": shape.name, "num_layers": shape.num_layers,
                     "warmups": config.warmups, "runs": config.runs, **config.extra},
            "points": points, "rows": rows,
            "overlap_vs_sequential": overlap_vs_sequential(rows),
            "contention": contention(rows, shape.num_layers), "complete": complete}


def overlap_vs_sequential(rows: list[dict]) -> list[dict]:
    """Pairs of rows of the same action at the same (S, link, codec, cut) under both schedules
    (seed Table 3). Actions that share a codec and cut (joint and the token split) never pair."""
    by_key = {}
    for row in rows:
        key = (row["prompt_len"], row["link"], row["action"], row["codec"], row["cut"])
        by_key.setdefault(key, {})[row["schedule"]] = row
    pairs = []
    for (S, link, action, codec, cut), both in by_key.items():
        if len(both) == 2:
            ov, seq = both["overlap"], both["sequential"]
            pairs.append({"prompt_len": S, "link": link, "action": action, "codec": codec,
                          "cut": cut,
                          "overlap_ms": ov["median_ms"], "sequential_ms": seq["median_ms"],
                          "sequential_over_overlap": seq["median_ms"] / ov["median_ms"],
                          "overlap_model_ms": ov["model_ms"],
                          "overlap_measured_over_model": ov["measured_over_model"]})
    return pairs


def contention(rows: list[dict], num_layers: int) -> list[dict]:
    """Suffix ms per layer while the prefix branch runs (overlapped joint/recompute rows) against
    the same with nothing beside it (token-only recompute, sequential rows) at each point."""
    out = []
    points = sorted({(r["prompt_len"], r["link"]) for r in rows})
    for S, link in points:
        here = [r for r in rows if r["prompt_len"] == S and r["link"] == link]
        alone = [r["R_ms"] / num_layers for r in here if r["action"] == "token_recompute"]
        alone += [r["R_ms"] / (num_layers - r["cut"]) for r in here
                  if r["schedule"] == "sequential"]
        beside = [r["R_ms"] / (num_layers - r["cut"]) for r in here
                  if r["schedule"] == "overlap" and r["action"] in ("joint", "bf16_recompute")]
        if alone and beside:
            out.append({"prompt_len": S, "link": link,
                        "suffix_ms_per_layer_alone": statistics.median(alone),
                        "suffix_ms_per_layer_overlapped": statistics.median(beside),
                        "slowdown": statistics.median(beside) / statistics.median(alone)})
    return out
