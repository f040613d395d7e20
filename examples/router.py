"""A small router over rekv decode replicas: health checks, least-loaded routing, one retry rule.

The router is rekv's way in: it calls `rekv.v1.Decode/Generate` on one decode replica, which gets
the prompt's KV cache from a prefill worker itself, and streams the generated tokens back (one
message per token, the last one carrying the summary). This example

- keeps one gRPC channel per decode replica;
- asks each replica's standard `grpc.health.v1.Health/Check` ("": the whole server) every
  `health_interval_s` seconds with a short deadline; a replica that fails the check or answers
  NOT_SERVING (as a rekv service does from the moment it receives SIGTERM) leaves the rotation
  and comes back once it answers SERVING again;
- sends each call to the healthy replica with the fewest calls in flight from this router (ties in
  round-robin order), or plain round robin with `policy="round_robin"`;
- retries a call on another replica only when it failed with UNAVAILABLE before anything was
  streamed, under the same overall deadline;
- counts calls per replica (`stats()`).

    python examples/router.py --decode 127.0.0.1:50051 --decode 127.0.0.1:50052 \\
        --prompt "The capital of France is" --max-new-tokens 16

What a production router adds: the caller's own deadline per request, propagated (gRPC carries it
to the decode worker, which passes what is left to the prefill worker), and timeouts per stage
(time to first token, gap between tokens); load as the replicas report it (`rekv_queue_depth`,
`rekv_handoffs_in_flight` on /metrics), since several routers share the replicas; outlier ejection
from observed errors and latency, not only health checks; affinity, sending prompts that share a
prefix to the same replica so a prefix cache there can serve them; admission control and
backpressure instead of queueing without bound; service discovery instead of a fixed address
list; TLS, authentication, tracing and metrics.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rekv_cli.client import generate_request
from services.rpc import rekv_pb2, rekv_pb2_grpc

POLICIES = ("least_loaded", "round_robin")
SERVING = health_pb2.HealthCheckResponse.SERVING


class NoReplicaAvailable(RuntimeError):
    """No replica is in rotation, or every one was tried for this call and was unavailable."""


class Replica:
    """One decode replica: its channel, stubs, health and this router's counts."""

    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.decode = rekv_pb2_grpc.DecodeStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = False  # until a health check says SERVING
        self.in_flight = 0  # this router's calls on it now
        self.calls = 0  # calls sent to it
        self.served = 0  # calls it completed
        self.unavailable = 0  # calls it refused with UNAVAILABLE before streaming


@dataclass
class Routed:
    """A finished call: the replica that served it, the new tokens, their text, the summary."""
    address: str
    token_ids: list[int]
    text: str
    summary: rekv_pb2.Summary


