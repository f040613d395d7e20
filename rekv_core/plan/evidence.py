"""The values the two sides exchange about costs and past handoffs: no arithmetic, only data.

- `Measured`: recent handoffs of one action (median time, median prompt length, count);
- `Evidence`: what the decode side's recent handoffs say, over a link like today's: by action
  kind, measured over modelled time; by action, its own measurements, apart for layer and token
  order (`measured`, `measured_pipelined`);
- `CodecCost`: one codec's encode (prefill side) and restore (decode side) cost per MiB of BF16 KV;
- `DecodeCosts`: the decode worker's side of the cost model for one request, and its evidence,
  as it offers them (the link estimate is None, not 0, until the decode side has measured it;
  so is the suffix scale until it has timed a suffix);
- `HandoffObservation`: one completed handoff as the decode worker saw it, which its calibration
  learns from.

These cross the control plane (`services.wire_convert`) and are what the services may hold of the
planning package; the arithmetic stays behind the connector (`rekv_core.connector`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rekv_core.handoff import Action, ActionKind, HandoffTimings, WireBytes

MAX_PLANNED_TRANSFERS = 4096  # the most transfer ids one offer names (`DecodeOffer.planned`)
# The protocol's bounds on `DecodeCosts.suffix_scale`: a measured suffix this many times (or this
# small a fraction of) its profile says the profile is wrong, and the prefill side must not
# multiply its own compute figures by more; the decode side offers its scale clamped to them.
MAX_SUFFIX_SCALE = 100.0
MIN_SUFFIX_SCALE = 0.01


def offered_suffix_scale(measured: float) -> float:
    """`measured` (a suffix's time over its profile's) within the protocol's bounds."""
    return min(MAX_SUFFIX_SCALE, max(MIN_SUFFIX_SCALE, measured))


@dataclass(frozen=True)
class Measured:
    """Recent handoffs of one action: median time, median prompt length, how many."""

    median_ms: float
    prompt_len: int
    count: int


@dataclass(frozen=True)
class Evidence:
    """What the decode side's recent handoffs say, over a link like today's."""

    over_model: Mapping[ActionKind, float] = field(default_factory=dict)  # by kind
    measured: Mapping[Action, Measured] = field(default_factory=dict)  # this length's bucket
    # the same of the handoffs sent pipelined (token order)
    measured_pipelined: Mapping[Action, Measured] = field(default_factory=dict)


@dataclass(frozen=True)
class CodecCost:
    """One codec's cost per MiB of BF16 KV (a layer's K and V at this prompt length)."""

    encode_ms_per_mib: float = 0.0  # α: encoding, on the prefill side
    restore_ms_per_mib: float = 0.0  # decoding into the cache, on the decode side


FREE = CodecCost()


@dataclass(frozen=True)
class DecodeCosts:
    """The decode worker's side of the cost model for one request, and its evidence."""

    suffix_ms_per_layer: float  # γ at this prompt length under the worker's load, now
    restore_ms_per_mib: Mapping[str, float]  # by codec, per MiB of BF16 KV
    join_ms: float
    message_ms: float
    link_gbps: float | None  # the link as this worker measured it; None: no sample yet
    evidence: Evidence = field(default_factory=Evidence)
    # measured suffix time over the profile's, within [MIN_SUFFIX_SCALE, MAX_SUFFIX_SCALE];
    # None: not yet
    suffix_scale: float | None = None


@dataclass(frozen=True)
class HandoffObservation:
    """One completed handoff, as the decode worker saw it."""

    action: Action
    prompt_len: int
    load: float  # requests computing on the decode worker while its suffix ran (mean), it included
    timings: HandoffTimings  # the receiver's; they begin before the remote prefill
    wire: WireBytes  # received
    link_sample: tuple[int, float] | None  # (bytes, seconds), see `HandoffResult`
    prefill_s: float  # the prefill worker's compute, from its response
    modelled_ms: float  # the cost model's prediction of this action, from the prefill worker
    streamed: bool = False  # sent from inside the prefill (its prefix came before the boundary)
    pipelined: bool = False  # ... in token order

    @property
    def handoff_s(self) -> float:
        """The seed's handoff time: from the end of the prefill to the complete cache."""
        return max(0.0, self.timings.total_s - self.prefill_s)

    @property
    def boundary_s(self) -> float:
        """H from the end of the prefill."""
        return max(0.0, self.timings.h_s - self.prefill_s)
