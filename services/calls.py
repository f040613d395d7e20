"""The router's and the services' own calls as plain values: what `wire_convert` reads from
protobuf and writes back.

A router's `GenerateCall` arrives at the decode worker, whose stream ends with a `Completion` (its
`HandoffReport` says how the cache was obtained). Ahead of any handoff, a decode worker's
`ConnectCall` asks a prefill worker to connect its data plane (answered with `Connected`). The
handoff's own calls are the connectors' (`rekv_core.connector.calls`). Fields the caller controls
were checked for form by `wire_convert` (an `InvalidArgument` names the field); limits that depend
on a worker's settings are checked by that worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from rekv_core.handoff import Action, Delivery, WireBytes
from rekv_core.model.sampling import SamplingParams
from rekv_core.connector import DEFAULT_QUALITY, Quality


@dataclass(frozen=True)
class GenerateCall:
    request_id: str
    text: str | None  # exactly one of text and token_ids is set
    token_ids: list[int] | None
    max_new_tokens: int
    sampling: SamplingParams
    forced_action: Action | None  # None: the planner chooses
    stop_at_eos: bool = True
    forced_delivery: Delivery | None = None  # None: the workers' default
    quality: Quality | None = None  # None: the deployment's default (`settings.quality`)


@dataclass(frozen=True)
class ConnectCall:
    """A decode worker asks a prefill worker to connect its data plane ahead (and to probe)."""

    address: str  # the decode worker's data-plane listener
    probe_id: str | None = None  # the probe's data-plane request id; None: no probe
    probe_key: bytes | None = None  # seals the probe's messages


@dataclass(frozen=True)
class Connected:
    connected_now: bool  # False: the connection was already held
    connect_s: float = 0.0
    probe_bytes: int = 0
    probe_s: float = 0.0


@dataclass(frozen=True)
class HandoffReport:
    """How the decode worker got its cache, for the summary (times in ms)."""

    action: Action
    bytes: WireBytes
    predicted_ms: float = 0.0
    measured_ms: float = 0.0  # from the end of the prefill to the complete cache
    prefill_ms: float = 0.0
    q_ms: float = 0.0
    h_ms: float = 0.0
    x_ms: float = 0.0
    r_ms: float = 0.0
    j_ms: float = 0.0
    fallback_reason: str = ""  # set when the handoff failed and the prompt was recomputed here
    fallback_scope: str = ""  # with a fallback: "partial" (layers 0..m) or "full"
    recomputed_layers: int = 0  # the layers the fallback recomputed
    delivery: Delivery | None = None  # how the handoff was sent (None: no handoff)
    send_ms: float = 0.0  # the prefill side's first message posted to last byte gone
    prefill_link_gbps: float = 0.0  # the link rate the prefill side planned with (0: no reply)

    @property
    def fallback(self) -> bool:
        return bool(self.fallback_reason)


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str  # "length" or "eos"
    ttft_ms: float
    request_ms: float
    handoff: HandoffReport
    quality: Quality = DEFAULT_QUALITY  # the setting the handoff was planned under