class Router:
    def __init__(self, decode_addresses: Sequence[str], policy: str = "least_loaded",
                 health_interval_s: float = 2.0, health_timeout_s: float = 1.0):
        if policy not in POLICIES:
            raise ValueError(f"policy: must be one of {POLICIES}, got {policy!r}")
        if not decode_addresses:
            raise ValueError("decode_addresses: at least one is required")
        self.policy = policy
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.replicas = [Replica(address) for address in dict.fromkeys(decode_addresses)]
        self._lock = threading.Lock()  # guards every replica's counts and health, and _next
        self._next = 0  # the replica whose round-robin turn it is
        self._stop = threading.Event()
        self.check_health()  # know who is serving before the first call
        self._checker = threading.Thread(target=self._check_forever, daemon=True)
        self._checker.start()

    def check_health(self) -> None:
        """One round of health checks, one replica after the other."""
        for replica in self.replicas:
            try:
                reply = replica.health.Check(health_pb2.HealthCheckRequest(service=""),
                                             timeout=self.health_timeout_s)
                healthy = reply.status == SERVING
            except grpc.RpcError:  # unreachable, too slow, or not serving health at all
                healthy = False
            with self._lock:
                replica.healthy = healthy

    def _check_forever(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            self.check_health()

    def _acquire(self, tried: set[str]) -> Replica | None:
        """The replica for the next attempt, its in-flight count already raised under the lock,
        so that concurrent calls see each other's load."""
        with self._lock:
            n = len(self.replicas)
            in_turn = [self.replicas[(self._next + i) % n] for i in range(n)]
            candidates = [r for r in in_turn if r.healthy and r.address not in tried]
            if not candidates:
                return None
            if self.policy == "least_loaded":  # min() keeps the first of equals: round robin
                chosen = min(candidates, key=lambda r: r.in_flight)
            else:
                chosen = candidates[0]
            self._next = (self.replicas.index(chosen) + 1) % n
            chosen.in_flight += 1
            chosen.calls += 1
            return chosen

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int, *,
                 request_id: str = "", forced_action: tuple[str, int] | None = None,
                 sampling: dict | None = None, timeout: float = 60.0,
                 ) -> Iterator[tuple[str, rekv_pb2.GenerateResponse]]:
        """Route one call and yield (replica address, response) as the tokens arrive; the last
        response carries the summary. `timeout` bounds the whole call, retries included."""
        request = generate_request(request_id or f"router-{uuid.uuid4().hex[:12]}", prompt,
                                   max_new_tokens, forced_action, sampling)
        deadline = time.monotonic() + timeout
        tried: set[str] = set()
        while True:
            replica = self._acquire(tried)
            if replica is None:
                raise NoReplicaAvailable(f"request {request.request_id}: no replica in rotation "
                                         f"left to try (tried {sorted(tried) or 'none'})")
            tried.add(replica.address)
            call = replica.decode.Generate(request, timeout=max(0.0, deadline - time.monotonic()))
            streamed = False
            try:
                for response in call:
                    streamed = True
                    yield replica.address, response
                with self._lock:
                    replica.served += 1
                return
            except grpc.RpcError as error:
                # Retry only a call that streamed nothing: the replica refused it or could not be
                # reached, so it generated nothing the caller has seen. Never replay a stream that
                # already yielded tokens: the caller has them (a user may be reading them), and a
                # second replica would start over from the prompt, so the caller would get them
                # twice, and with sampling, or another handoff action, not even the same ones.
                # Resuming would need the prompt plus the tokens so far: a different request,
                # which is the caller's call to make. Other codes (INVALID_ARGUMENT,
                # DEADLINE_EXCEEDED, ...) would fail the same way anywhere.
                if streamed or error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                with self._lock:
                    replica.unavailable += 1
                    replica.healthy = False  # out until a health check says SERVING again
            finally:
                call.cancel()  # a no-op once finished; frees the replica if the caller stopped
                with self._lock:
                    replica.in_flight -= 1

    def complete(self, prompt: str | Sequence[int], max_new_tokens: int, **kwargs) -> Routed:
        """`generate`, collected: the whole answer and the replica that served it."""
        address, tokens, pieces, summary = "", [], [], None
        for address, response in self.generate(prompt, max_new_tokens, **kwargs):
            tokens.extend(response.token_ids)
            pieces.append(response.text)
            if response.HasField("summary"):
                summary = response.summary
        if summary is None:
            raise RuntimeError(f"{address}: the stream ended without a summary")
        return Routed(address, tokens, "".join(pieces), summary)

    def stats(self) -> dict[str, dict]:
        """Per replica: in rotation or not, calls in flight, sent, served and refused."""
        with self._lock:
            return {r.address: {"healthy": r.healthy, "in_flight": r.in_flight, "calls": r.calls,
                                "served": r.served, "unavailable": r.unavailable}
                    for r in self.replicas}

    def close(self) -> None:
        self._stop.set()
        self._checker.join(self.health_timeout_s * len(self.replicas) + 1.0)
        for replica in self.replicas:
            replica.channel.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Send a prompt through a small router over "
                                     "rekv decode replicas and print the streamed answer.")
    parser.add_argument("--decode", action="append", required=True, metavar="HOST:PORT",
                        help="a decode replica's gRPC address (repeat the flag for each)")
    parser.add_argument("--policy", choices=POLICIES, default="least_loaded")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=1,
                        help="send the prompt this many times, one after another")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    args = parser.parse_args(argv)
    with Router(args.decode, args.policy) as router:
        for _ in range(args.requests):
            try:
                address, summary = "", None
                for address, response in router.generate(args.prompt, args.max_new_tokens,
                                                         timeout=args.timeout):
                    print(response.text, end="", flush=True)
                    summary = response.summary if response.HasField("summary") else summary
            except (grpc.RpcError, NoReplicaAvailable) as error:
                print(f"\nrequest failed: {error}", file=sys.stderr)
                return 1
            print(f"\n[served by {address}: {summary.generated_tokens} tokens, "
                  f"{summary.action_kind} ({summary.action.codec}, cut {summary.action.cut}), "
                  f"TTFT {summary.ttft_ms:.0f} ms, {summary.request_ms:.0f} ms in all]")
        for address, counts in router.stats().items():
            print(f"{address}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
