"""`rekv bench ttft`: time to first token from the request's arrival, five ways, side by side.

For each prompt length S and link rate (Gb/s, or `xK`: K times S's balanced rate, at which all
layers' BF16 KV takes as long on the link as computing all layers), over the throttled in-process
link, with the prefill on its own thread and the decode side on the calling thread:

- `baseline` (a): the full prefill, then every layer's BF16 KV (the P/D default);
- `seed` (b): the full prefill, then the seed's overlapped handoff (boundary first);
- `streamed` (c): the handoff sent from inside the prefill, which stops at the cut
  (`LivePrefill`), the boundary in one message;
- `chunked` (d): as (c), the boundary in chunks of `chunk_tokens`, the suffix run chunk by chunk;
- `pipelined` (d'): as (d), in token order: the prefill runs in those chunks up to the cut
  (`ChunkedPrefill`), each chunk's boundary and prefix rows sent as it passes the cut, so the
  decode side's layers run on a chunk while the prefill computes the next (interior cuts whose
  codec ranks no tokens);
- `colocated` (e): the prefill alone, to its own first-token logits (the bound: nothing moves).

(b)–(d') try every action of `actions_for` and report each; a point's summary takes each schedule's
best action (an oracle over the same sweep for every schedule). TTFT runs from the start of the
prefill to the decode side's complete cache and first-token logits. Runs go round-robin over the
cases, in a shuffled order each round, after `warmups` rounds; besides the ratios of the medians,
each point gives the median ratio of the same round's samples (`paired`, which a drift of the
machine's speed between rounds does not move). Every run's first token is checked against the
colocated prefill's for the lossless actions.
"""

from __future__ import annotations

import enum
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rekv_cli.bench.handoff import LinkRate, prompt_ids, time_compute_all
from rekv_cli.bench.machine import machine_info
from rekv_cli.bench.stats import median_ci, paired_ratio
from rekv_core.codecs import get_codec
from rekv_core.handoff import (Action, Delivery, HandoffPlan, Order, Receiving, Sealing,
                               receive_handoff, send_handoff)
from rekv_core.handoff.action import wire_bytes
from rekv_core.handoff.seal import new_key
from rekv_core.handoff.source import ChunkedPrefill, FinishedPrefill, LivePrefill
from rekv_core.handoff.transfer import Transfer
from rekv_core.model.executor import Model, prefill
from rekv_core.transport.inprocess import InProcessLink

class Way(str, enum.Enum):
    """How a case serves its request (the module doc's (a)-(e)); the value names it in results."""

    BASELINE = "baseline"
    SEED = "seed"
    STREAMED = "streamed"
    CHUNKED = "chunked"
    PIPELINED = "pipelined"
    COLOCATED = "colocated"


SCHEDULES = tuple(way.value for way in Way)  # the results' names, in table order
PAIRED = (("(d)/(e)", "chunked_over_colocated"), ("(a)/(d)", "baseline_over_chunked"),
          ("(b)/(d)", "seed_over_chunked"), ("(d')/(e)", "pipelined_over_colocated"),
          ("(a)/(d')", "baseline_over_pipelined"), ("(b)/(d')", "seed_over_pipelined")
          )  # the ratios a point gives both ways


@dataclass(frozen=True)
class TtftCase:
    way: Way
    action: Action | None = None  # None: colocated
    chunk_tokens: int = 0

    @property
    def label(self) -> str:
        if self.action is None:
            return self.way.value
        a = self.action
        boundary = "+zb" if a.boundary != "bf16" else ""
        return f"{self.way.value} {a.codec if a.cut else 'tokens'}/{a.cut}{boundary}"


@dataclass
class TtftConfig:
    prompt_lens: Sequence[int] = (512, 1536)
    link_rates: Sequence[LinkRate] = (LinkRate(1, True), LinkRate(4, True), LinkRate(10, False))
    cuts: Sequence[int] | None = None  # None: L/5, 2L/5, 3L/5, 4L/5
    codecs: Sequence[str] = ("int8",)  # prefix codecs of the joint actions (besides BF16)
    chunk_tokens: int = 256
    warmups: int = 1
    runs: int = 5
    seed: int = 0
    extra: dict = field(default_factory=dict)


