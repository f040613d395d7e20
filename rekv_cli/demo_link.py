"""Where `rekv demo` runs its two services: across an emulated cross-node link.

`link_rate(...)` chooses the rate: the one given, or the "balanced" rate of a prompt, at which all
layers' BF16 KV takes as long on the link as computing all layers here (`sweep.balanced_gbps`).
`DemoServices(...)` starts both services as `rekv bench link` does (`sweep.start_services`): in two
network namespaces joined by a veth pair shaped with `tc tbf` (`netns.EmulatedLink`) where that can
be made (root, `ip`, `tc`), otherwise on loopback with the prefill pacing its UCX sends to the rate;
each service on its own half of the cores where there are two or more (`sweep.service_layout`).
`run_requests(...)` sends requests through the decode service with `rekv_cli.demo_client`, inside
the decode side's namespace where there is one (the namespaces' addresses exist only there).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rekv_cli.bench.link.netns import EmulatedLink, unavailable
from rekv_cli.bench.link.sweep import balanced_gbps, start_services


@dataclass
class DemoRate:
    gbps: float
    chosen: str  # "balanced" or "--link-gbps"
    prompt_tokens: int | None = None  # balanced: the prompt it is balanced for
    compute_ms: float | None = None  # balanced: all layers of that prompt, measured here
    bf16_kv_bytes: int | None = None  # balanced: all layers' BF16 KV of that prompt

    def describe(self) -> str:
        if self.chosen != "balanced":
            return f"{self.gbps:.3g} Gb/s, set by --link-gbps"
        return (f"{self.gbps:.3g} Gb/s, balanced for the longest prompt ({self.prompt_tokens} "
                f"tokens): its {self.bf16_kv_bytes / 2**20:.1f} MiB of BF16 KV take as long on the "
                f"link as computing its {self.compute_ms:.0f} ms of layers here (one service's "
                f"cores); --link-gbps sets another")


def link_rate(settings, prompts: Sequence[str], gbps: float | None,
              cores: Sequence[int] | None) -> DemoRate:
    """`gbps` when given; otherwise the balanced rate of the longest of `prompts` (in tokens),
    timed on `cores` (the decode service's) with the model `settings` name, loaded here once."""
    if gbps is not None:
        if gbps <= 0:
            raise ValueError(f"link-gbps: must be positive, got {gbps}")
        return DemoRate(gbps, "--link-gbps")
    from rekv_core.handoff import Action
    from rekv_core.handoff.action import wire_bytes
    from rekv_core.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(settings.model)
    if tokenizer is None:
        raise ValueError(f"model {settings.model!r}: no tokenizer for the demo's text prompts")
    ids = max((tokenizer.encode(p) for p in prompts), key=len)
    settings.apply_threads()
    model = settings.load_model()
    rate, compute = balanced_gbps(model, ids, cores, repeats=1)  # after a warm-up run
    kv = wire_bytes(Action.full_bf16(model.shape.num_layers), model.shape, len(ids)).prefix
    return DemoRate(rate, "balanced", len(ids), compute * 1e3, kv)


class DemoServices:
    """Both services across the emulated link (or paced loopback); `stop()` stops them, removes
    the namespaces and returns the services' exit codes."""

    def __init__(self, service_args: dict[str, list[str]], log_dir: str | Path,
                 cores: tuple, gbps: float, loopback: bool):
        self.why_not = "--loopback given" if loopback else unavailable()
        self.link = None
        if not self.why_not:
            try:
                self.link = EmulatedLink(gbps)
            except RuntimeError as error:  # e.g. root in a container without CAP_NET_ADMIN
                self.why_not = str(error)
        self.kind = "netns" if self.link else "paced"
        try:
            self.pair = start_services(service_args, log_dir, cores, self.link,
                                       pace_gbps=0.0 if self.link else gbps)
        except BaseException:
            if self.link:
                self.link.close()
            raise

    def describe(self) -> str:
        if self.link:
            return (f"netns: two network namespaces ({self.link.prefill_ns}, "
                    f"{self.link.decode_ns}) joined by a veth pair shaped with tc tbf; gRPC and "
                    f"UCX (TCP) cross it")
        return (f"paced: loopback, the prefill service paces its UCX sends (--pace-gbps); no "
                f"namespaces ({self.why_not})")

    def stop(self) -> dict[str, int]:
        try:
            return self.pair.stop()
        finally:
            if self.link:
                self.link.close()

    def run_requests(self, requests: list[dict], on_answer: Callable[[dict], None],
                     log_path: Path) -> list[dict]:
        """Every request through the decode service, in order; one answer per request (an
        {"id", "error"} for each the client did not answer)."""
        prefix = self.link.prefix("decode") if self.link else []
        command = [*prefix, sys.executable, "-m", "rekv_cli.demo_client", "--decode",
                   self.pair.decode_address]
        answers = []
        with open(log_path, "w") as log:
            client = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=log, text=True)
            try:
                client.stdin.write(json.dumps(requests))
                client.stdin.close()
                for line in client.stdout:
                    answers.append(json.loads(line))
                    on_answer(answers[-1])
            finally:
                if client.poll() is None and len(answers) < len(requests):
                    client.kill()
                client.wait()
        done = {a["id"] for a in answers}
        return answers + [{"id": r["id"], "error": f"no answer (client exit {client.returncode}; "
                                                   f"see {log_path})"}
                          for r in requests if r["id"] not in done]


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM ends the demo like Ctrl-C, so the services stop and the namespaces go."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
