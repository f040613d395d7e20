"""The two services' calls as plain values: what `wire_convert` reads from protobuf and writes back.

A router's `GenerateCall` arrives at the decode worker; the decode worker's `HandoffCall` (with its
`DecodeOffer`) at the prefill worker, whose `HandoffReply` goes back (and, ahead of any, its
`ConnectCall`, answered with `Connected`); the decode worker's
`HandoffReport` ends the router's stream in the summary with a `Completion`. Fields the caller
controls were checked for form by `wire_convert` (an `InvalidArgument` names the field); limits
that depend on a worker's settings are checked by that worker.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from rekv_core.handoff import Action, Schedule, WireBytes
from rekv_core.model.sampling import SamplingParams
from rekv_core.plan.calibration import DecodeCosts
from rekv_core.plan.planner import Ranked


@dataclass(frozen=True)
class GenerateCall:
    request_id: str
    text: str | None  # exactly one of text and token_ids is set
    token_ids: list[int] | None
    max_new_tokens: int
    sampling: SamplingParams
    forced_action: Action | None  # None: the planner chooses
    stop_at_eos: bool = True
    forced_schedule: Schedule | None = None  # None: the workers' default


MAX_PLANNED_TRANSFERS = 4096  # the most transfer ids one offer names


@dataclass(frozen=True)
class DecodeOffer:
    """Who the decode worker is and where it listens, beside its costs (`DecodeCosts`)."""

    model: str
    num_layers: int
    address: str  # its data-plane listener
    codecs: tuple[str, ...]  # prefix codecs it accepts
    queue_depth: int
    handoffs_in_flight: int
    costs: DecodeCosts
    accepts_streamed: bool = True  # it takes a streamed handoff
    accepts_pipelined: bool = True  # it takes a pipelined one (`Schedule.pipelined`)
    chunk_tokens: int = 0  # the boundary chunk size it asks for
    computing: int = 0  # its other requests computing now (generating, or running a suffix)
    backlog_ms: float = 0.0  # compute committed to it by planned handoffs, not yet done
    # the handoffs whose plan it has seen: those backlog_ms counts, and those ended just now
    planned: Collection[str] = frozenset()


@dataclass(frozen=True)
class HandoffCall:
    request_id: str
    transfer_id: str  # the data plane's request id, unique per handoff
    token_ids: list[int]
    offer: DecodeOffer
    forced_action: Action | None
    handoff_key: bytes = b""  # drawn by the decode worker; seals every data-plane message
    encrypt: bool = False  # encrypt every data-plane buffer too (`seal.encrypt`)
    forced_schedule: Schedule | None = None  # None: the prefill side decides from the offer


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
class HandoffReply:
    action: Action
    predicted_ms: float  # what the planner expects, evidence included
    model_ms: float  # eq. 9's prediction of that action
    prefill_ms: float
    q_ms: float  # encoding the prefix
    send_ms: float  # first message posted to last byte gone
    bytes: WireBytes
    link_gbps: float  # the link rate the planner used
    candidates: list[Ranked] = field(default_factory=list)
    queue_depth: int = 0  # the prefill worker's other handoffs, waiting or running, as it replied
    schedule: Schedule = field(default_factory=Schedule)  # how the handoff was sent


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
    schedule: Schedule | None = None  # how the handoff was sent (None: no handoff)

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
