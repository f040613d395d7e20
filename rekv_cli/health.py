"""`rekv health`: ask a running service's standard gRPC health service (grpc.health.v1) whether it
serves. Exit 0 when the answer is SERVING, 1 otherwise, with a one-line reason (unreachable, no
answer in time, NOT_SERVING, unknown service). It is what the images' HEALTHCHECK runs.

    rekv health [--address HOST:PORT] [--service NAME] [--timeout S]

The default address is this host's own service: 127.0.0.1 (or REKV_HOST when that names one
address rather than every interface) at its health port. With TLS configured (REKV_TLS_CERT set
and REKV_PLAINTEXT not true) that is REKV_HEALTH_PORT (50052 when unset), where the service serves
grpc.health.v1 alone in plaintext, as this check speaks it; otherwise REKV_GRPC_PORT (50051 when
unset), whose plaintext server has the health service too. The default service "" is the server
as a whole, which turns SERVING once the worker is ready and NOT_SERVING when it begins a graceful
shutdown.

`python -m rekv_cli.health` runs the same check without loading the rest of the `rekv` command
(whose planner imports PyTorch, seconds of CPU per call): the images' HEALTHCHECK uses it.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_PORT = 50051
DEFAULT_HEALTH_PORT = 50052  # the images' and the Helm chart's REKV_HEALTH_PORT
DEFAULT_TIMEOUT_S = 3.0
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def tls_configured(env: dict[str, str]) -> bool:
    """Whether the service serves TLS: REKV_TLS_CERT set and REKV_PLAINTEXT not true (as
    services/settings.py reads them)."""
    plaintext = env.get("REKV_PLAINTEXT", "").strip().lower() in ("1", "true", "yes")
    return bool(env.get("REKV_TLS_CERT", "").strip()) and not plaintext


def default_address(env: dict[str, str] | None = None) -> str:
    """127.0.0.1 (or REKV_HOST if it names one address) and, with TLS, REKV_HEALTH_PORT (or
    50052), the plaintext health-only port; else REKV_GRPC_PORT (or 50051)."""
    env = os.environ if env is None else env
    host = env.get("REKV_HOST", "").strip()
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    if tls_configured(env):
        port = env.get("REKV_HEALTH_PORT", "").strip() or str(DEFAULT_HEALTH_PORT)
    else:
        port = env.get("REKV_GRPC_PORT", "").strip() or str(DEFAULT_PORT)
    return f"{host}:{port}"


def check(address: str, service: str = "",
          timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[bool, str]:
    """(serving, one line saying what the health service answered, or why it did not)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    name = repr(service) if service else "the server"
    # A probe goes straight to the service: no HTTP proxy from the environment in between.
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.NOT_FOUND:
                return False, f"{address}: unknown service {service!r}"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return False, f"{address}: no answer within {timeout_s:g} s"
            if code == grpc.StatusCode.UNAVAILABLE:
                return False, f"{address}: unreachable ({_first_line(exc.details())})"
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return False, f"{address}: no grpc.health.v1 service there"
            return False, f"{address}: {code.name} ({_first_line(exc.details())})"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {name} {status}"


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else "no details"


def add_health_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--address", default=None, metavar="HOST:PORT",
                        help="the service's plaintext health address (default: with TLS "
                             f"configured 127.0.0.1:$REKV_HEALTH_PORT, or port "
                             f"{DEFAULT_HEALTH_PORT}; else 127.0.0.1:$REKV_GRPC_PORT, or port "
                             f"{DEFAULT_PORT})")
    parser.add_argument("--service", default="", metavar="NAME",
                        help='the service to ask about (default "": the server as a whole), '
                             "e.g. rekv.v1.Prefill")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"seconds to wait for the answer (default {DEFAULT_TIMEOUT_S:g})")
    return parser


def add_health_parser(sub) -> None:
    health = sub.add_parser("health", help="exit 0 if a service's gRPC health check says SERVING")
    add_health_arguments(health)
    health.set_defaults(func=cmd_health)


def cmd_health(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise ValueError(f"--timeout: must be positive, got {args.timeout:g}")
    serving, line = check(args.address or default_address(), args.service, args.timeout)
    print(f"rekv health: {line}", file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


def main(argv: list[str] | None = None) -> int:
    parser = add_health_arguments(argparse.ArgumentParser(
        prog="python -m rekv_cli.health", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    try:
        return cmd_health(args)
    except ValueError as exc:
        print(f"rekv health: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
