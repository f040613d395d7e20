"""Settings of the two services: one typed object, from flags and the environment, checked once.

`ServiceSettings` extends the core's `RuntimeSettings` (model, device, dtype, torch threads). Every
field can be set with a flag (`--max-prompt-tokens 4096`) or an environment variable
(`REKV_MAX_PROMPT_TOKENS=4096`, read through `rekv_core.env`); a flag wins.
`ServiceSettings.from_args(role, argv)` parses and validates; an invalid value raises `ValueError`
naming the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from rekv_core import env
from rekv_core.codecs import codec_names
from rekv_core.model.blocks import chunk_bounds
from rekv_core.connector import DEFAULT_QUALITY, QUALITIES
from rekv_core.engine.prefill_scheduler import DEFAULT_CATCH_UP, DEFAULT_TOKEN_BUDGET
from rekv_core.settings import RuntimeSettings
from rekv_core.transport import TRANSPORTS

ROLES = ("prefill", "decode")
DNS_SCHEME = "dns:///"
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# The decode worker recomputes the suffix while its UCX loop thread waits for the prefix, and in
# ucxx's threaded progress mode that wait busy-polls; at nice 19 the loop yields the core to the
# recompute, while the kernel's socket buffers take the eagerly sent prefix in (CPU workers:
# `UcxEngine(host_eager=True)`) and the loop catches up once the recompute is done
# (bench/results/link-smollm2-135m.md). The prefill worker has nothing to run beside its sends.
DEFAULT_NICE = {"prefill": 0, "decode": 19}
HANDOFF_FAILURE_POLICIES = ("recompute", "fail")
DECODE_PATHS = ("batched", "per_request")
FAULTS = ("hold_negotiation", "hold_boundary", "hold_prefix", "flip_bit", "flip_late_bit",
          "flip_residual", "forge_checksum", "replay", "coarse_codec")
BY_REQUEST = "by_request"


def split_host_port(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"prefill_address: {what} {address!r} is not host:port")
    return host.strip("[]"), int(port)


def parse_prefill_address(text: str) -> tuple[str, list[str]]:
    """("dns", ["name:port"]) or ("static", ["host:port", ...]); ValueError naming the field."""
    text = text.strip()
    if not text:
        raise ValueError("prefill_address: required for the decode service (host:port, a "
                         "comma-separated list, or dns:///name:port)")
    if text.startswith(DNS_SCHEME):
        target = text[len(DNS_SCHEME):]
        split_host_port(target, "the DNS target")
        return "dns", [target]
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for address in addresses:
        split_host_port(address, "the address")
    return "static", addresses


@dataclass(frozen=True, kw_only=True)
class ServiceSettings(RuntimeSettings):
    role: str
    host: str = "127.0.0.1"  # where gRPC, metrics and UCX listen
    grpc_port: int = 0  # 0: pick a free port (printed and written to --ready-file)
    metrics_port: int = 0
    transport: str = "ucx"  # the data plane: ucx, or inprocess (both services in one process)
    ucx_port: int = 0  # decode only: where its data-plane listener binds
    # decode only: where the advertised UCX listener is reached (default: `host`); set it when
    # `host` is a wildcard such as 0.0.0.0, e.g. to the pod's IP
    advertise_host: str = ""
    # decode only: the prefill pool's gRPC: host:port, a comma-separated list, or dns:///name:port
    # (every address the name resolves to, resolved again every prefill_refresh_s)
    prefill_address: str = ""
    prefill_refresh_s: float = 5.0
    # decode only: how long a prefill replica that refused this worker's model fingerprint
    # (another model: FAILED_PRECONDITION) is left out, seconds; then it is tried again
    prefill_incompatible_s: float = 60.0
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 512  # the limit on a request's max_new_tokens
    # prefill: handoffs computed at once; decode: handoffs received at once (the streams decoding
    # are bounded by max_batch); more wait in the queue
    max_concurrent: int = 4
    # decode: the engine (rekv_core.engine): the streams one batched step decodes at most (more
    # wait to join); the inter-token latency budget its prefill-like chunks (suffix, token-only,
    # recompute) are sized to, ms (0: ITL_BUDGET_FACTOR x the single-stream step measured at
    # start); and the decode path: batched, or per_request (each request decodes alone on a thread
    # of its own, as before the engine: kept for the comparison bench)
    max_batch: int = 32
    itl_budget_ms: float = 0.0
    decode_path: str = "batched"
    # Admission control: calls beyond max_concurrent + max_queue, or whose handoff would take
    # the memory held for handoffs in flight (KV, boundary, buffers) past max_inflight_bytes,
    # end at once with RESOURCE_EXHAUSTED
    max_queue: int = 64
    max_inflight_bytes: int = 2 << 30
    # the codecs offered: every registered one; the planner keeps those the policy passed
    codecs: tuple[str, ...] = tuple(codec_names())
    pace_gbps: float = 0.0  # prefill: hold UCX sends to this rate (link emulation); 0: off
    # Linux nice of the thread that drives UCX (it busy-polls while waiting for data); -1: the
    # role's default (DEFAULT_NICE)
    ucx_loop_nice: int = -1
    profile: str = ""  # `rekv profile` output; empty: measure a short profile at start
    policy: str = ""  # `rekv gate` output; empty: the policy shipped for the model, if any
    handoff_timeout_s: float = 60.0  # longest wait for one data-plane message
    # prefill: send each handoff from inside the prefill, which stops at the cut, when the decode
    # worker takes it (else the seed's schedule: a full prefill, then the handoff)
    stream_handoff: bool = True
    # prefill, streamed: let the planner send an interior cut in token order where it predicts
    # less (the prefill runs in the boundary's chunks, each sent as it passes the cut, and the
    # decode worker's layers run on it while the next computes: `Order.TOKENS`)
    pipeline_prefill: bool = True
    # prefill: let the planner rank KVPR's token splits (h_c of the first l tokens, the suffix
    # layers' KV of the rest) where the decode worker takes them
    token_split: bool = True
    # prefill: let the planner rank Lynx's progressive streams of int8 actions (every layer's
    # anchor before any residual; the decode worker drafts on the anchors) where the decode
    # worker takes them
    lynx_streams: bool = True
    # prefill: let the planner rank KVPR's per-layer form (each sent layer's input rows for the
    # first l tokens, its KV of the rest) where the decode worker takes it
    layer_split: bool = True
    # prefill: the scheduler's rows per tick (every streamed handoff in layer order is batched
    # with the others in flight, at most this many prompt rows per forward; the oldest prompt
    # always gets a block, then the least work left first); 0: one prefill at a time
    prefill_token_budget: int = DEFAULT_TOKEN_BUDGET
    # prefill: layers a short prompt arriving after others runs alone to reach their layer and
    # share their GEMMs from there on (a prompt waits at most this many ticks in all); 0: off
    prefill_catch_up_layers: int = DEFAULT_CATCH_UP
    # both: each prompt's batched prefill (prefill) and each stream's decode steps (decode) bit
    # for bit its lone one (the same kernels per prompt or row, no GEMM shared between them):
    # slower, for token-for-token agreement with the single-process reference under any batch
    batch_invariant: bool = False
    # decode: the boundary's chunk size it asks for (a multiple of 256; 0: one message); it starts
    # its layers on each chunk as it lands
    boundary_chunk_tokens: int = 256
    # decode: when a handoff fails, recompute the prompt here ("recompute": the request still
    # completes) or end the call with UNAVAILABLE ("fail")
    on_handoff_failure: str = "recompute"
    # decode: the quality setting of a request that sets none: lossless (only actions that
    # reproduce the reference's cache bit for bit) or gated (also the lossy actions the policy
    # passed); see `rekv_core.plan.quality`
    quality: str = DEFAULT_QUALITY.value
    # prefill, for the reliability tests only (logged at start): inject this fault into every
    # handoff, or with by_request the one its request id names (services/prefill/faults.py);
    # hold_* points hold it for fault_hold_s
    fault_inject: str = ""
    fault_hold_s: float = 30.0
    # decode: the live quality canary (services/decode/canary.py): the fraction of lossy handoffs
    # checked against the prompt recomputed here while the worker is idle (0: off), the checks
    # per action their top-1 agreement is judged over, and the greedy tokens compared
    canary_fraction: float = 0.02
    canary_window: int = 20
    canary_continuation: int = 8
    shutdown_grace_s: float = 10.0  # in-flight requests may finish within this on SIGTERM
    ready_file: str = ""  # when set: JSON with the bound ports, written once serving
    # Mutual TLS on the gRPC planes (PEM files): this worker's certificate and key, and the CA
    # its peers' certificates must chain to. Required unless `plaintext` is set explicitly.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_server_name: str = ""  # decode: the name prefill certificates carry (default: the address)
    plaintext: bool = False  # serve and call without TLS (logged at start); only on trusted links
    # decode: have every data-plane buffer encrypted (AES-256-GCM), for links others can read;
    # every message is authenticated either way
    encrypt_data_plane: bool = False
    health_port: int = 0  # with TLS: a plaintext port serving only grpc.health.v1 (for probes)
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        super().__post_init__()  # model, device, dtype, torch threads
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {ROLES}, got {self.role!r}")
        for name in ("grpc_port", "metrics_port", "ucx_port", "health_port"):
            port = getattr(self, name)
            if not 0 <= port < 65536:
                raise ValueError(f"{name}: must lie in [0, 65535], got {port}")
        for name in ("max_prompt_tokens", "max_new_tokens", "max_concurrent",
                     "max_inflight_bytes", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        unknown = [c for c in self.codecs if c not in codec_names()]
        if unknown or not self.codecs:
            raise ValueError(f"codecs: must be a non-empty subset of {codec_names()}, "
                             f"got {list(self.codecs)}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: must be one of {', '.join(TRANSPORTS)}, got "
                             f"{self.transport!r}")
        if self.prefill_token_budget < 0:
            raise ValueError(f"prefill_token_budget: must be >= 0 (0: no scheduler), got "
                             f"{self.prefill_token_budget}")
        if self.prefill_catch_up_layers < 0:
            raise ValueError(f"prefill_catch_up_layers: must be >= 0 (0: off), got "
                             f"{self.prefill_catch_up_layers}")
        if self.pace_gbps < 0:
            raise ValueError(f"pace_gbps: must be >= 0, got {self.pace_gbps}")
        if not -1 <= self.ucx_loop_nice <= 19:
            raise ValueError(f"ucx_loop_nice: must lie in [0, 19] (or -1: the role's "
                             f"default), got {self.ucx_loop_nice}")
        if self.role == "decode":
            parse_prefill_address(self.prefill_address)
            if self.host in WILDCARD_HOSTS and not self.advertise_host:
                raise ValueError(f"advertise_host: required when host is {self.host!r}: the "
                                 f"address prefill workers reach this worker's UCX listener at")
        if not self.plaintext:
            missing = [n for n in ("tls_cert", "tls_key", "tls_ca") if not getattr(self, n)]
            if missing:
                raise ValueError(f"{missing[0]}: required for mutual TLS (with "
                                 f"{', '.join(missing[1:]) or 'the other two files'}); set "
                                 f"plaintext explicitly to serve without TLS")
        if not (self.itl_budget_ms >= 0 and math.isfinite(self.itl_budget_ms)):
            raise ValueError(f"itl_budget_ms: must be a finite number >= 0 (0: measured at "
                             f"start), got {self.itl_budget_ms}")
        if self.decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path: must be one of {DECODE_PATHS}, got "
                             f"{self.decode_path!r}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue: must be >= 0, got {self.max_queue}")
        if self.on_handoff_failure not in HANDOFF_FAILURE_POLICIES:
            raise ValueError(f"on_handoff_failure: must be one of {HANDOFF_FAILURE_POLICIES}, "
                             f"got {self.on_handoff_failure!r}")
        if self.quality not in QUALITIES:
            raise ValueError(f"quality: must be one of {QUALITIES}, got {self.quality!r}")
        if self.fault_inject not in ("", BY_REQUEST, *FAULTS):
            raise ValueError(f"fault_inject: must be one of {(BY_REQUEST, *FAULTS)} (or "
                             f"empty), got {self.fault_inject!r}")
        if self.handoff_timeout_s <= 0:
            raise ValueError(f"handoff_timeout_s: must be > 0, got {self.handoff_timeout_s}")
        if not 0 <= self.canary_fraction <= 1:
            raise ValueError(f"canary_fraction: must lie in [0, 1], got {self.canary_fraction}")
        if self.canary_window < 1:
            raise ValueError(f"canary_window: must be >= 1, got {self.canary_window}")
        if self.canary_continuation < 0:
            raise ValueError(f"canary_continuation: must be >= 0, got "
                             f"{self.canary_continuation}")
        if self.fault_hold_s < 0:
            raise ValueError(f"fault_hold_s: must be >= 0, got {self.fault_hold_s}")
        chunk_bounds(1, self.boundary_chunk_tokens)  # ValueError naming boundary_chunk_tokens
        if self.prefill_refresh_s <= 0:
            raise ValueError(f"prefill_refresh_s: must be > 0, got {self.prefill_refresh_s}")
        if self.prefill_incompatible_s < 0:
            raise ValueError(f"prefill_incompatible_s: must be >= 0, got "
                             f"{self.prefill_incompatible_s}")

    @property
    def loop_nice(self) -> int:
        return DEFAULT_NICE[self.role] if self.ucx_loop_nice < 0 else self.ucx_loop_nice

    @classmethod
    def parser(cls, role: str) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=f"rekv serve {role}",
                                         description=f"Run the {role} service.")
        for f in dataclasses.fields(cls):
            if f.name == "role":
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            env = "REKV_" + f.name.upper()
            parser.add_argument("--" + f.name.replace("_", "-"), default=None,
                                help=f"(env {env}; default {_show(default)})")
        return parser

    @classmethod
    def from_args(cls, role: str, argv: list[str] | None = None) -> ServiceSettings:
        args = cls.parser(role).parse_args(argv)
        values = {}
        for f in dataclasses.fields(cls):
            if f.name == "role":
                continue
            raw = getattr(args, f.name)
            if raw is None:
                raw = env.get("REKV_" + f.name.upper())
            if raw is not None:
                values[f.name] = _convert(f, raw)
        return cls(role=role, **values)


def _show(value) -> str:
    return ",".join(value) if isinstance(value, tuple) else repr(value)


def _convert(f: dataclasses.Field, raw: str):
    kind = type(f.default) if f.default is not dataclasses.MISSING else tuple
    try:
        if kind is tuple:
            return tuple(item.strip() for item in raw.split(",") if item.strip())
        if kind is bool:
            return raw.lower() in ("1", "true", "yes")
        return kind(raw)
    except ValueError:
        raise ValueError(f"{f.name}: cannot read {raw!r} as {kind.__name__}") from None