def actions_for(L: int, config: TtftConfig) -> list[Action]:
    cuts = list(config.cuts) if config.cuts else sorted(
        {max(1, min(L - 1, round(L * k / 5))) for k in (1, 2, 3, 4)})
    actions = [Action.full_bf16(L), Action.token_only(L), Action("bf16", cuts[len(cuts) // 2], L)]
    for codec in config.codecs:
        actions += [Action(codec, L, L)] + [Action(codec, c, L) for c in cuts]
    if "splitzip" in config.codecs:  # the first prefix codec's joint actions, boundary coded too
        actions += [Action(config.codecs[0], c, L, "splitzip") for c in cuts]
    return actions


def cases_for(L: int, config: TtftConfig) -> list[TtftCase]:
    actions = actions_for(L, config)
    cases = [TtftCase(Way.BASELINE, Action.full_bf16(L)), TtftCase(Way.COLOCATED)]
    cases += [TtftCase(Way.SEED, a) for a in actions if a != Action.full_bf16(L)]
    cases += [TtftCase(Way.STREAMED, a) for a in actions]
    cases += [TtftCase(Way.CHUNKED, a, config.chunk_tokens) for a in actions if a.sends_boundary]
    cases += [TtftCase(Way.PIPELINED, a, config.chunk_tokens) for a in actions
              if a.sends_boundary and not get_codec(a.codec).importance_window]
    return cases


@dataclass(frozen=True)
class TtftSample:
    ttft_s: float
    prefill_s: float  # the prefill's own compute
    first_token: int


def run_case(model: Model, link: InProcessLink, case: TtftCase, ids: Sequence[int]) -> TtftSample:
    """One request: from the start of the prefill to the first token's logits on the decode side."""
    L = model.shape.num_layers
    start = time.perf_counter()
    if case.action is None:
        out = prefill(model, ids, boundaries=())
        elapsed = time.perf_counter() - start
        return TtftSample(elapsed, elapsed, int(out.logits.argmax()))
    action, request_id, key = case.action, uuid.uuid4().hex, new_key()
    link.receiver.open(request_id)
    outcome: dict = {}

    def send() -> None:
        try:
            began = time.perf_counter()
            window = get_codec(action.codec).importance_window if action.cut else 0
            if case.way is Way.PIPELINED:
                source = ChunkedPrefill(model, ids, action.cut, case.chunk_tokens)
                outcome["source"] = source
            elif case.way in (Way.STREAMED, Way.CHUNKED):
                source = LivePrefill(model, ids, action.cut, importance_window=window)
                outcome["source"] = source
            else:
                source = FinishedPrefill(prefill(model, ids, boundaries={action.cut, L},
                                                 importance_window=window), ids, action.cut)
                outcome["prefill_s"] = time.perf_counter() - began
            delivery = Delivery(source.streamed, case.chunk_tokens,
                                Order.TOKENS if source.pipelined else Order.LAYERS)
            send_handoff(link.sender, HandoffPlan(action, len(ids), model.shape, delivery),
                         source, Transfer(request_id), Sealing(key))
        except BaseException as exc:  # re-raised below, after the receiver is done
            outcome["error"] = exc

    sender = threading.Thread(target=send, name="rekv-bench-prefill")
    sender.start()
    try:
        result = receive_handoff(model, link.receiver, Transfer(request_id, stall_s=30.0),
                                 Sealing(key), Receiving(prompt_len=len(ids)))
    finally:
        sender.join()
    ttft = time.perf_counter() - start
    if "error" in outcome:
        raise outcome["error"]
    prefill_s = outcome["source"].compute_s if "source" in outcome else outcome["prefill_s"]
    return TtftSample(ttft, prefill_s, int(result.logits.argmax()))


def run_ttft_bench(model: Model, config: TtftConfig,
                   progress: Callable[[str], None] = lambda _: None,
                   on_point: Callable[[dict], None] | None = None) -> dict:
    """The whole sweep; returns `{meta, rows, points, complete}`. `on_point` gets the results so
    far (`complete` False) after each (S, link) point."""
    shape, L = model.shape, model.shape.num_layers
    cases = cases_for(L, config)
    rng = random.Random(config.seed)
    rows, points = [], []
    for S in config.prompt_lens:
        ids = prompt_ids(shape.vocab_size, S, config.seed)
        reference = int(prefill(model, ids, boundaries=()).logits.argmax())
        compute_all = time_compute_all(model, ids)
        kv_bf16 = wire_bytes(Action.full_bf16(L), shape, S).prefix
        balanced = kv_bf16 * 8 / compute_all / 1e9
        progress(f"S={S}: all {L} layers in {compute_all * 1e3:.0f} ms; balanced link "
                 f"{balanced:.3f} Gb/s")
        for rate in config.link_rates:
            gbps = rate.gbps(balanced)
            samples: dict[TtftCase, list[TtftSample]] = {case: [] for case in cases}
            with InProcessLink(bandwidth_gbps=gbps) as link:
                for round_ in range(config.warmups + config.runs):
                    order = list(cases)
                    rng.shuffle(order)
                    for case in order:
                        sample = run_case(model, link, case, ids)
                        lossless = case.action is None or case.action.lossless
                        if lossless and sample.first_token != reference:
                            raise AssertionError(f"{case.label}: first token "
                                                 f"{sample.first_token}, expected {reference}")
                        if round_ >= config.warmups:
                            samples[case].append(sample)
                    progress(f"S={S} link={rate.label}: round {round_ + 1} of "
                             f"{config.warmups + config.runs}")
            here = [_row(case, S, rate, gbps, samples[case], reference) for case in cases]
            rows += here
            points.append(_point(S, rate, gbps, balanced, compute_all, here))
            progress(_point_line(points[-1]))
            if on_point is not None:
                on_point(_results(model, config, rows, points, complete=False))
    return _results(model, config, rows, points, complete=True)


def _results(model: Model, config: TtftConfig, rows: list[dict], points: list[dict],
             complete: bool) -> dict:
    return {"meta": {**machine_info(model.device, model.dtype, torch.get_num_threads()),
                     "model": model.shape.name, "num_layers": model.shape.num_layers,
                     "warmups": config.warmups, "runs": config.runs,
                     "chunk_tokens": config.chunk_tokens, **config.extra},
            "rows": rows, "points": points, "complete": complete}


def _row(case: TtftCase, S: int, rate: LinkRate, gbps: float, samples: list[TtftSample],
         reference: int) -> dict:
    ttfts = [s.ttft_s * 1e3 for s in samples]
    median, (low, high) = median_ci(ttfts)
    a = case.action
    return {"schedule": case.way.value, "label": case.label, "prompt_len": S, "link": rate.label,
            "link_gbps": round(gbps, 6), "codec": a.codec if a else None,
            "cut": a.cut if a else None, "boundary": a.boundary if a else None,
            "chunk_tokens": case.chunk_tokens,
            "median_ms": median, "ci95_ms": [low, high], "samples_ms": ttfts,
            "prefill_ms": statistics.median(s.prefill_s * 1e3 for s in samples),
            "same_first_token": all(s.first_token == reference for s in samples)}


def _point(S: int, rate: LinkRate, gbps: float, balanced: float, compute_all: float,
           rows: list[dict]) -> dict:
    best = {schedule: min((r for r in rows if r["schedule"] == schedule),
                          key=lambda r: r["median_ms"]) for schedule in SCHEDULES}
    ms = {schedule: best[schedule]["median_ms"] for schedule in SCHEDULES}

    def paired(numerator: str, denominator: str) -> dict:
        ratio, (low, high) = paired_ratio(best[numerator]["samples_ms"],
                                          best[denominator]["samples_ms"])
        return {"median": ratio, "ci95": [low, high]}

    return {"prompt_len": S, "link": rate.label, "link_gbps": gbps, "balanced_gbps": balanced,
            "compute_all_ms": compute_all * 1e3,
            "best": {schedule: {"label": r["label"], "median_ms": r["median_ms"]}
                     for schedule, r in best.items()},
            **{f"{way}_over_colocated": ms[way] / ms["colocated"] for way in WAYS_D},
            **{f"{other}_over_{way}": ms[other] / ms[way] for way in WAYS_D
               for other in ("baseline", "seed")},
            "baseline_over_seed": ms["baseline"] / ms["seed"],
            "paired": {**{f"{way}_over_colocated": paired(way, "colocated") for way in WAYS_D},
                       **{f"{other}_over_{way}": paired(other, way) for way in WAYS_D
                          for other in ("baseline", "seed")}},
            "codec_gains": codec_gains(rows)}


WAYS_D = ("chunked", "pipelined")  # (d) and (d'), each against (a), (b) and (e)
BASE_CODECS = ("bf16", "int8", "int4")  # the options before issue 16's codecs


def codec_gains(rows: list[dict]) -> dict:
    """How each newer option moves the point's best handoff (any schedule): the best row using
    only `BASE_CODECS` (and token-only), then for each other prefix codec, and for a SplitZip
    boundary, the best row once that option is allowed too, and the ratio of the two."""
    handoffs = [r for r in rows if r["schedule"] not in ("baseline", "colocated")]

    def best(allowed) -> dict:
        return min((r for r in handoffs if allowed(r)), key=lambda r: r["median_ms"])

    def base(r) -> bool:
        return (r["cut"] == 0 or r["codec"] in BASE_CODECS) and r["boundary"] == "bf16"

    before = best(base)
    options = {r["codec"] for r in handoffs if r["cut"] and r["codec"] not in BASE_CODECS}
    gains = {"base": {"label": before["label"], "median_ms": before["median_ms"]}}
    for option in sorted(options) + ["splitzip boundary"]:
        def allowed(r, option=option) -> bool:
            if option == "splitzip boundary":
                return (r["cut"] == 0 or r["codec"] in BASE_CODECS)
            return base(r) or r["codec"] == option and r["boundary"] == "bf16"
        if option == "splitzip boundary" and all(r["boundary"] == "bf16" for r in handoffs
                                                 if r["cut"]):
            continue
        after = best(allowed)
        gains[option] = {"label": after["label"], "median_ms": after["median_ms"],
                         "base_over_best": before["median_ms"] / after["median_ms"]}
    return gains


def _point_line(p: dict) -> str:
    b = p["best"]
    return (f"S={p['prompt_len']} link={p['link']}: " + ", ".join(
        f"{s} {b[s]['median_ms']:.0f} ms ({b[s]['label']})" for s in SCHEDULES)
        + "; " + ", ".join(f"{name} {p[key]:.2f}" for name, key in PAIRED) + "; paired: "
        + ", ".join(
              f"{name} {p['paired'][key]['median']:.2f}" for name, key in PAIRED))
