"""The requests of the reliability load bench (`bench/reliability_load.py`): a pool of WikiText-2
prompts, a seeded mixed plan, each call with its outcome (OK, a gRPC status, LOST or CLIENT_ERROR),
and a phase run at a given concurrency."""

from __future__ import annotations

import math
import random
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import cycle, islice
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc

from rekv_cli.client import generate
from rekv_core.handoff import Action
from rekv_core.model import get_preset

MODEL = "smollm2-135m"  # the embedded model
SHAPE = get_preset(MODEL)
ROLES = ("prefill", "decode")
MIX = (("bf16_transfer", ("bf16", SHAPE.num_layers)),
       ("bf16_recompute", ("bf16", SHAPE.num_layers // 2)),
       ("joint_int8", ("int8", SHAPE.num_layers // 2)),
       ("token_recompute", ("bf16", 0)),
       ("planner", None))
SAMPLE_EVERY = 25  # requests between two memory samples
LOST_GRACE_S = 30.0  # past its deadline, a request that has not ended is lost
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


@dataclass
class Outcome:
    """One request: what was asked, then how it ended."""

    index: int
    phase: str
    label: str  # a MIX label
    forced: tuple[str, int] | None
    prompt: int  # index in the prompt pool
    prompt_tokens: int
    max_new_tokens: int
    status: str = "PENDING"  # OK, a gRPC status name, LOST, CLIENT_ERROR
    detail: str = ""
    started_s: float | None = None  # monotonic clock
    ended_s: float | None = None
    client_ms: float | None = None
    ttft_ms: float | None = None
    handoff_ms: float | None = None
    action: str | None = None  # "codec/cut", the action used
    action_kind: str | None = None
    lossless: bool | None = None
    fallback: bool | None = None
    fallback_reason: str = ""
    tokens: list[int] = field(default_factory=list)
    match: bool | None = None  # against the reference; None: not checked

    @property
    def used(self) -> str:
        """The kind and codec of the action used (the planner's cuts vary)."""
        codec = (self.action or "").split("/")[0]
        return f"{self.action_kind} {codec}" + (" (fallback)" if self.fallback else "")


def prompt_pool(tokenizer, count: int, lengths: tuple[int, int], rng: random.Random,
                source: Path = WIKITEXT) -> list[list[int]]:
    """`count` prompts as token ids, each from a random paragraph of `source` (WikiText-2's lines
    of text, headings left out) on, its length log-uniform in [lo, hi]."""
    text = source.read_bytes().decode("utf-8")
    paragraphs = [p.strip() for p in text.splitlines()
                  if len(p.strip()) > 100 and not p.strip().startswith("=")]
    lo, hi = lengths
    pool = []
    for _ in range(count):
        length = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        start, ids = rng.randrange(len(paragraphs)), []
        for paragraph in islice(cycle(paragraphs), start, None):
            ids += tokenizer.encode(paragraph + "\n")
            if len(ids) >= length:
                break
        pool.append(ids[:length])
    return pool


def plan(phase: str, count: int, pool: list[list[int]], new_tokens: tuple[int, int],
         rng: random.Random) -> list[Outcome]:
    """`count` requests cycling through MIX, shuffled; a random prompt and length each."""
    mix = [MIX[i % len(MIX)] for i in range(count)]
    rng.shuffle(mix)
    out = []
    for index, (label, forced) in enumerate(mix):
        prompt = rng.randrange(len(pool))
        out.append(Outcome(index, phase, label, forced, prompt, len(pool[prompt]),
                           rng.randint(*new_tokens)))
    return out


def call(channel: grpc.Channel, o: Outcome, prompt: list[int], deadline_s: float,
         barrier: threading.Barrier | None = None) -> dict:
    """One Generate call; the Outcome fields it settled (the caller applies them)."""
    if barrier is not None:
        barrier.wait(deadline_s)
    r = {"started_s": time.monotonic()}
    try:
        g = generate(channel, f"{o.phase}-{o.index}", prompt, o.max_new_tokens,
                     forced_action=o.forced, stop_at_eos=False, timeout=deadline_s)
    except grpc.RpcError as exc:
        r.update(status=exc.code().name, detail=exc.details() or "")
    except RuntimeError as exc:  # the stream ended, without a status, and without its summary
        r.update(status="LOST", detail=str(exc))
    else:
        s = g.summary
        r.update(ttft_ms=s.ttft_ms, handoff_ms=s.measured_handoff_ms,
                 action=f"{s.action.codec}/{s.action.cut}", action_kind=s.action_kind,
                 lossless=Action(s.action.codec, s.action.cut, SHAPE.num_layers).lossless,
                 fallback=s.fallback, fallback_reason=s.fallback_reason, tokens=g.token_ids,
                 status="OK")
        if len(g.token_ids) != o.max_new_tokens or s.generated_tokens != len(g.token_ids):
            r.update(status="LOST", detail=f"{len(g.token_ids)} of {o.max_new_tokens} tokens, "
                     f"summary says {s.generated_tokens}")
    r["ended_s"] = time.monotonic()
    r["client_ms"] = (r["ended_s"] - r["started_s"]) * 1e3
    return r


def _guarded(began: dict, channel, o: Outcome, prompt, deadline_s, barrier) -> dict:
    began[o.index] = time.monotonic()
    try:
        return call(channel, o, prompt, deadline_s, barrier)
    except Exception as exc:  # noqa: BLE001 - a bug on this side: reported, never hidden
        return {"status": "CLIENT_ERROR", "detail": f"{type(exc).__name__}: {exc}"}


def run_phase(channel: grpc.Channel, outcomes: list[Outcome], pool: list[list[int]],
              concurrency: int, deadline_s: float, together: bool = False,
              on_done=None, watch=None) -> float:
    """Run `outcomes` `concurrency` at a time (all released at once when `together`); fills them
    in; returns the phase's wall seconds. `on_done(n)` after the n-th end, `watch()` about every
    half second. A request that has not ended `LOST_GRACE_S` after its deadline is marked LOST
    and left behind (its thread is not waited for)."""
    barrier = threading.Barrier(len(outcomes)) if together else None
    executor = ThreadPoolExecutor(concurrency, thread_name_prefix="rekv-load")
    began: dict[int, float] = {}
    start = time.monotonic()
    futures = {executor.submit(_guarded, began, channel, o, pool[o.prompt], deadline_s,
                               barrier): o for o in outcomes}
    pending, ended = set(futures), 0
    while pending:
        done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
        now = time.monotonic()
        late = {f for f in pending if now - began.get(futures[f].index, now) >
                deadline_s + LOST_GRACE_S}
        for f in late:
            futures[f].status = "LOST"
            futures[f].detail = f"no end {deadline_s + LOST_GRACE_S:.0f} s after it began"
        pending -= late
        for f in [*done, *late]:
            if f in done:
                vars(futures[f]).update(f.result())
            ended += 1
            if on_done is not None:
                on_done(ended)
        if watch is not None:
            watch()
    executor.shutdown(wait=False, cancel_futures=True)
    return time.monotonic() - start


def most_open(outcomes: list[Outcome]) -> int:
    """The largest number of calls open at one moment, from their client-side intervals."""
    events = sorted([(o.started_s, 1) for o in outcomes if o.ended_s] +
                    [(o.ended_s, -1) for o in outcomes if o.ended_s])
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best




