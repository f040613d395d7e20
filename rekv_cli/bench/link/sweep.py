"""`rekv bench link`: the real services across an emulated cross-node link, every action timed.

The prefill and decode services run in two network namespaces joined by a veth pair shaped with
`tc tbf` (`netns.EmulatedLink`); gRPC and UCX (TCP) both cross it. Without root (or `ip`/`tc`), it
says so and runs both services on loopback instead, with the prefill side pacing its UCX sends to
the link rate (`--pace-gbps`). There is no delay or loss emulation (this kernel has no `netem`).

For each prompt length S and link rate (Gb/s, or xK: K times S's balanced rate, at which all layers'
BF16 KV takes as long on the link as computing all layers), a client inside the decode namespace
(`link_client`) sends W warm-up rounds, then N timed ones, of one request per case with one new
token, the cases in a shuffled order each round (the planner's case among them, so it has seen
as many runs of each forced action as rounds have passed). Cases
(`forced_actions`): the baseline (full prefill, then full BF16), the seed's schedule (full prefill,
then the handoff) for int8 transfer-only and joint int8 at each cut of the sweep, the streamed
schedule (the handoff from inside a prefill that stops at the cut) for full BF16, int8
transfer-only, token-only, BF16 recompute and joint int8 at each cut with the boundary in chunks,
joint int8 with it in one message, BF16 recompute and joint int8 at each cut pipelined (the prefill
in the boundary's token chunks), then the planner's own choice (no forced action or schedule).
Where the machine has two cores or more, each service is pinned to its own half of them
(`taskset`), with as many torch threads as cores, and the balanced rate is measured under the same
pinning: two nodes do not share cores, and without the pinning the decode side's recompute and the
prefill side's encoding and sends would compete.
Per point it reports medians with 95% bootstrap intervals of TTFT from Generate's arrival on the
decode worker (and the median handoff time, from the end of the prefill to the complete cache),
speedups over the baseline, each schedule's best case, the best case, and whether the planner's
pick is within 10% of it (`report`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rekv_cli.bench.handoff import LinkRate, prompt_ids, time_compute_all
from rekv_cli.bench.link.netns import DECODE_ADDRESS, PREFILL_ADDRESS, EmulatedLink, unavailable
from rekv_cli.bench.link.report import point_summary, row
from rekv_cli.bench.machine import machine_info
from rekv_cli.launcher import ServicePair
from rekv_core.handoff import Action
from rekv_core.handoff.action import wire_bytes
from rekv_core.model import Model

# Both services share one host, so UCX would otherwise move bulk data through shared memory and
# around the shaped veth pair.
TCP_ONLY = {"UCX_TLS": "tcp"}


@dataclass
class LinkBenchConfig:
    prompt_lens: Sequence[int] = (256, 1024)
    rates: Sequence[LinkRate] = (LinkRate(1, True), LinkRate(4, True), LinkRate(10, False))
    cuts: Sequence[int] | None = None  # default: L·{0.3, 0.5, 0.7}
    warmups: int = 3
    runs: int = 10
    service_args: list[str] = field(default_factory=list)
    log_dir: str | None = None
    loopback: bool = False  # skip the namespaces even where they can be made
    pin: bool = True  # each service on its own half of the cores (where there are two or more)
    codecs: Sequence[str] = ()  # newer options, also timed streamed at every cut (`splitzip`:
    #   int8 joint actions with a SplitZip boundary too); the services are given them


def split_cores(cores: Sequence[int]) -> tuple[list[int], list[int]] | None:
    """(prefill's cores, decode's cores): the first half and the rest; None below two cores."""
    cores = sorted(cores)
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return cores[:half], cores[half:]


def _taskset(cores: Sequence[int] | None) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cores))] if cores else []


@contextlib.contextmanager
def pinned(cores: Sequence[int] | None):
    """This process on `cores` with as many torch threads, restored on exit (no-op for None)."""
    if not cores:
        yield
        return
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def service_layout(service_args: Sequence[str], pin: bool = True
                   ) -> tuple[tuple[list[int] | None, list[int] | None], dict[str, list[str]]]:
    """((prefill's cores, decode's cores), each role's service arguments): with `pin` and two cores
    or more, each service on its own half of them with as many torch threads (unless
    `service_args` sets them); otherwise (None, None) and `service_args` for both."""
    sides = split_cores(os.sched_getaffinity(0)) if pin else None
    cores = sides or (None, None)
    own_threads = "--torch-threads" not in service_args
    return cores, {role: [*service_args, *(["--torch-threads", str(len(side))]
                                           if side and own_threads else [])]
                   for role, side in zip(("prefill", "decode"), cores)}


def balanced_gbps(model: Model, ids: Sequence[int], cores: Sequence[int] | None = None,
                  repeats: int = 3) -> tuple[float, float]:
    """(the link rate in Gb/s at which all layers' BF16 KV of the prompt `ids` takes as long on
    the link as computing all layers, that compute in seconds), timed on `cores`."""
    with pinned(cores):
        compute = time_compute_all(model, ids, repeats)
    prefix = wire_bytes(Action.full_bf16(model.shape.num_layers), model.shape, len(ids)).prefix
    return prefix * 8 / compute / 1e9, compute


def start_services(service_args: dict[str, list[str]], log_dir: str | Path,
                   cores: tuple[Sequence[int] | None, Sequence[int] | None] = (None, None),
                   link: EmulatedLink | None = None, pace_gbps: float = 0.0) -> ServicePair:
    """Both services, each under `taskset` on its cores: in `link`'s namespaces (UCX over TCP
    only), or without a link on loopback with the prefill pacing its UCX sends to `pace_gbps`."""
    (prefill_cores, decode_cores), prefill_args, decode_args = (
        cores, service_args["prefill"], service_args["decode"])
    if link is None:
        return ServicePair([*prefill_args, "--pace-gbps", f"{pace_gbps}"], decode_args,
                           log_dir=log_dir, prefill_prefix=_taskset(prefill_cores),
                           decode_prefix=_taskset(decode_cores))
    return ServicePair(
        [*prefill_args, "--host", PREFILL_ADDRESS], [*decode_args, "--host", DECODE_ADDRESS],
        log_dir=log_dir, env=TCP_ONLY,
        prefill_prefix=[*link.prefix("prefill"), *_taskset(prefill_cores)],
        decode_prefix=[*link.prefix("decode"), *_taskset(decode_cores)])


def default_cuts(num_layers: int) -> list[int]:
    return sorted({round(num_layers * f) for f in (0.3, 0.5, 0.7)})


SEED_SCHEDULE = [False, 0]  # a full prefill, then the handoff (the boundary in one message)


def forced_actions(num_layers: int, cuts: Sequence[int], chunk_tokens: int = 256,
                   codecs: Sequence[str] = ()) -> list[dict]:
    """The cases of a point: the baseline (full prefill, then every layer's BF16 KV); the seed's
    schedule at each joint int8 cut and int8 transfer-only; the streamed schedule (the services'
    default, in layer order) for every action, the interior cuts also with the boundary in one
    message, and BF16 and int8 at each interior cut pipelined (token order); token-only
    (which the streamed schedule serves without any prefill: the decode side's local prefill, the
    colocated bound plus one RPC); each of `codecs` streamed at every cut, and with `splitzip`
    among them int8 at every interior cut with a SplitZip boundary; then the planner's choice
    under the default schedule."""
    L = num_layers
    streamed, whole = [True, chunk_tokens], [True, 0]
    cases = [{"action": ["bf16", L], "schedule": SEED_SCHEDULE}]
    cases += [{"action": ["int8", L], "schedule": SEED_SCHEDULE}]
    cases += [{"action": ["int8", c], "schedule": SEED_SCHEDULE} for c in cuts]
    cases += [{"action": a, "schedule": streamed} for a in (["bf16", L], ["int8", L], ["bf16", 0])]
    for codec in ("bf16", "int8"):
        cases += [{"action": [codec, c], "schedule": streamed} for c in cuts]
    cases += [{"action": ["int8", c], "schedule": whole} for c in cuts]
    for codec in ("bf16", "int8"):
        cases += [{"action": [codec, c], "schedule": [True, chunk_tokens, True]} for c in cuts]
    for codec in codecs:
        cases += [{"action": [codec, c], "schedule": streamed} for c in [*cuts, L]]
    if "splitzip" in codecs:
        cases += [{"action": ["int8", c, "splitzip"], "schedule": streamed} for c in cuts]
    return [*cases, {"action": None, "schedule": None}]  # None: the planner chooses


def run_link_bench(model: Model, config: LinkBenchConfig,
                   progress: Callable[[str], None] = lambda _: None) -> dict:
    """The sweep. SIGTERM ends it like Ctrl-C: the services stop and the namespaces go."""
    if threading.current_thread() is not threading.main_thread():
        return _Sweep(model, config, progress).run()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _Sweep(model, config, progress).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


class _Sweep:
    def __init__(self, model: Model, config: LinkBenchConfig, progress: Callable[[str], None]):
        self.model, self.config, self.progress = model, config, progress
        self.shape = model.shape
        self.cuts = list(config.cuts or default_cuts(self.shape.num_layers))
        self.actions = forced_actions(self.shape.num_layers, self.cuts, codecs=config.codecs)
        (self.prefill_cores, self.decode_cores), self.service_args = service_layout(
            config.service_args, config.pin)
        self.why_not = "loopback requested" if config.loopback else unavailable()
        self.log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="rekv-link-"))
        self.balanced: dict[int, float] = {}
        self.rows: list[dict] = []
        self.points: list[dict] = []

    def run(self) -> dict:
        for S in self.config.prompt_lens:
            self.balanced[S] = self._balanced_gbps(S)
        first = self.config.rates[0].gbps(self.balanced[self.config.prompt_lens[0]])
        link = None if self.why_not else EmulatedLink(first)
        pair = None
        try:
            if link:
                self.progress(f"emulated link: namespaces {link.prefill_ns} and {link.decode_ns}, "
                              f"veth shaped with tc tbf")
                pair = self._services(link=link)
            else:
                self.progress(f"no emulated link ({self.why_not}): loopback with paced UCX sends "
                              f"instead")
            for rate in self.config.rates:
                for S in self.config.prompt_lens:
                    gbps = rate.gbps(self.balanced[S])
                    if link:
                        link.set_rate(gbps)
                    else:  # the prefill service paces its sends: a fresh pair per rate
                        if pair is not None:
                            pair.stop()
                        pair = self._services(pace_gbps=gbps)
                    self._point(pair, link, S, rate, gbps)
            codes, pair = (pair.stop() if pair else {}), None
        finally:
            if pair is not None:  # an error or a signal: stop the services before the namespaces
                pair.stop()
            if link:
                link.close()
        return {"meta": self._meta(codes), "balanced_gbps": self.balanced, "rows": self.rows,
                "points": self.points}

    def _balanced_gbps(self, S: int) -> float:
        """The rate at which all layers' BF16 KV takes as long on the link as computing them."""
        balanced, compute = balanced_gbps(self.model, prompt_ids(self.shape.vocab_size, S, 0),
                                          self.decode_cores)
        self.progress(f"S={S}: all layers compute in {compute * 1e3:.0f} ms, balanced link "
                      f"{balanced:.3f} Gb/s")
        return balanced

    def _services(self, link: EmulatedLink | None = None, pace_gbps: float = 0.0) -> ServicePair:
        return start_services(self.service_args, self.log_dir,
                              (self.prefill_cores, self.decode_cores), link, pace_gbps)

    def _point(self, pair: ServicePair, link: EmulatedLink | None, S: int, rate: LinkRate,
               gbps: float) -> None:
        started = time.perf_counter()
        client_prefix = link.prefix("decode") if link else []
        results = run_client(client_prefix, pair.decode_address, S, self.shape.vocab_size,
                              self.actions, self.config)
        point_rows = [row(self.shape, S, rate, gbps, r) for r in results]
        for r in point_rows:
            r["speedup_vs_bf16"] = point_rows[0]["median_ms"] / r["median_ms"]
        self.rows += point_rows
        point = point_summary(S, rate, gbps, point_rows, self.balanced[S])
        self.points.append(point)
        self.progress(f"S={S} link {rate.label} ({gbps:.3f} Gb/s): best "
                      f"{point['best']['label']} {point['best']['median_ms']:.1f} ms, planner "
                      f"{point['planner']['label']} {point['planner']['median_ms']:.1f} ms "
                      f"({time.perf_counter() - started:.0f} s)")

    def _meta(self, codes: dict) -> dict:
        model, config = self.model, self.config
        return {**machine_info(model.device, model.dtype, torch.get_num_threads()),
                "model": self.shape.name, "num_layers": self.shape.num_layers,
                "warmups": config.warmups, "runs": config.runs, "cuts": self.cuts,
                "link": "veth + tc tbf in two network namespaces" if not self.why_not
                else f"loopback, paced UCX sends ({self.why_not})",
                "delay_emulation": "none: this kernel has no netem",
                "service_exit_codes": codes, "logs": str(self.log_dir),
                "service_cores": {"prefill": self.prefill_cores, "decode": self.decode_cores},
                "service_args": self.service_args}


def run_client(prefix: list[str], address: str, S: int, vocab: int, actions: list,
               config: LinkBenchConfig, seed: int = 0, new_tokens: int = 1) -> list[dict]:
    """The link client (`rekv_cli.bench.link.client`) under `prefix` (e.g. inside the decode
    namespace): `config.warmups` and `config.runs` rounds of one request per case of `actions`."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = out.name
    command = [*prefix, sys.executable, "-m", "rekv_cli.bench.link.client", "--decode", address,
               "--prompt-len", str(S), "--vocab", str(vocab), "--actions", json.dumps(actions),
               "--warmups", str(config.warmups), "--runs", str(config.runs), "--seed", str(seed),
               "--out", path, "--new-tokens", str(new_tokens)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"link client failed: {result.stderr[-3000:]}")
    data = json.loads(Path(path).read_text())
    Path(path).unlink()
    return data
