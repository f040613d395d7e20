"""What the two connectors say to each other, as plain values (the control plane carries them).

A decode worker's `HandoffCall` (with its `DecodeOffer`: who it is, where it listens, its costs
and load) goes to a prefill worker, whose `HandoffReply` comes back once every byte has left.
`services.wire_convert` turns them into protobuf and back, checking the form of every field (a
`BadRequest` names the field); the connectors check what depends on their own settings.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from rekv_core.handoff import Action, Delivery, Sealing, WireBytes
from rekv_core.plan.evidence import DecodeCosts
from rekv_core.plan.quality import DEFAULT_QUALITY, Quality


class BadRequest(ValueError):
    """Input from the caller that cannot be served; the message names the field."""


class Busy(RuntimeError):
    """Beyond what the worker takes now; asking again later may succeed."""


class ModelMismatch(RuntimeError):
    """The offer comes from a worker of another model (`handoff.fingerprint`): no cache this
    worker computes is valid there. Not worth asking this worker again."""

    def __init__(self, offered: str, served: str):
        super().__init__(f"offer.model_fingerprint: the decode worker runs model {offered}, this "
                         f"prefill worker {served}: their caches are not interchangeable")
        self.offered, self.served = offered, served


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
    accepts_pipelined: bool = True  # it takes one in token order (`Order.TOKENS`)
    accepts_token_split: bool = True  # it takes KVPR's token split (`Action.split`)
    accepts_progressive: bool = True  # it takes Lynx's streams (`Action.progressive`)
    accepts_layer_split: bool = True  # it takes KVPR's per-layer form (`Action.layer_split`)
    chunk_tokens: int = 0  # the boundary chunk size it asks for
    computing: int = 0  # its other requests computing now (generating, or running a suffix)
    backlog_ms: float = 0.0  # compute committed to it by planned handoffs, not yet done
    # the handoffs whose plan it has seen: those backlog_ms counts, and those ended just now
    planned: Collection[str] = frozenset()
    fingerprint: str = ""  # its model's (`handoff.fingerprint`, hex); the prefill side's must match
    # its decode engine: the running batch, the ITL budget (ms; 0: no engine) and the step of that
    # batch (ms), which stretch a suffix computed there (`plan.stretch.interleaved_stretch`)
    running_batch: int = 0
    itl_budget_ms: float = 0.0
    decode_step_ms: float = 0.0


@dataclass(frozen=True)
class HandoffCall:
    request_id: str
    transfer_id: str  # the data plane's request id, unique per handoff
    token_ids: Sequence[int]
    offer: DecodeOffer
    forced_action: Action | None = None  # None: the planner chooses
    sealing: Sealing = Sealing()  # the key the decode worker drew for this handoff
    forced_delivery: Delivery | None = None  # None: the prefill side decides from the offer
    quality: Quality = DEFAULT_QUALITY  # the actions the planner may choose (resolved, never unset)


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
    candidates: list = field(default_factory=list)  # `planner.Ranked`, best first (prefill side)
    queue_depth: int = 0  # the prefill worker's other handoffs, waiting or running, as it replied
    delivery: Delivery = field(default_factory=Delivery)  # how the handoff was sent
