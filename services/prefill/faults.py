"""Fault injection for the reliability tests: a fault put into every handoff this worker sends.

Off unless `fault_inject` is set (never in production; the service logs a warning at start) to
one of the faults below, put into every handoff, or to `by_request`: each handoff whose request
id starts with a fault's name and a slash (`hold_boundary/req-1`) gets that fault, the others
none, so that one process serves every kind of fault in turn.
`Faults.for_handoff(request_id, transfer, cut, sender)` gives one handoff's `SendHooks`:

- `hold_negotiation`, `hold_boundary`, `hold_prefix`: hold the handoff for `fault_hold_s` seconds
  when the call is in and its action chosen (nothing sent: `at_negotiation`), once the boundary
  (or the token ids) has left, or once half of the prefix layers have left (cut >= 2;
  pipelined: their rows of the first chunk), after
  logging `fault injection: holding request=<id> transfer=<id> at <point>`, so that a test can
  kill the process there or act on the transfer meanwhile. The hold ends early when the transfer
  is cancelled.
- `flip_bit`: flip one bit of the first message with a payload (the boundary, the token ids or
  layer 0) after it was sealed: what a bad link or a bad DIMM would do; `flip_late_bit`: the
  same in the last prefix layer c−1 (pipelined: its first rows), which the decode side can
  recover by recomputing layers 0..c−1 alone (cut >= 1); `flip_residual`: the same in the first
  residual of Lynx's streams (`residual.0`), which arrives after the decode side has sent its first
  token and drafted on the anchors.
- `forge_checksum`: change 5 bytes in the middle of the first payload of 8 bytes or more after
  it was sealed so that its checksum still holds (CRC32, on the host: XOR the CRC's generator
  polynomial, whose multiples leave it unchanged; wsum64, on a device: two words changed by
  amounts that cancel in its weighted sum): what a party on the path without the key would do,
  which only the seal's MAC over the bytes catches.
- `replay`: send, in place of this handoff's boundary, the boundary of the previous handoff this
  worker sent, re-addressed to this handoff's request and place (a replay by someone who can
  rewrite frames but not forge MACs); with no previous handoff it is sent unchanged.
- `coarse_codec`: a broken codec setting: the prefix codec encodes every layer's K and V rounded
  to five levels per tensor first (`decision_for`), so the handoff arrives sealed, checksummed and
  valid but far from the prefill's cache: what the quality canary must flag.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from rekv_core.codecs import Codec, EncodeContext, EncodedKV
from rekv_core.codecs.checksum import default_algorithm
from rekv_core.connector import Decision
from rekv_core.handoff.transfer import Transfer
from rekv_core.handoff.wire import BOUNDARY, TOKENS, layer_name, layer_rows_name, residual_name
from rekv_core.kernels.checksum_reference import WEIGHT_MODULUS
from rekv_core.transport import Message, TransportSender
from services.settings import BY_REQUEST, FAULTS

log = logging.getLogger("rekv.prefill.faults")
CRC32_GENERATOR = 0x1DB710641  # reflected, x^32 included: XOR-ing it anywhere keeps a CRC32
FORGED_MIN_BYTES = 8


class Faults:
    def __init__(self, fault: str, hold_s: float):
        self.fault, self.hold_s = fault, hold_s
        self._recorded: Message | None = None
        self._lock = threading.Lock()
        if fault:
            log.warning("fault injection ON: %s in every handoff (tests only)", fault)

    def fault_for(self, request_id: str) -> str:
        if self.fault != BY_REQUEST:
            return self.fault
        name = request_id.split("/", 1)[0]
        return name if name in FAULTS and "/" in request_id else ""

    def at_negotiation(self, request_id: str, transfer: Transfer) -> None:
        if self.fault_for(request_id) == "hold_negotiation":
            self.hold(request_id, transfer, "negotiation")

    def decision_for(self, request_id: str, decision: Decision) -> Decision:
        """The decision to send: with `coarse_codec`, its plan's codec coarsened (logged)."""
        if not self.fault or self.fault_for(request_id) != "coarse_codec":
            return decision
        log.warning("fault injection: coarsening %s's prefix codec %s", request_id,
                    decision.plan.codec.name)
        plan = dataclasses.replace(decision.plan, codec=CoarseCodec(decision.plan.codec))
        return dataclasses.replace(decision, plan=plan)

    def for_handoff(self, request_id: str, transfer: Transfer, cut: int,
                    sender: TransportSender) -> _HandoffFaults | None:
        fault = self.fault_for(request_id) if self.fault else ""
        return _HandoffFaults(self, fault, request_id, transfer, cut, sender) if self.fault \
            else None

    def hold(self, request_id: str, transfer: Transfer, point: str) -> None:
        """Hold the transfer at `point` for `hold_s` (logged)."""
        log.warning("fault injection: holding request=%s transfer=%s at %s", request_id,
                    transfer.transfer_id, point)
        transfer.hold(self.hold_s)

    def replayed(self, message: Message, replay: bool) -> Message:
        """Record this boundary; with `replay`, send the one recorded before it instead."""
        with self._lock:
            recorded, self._recorded = self._recorded, message
        if not replay or recorded is None:
            return message
        log.warning("fault injection: replaying %s of transfer %s as transfer %s", recorded.name,
                    recorded.request_id, message.request_id)
        return dataclasses.replace(recorded, request_id=message.request_id, seq=message.seq)


class _HandoffFaults:
    """One handoff's `SendHooks`."""

    def __init__(self, faults: Faults, fault: str, request_id: str, transfer: Transfer, cut: int,
                 sender: TransportSender):
        self.faults, self.fault, self.request_id, self.transfer = faults, fault, request_id, \
            transfer
        self.cut, self.sender = cut, sender
        self.flipped = self.forged = False

    def before_send(self, message: Message) -> Message:
        fault = self.fault
        late = (fault == "flip_late_bit" and self.cut >= 1 and message.name in (
            layer_name(self.cut - 1), layer_rows_name(self.cut - 1, 0))) or (
            fault == "flip_residual" and message.name == residual_name(0))
        if (late or fault == "flip_bit") and message.buffers and not self.flipped:
            self.flipped = True
            name, buffer = next(iter(message.buffers.items()))
            flipped = buffer.clone()
            flipped[len(flipped) // 2] ^= 0x10
            log.warning("fault injection: flipped a bit of %s/%s of transfer %s", message.name,
                        name, message.request_id)
            return dataclasses.replace(message, buffers={**message.buffers, name: flipped})
        if fault == "forge_checksum" and not self.forged:
            for name, buffer in message.buffers.items():
                if buffer.numel() >= FORGED_MIN_BYTES:
                    self.forged = True
                    log.warning("fault injection: forged %s/%s of transfer %s, its checksum "
                                "kept", message.name, name, message.request_id)
                    forged = forged_keeping_checksum(buffer, default_algorithm(buffer.device))
                    return dataclasses.replace(message, buffers={**message.buffers,
                                                                 name: forged})
        if message.name in (BOUNDARY, TOKENS):
            return self.faults.replayed(message, fault == "replay")
        return message

    def after_send(self, name: str) -> None:
        fault = self.fault
        if (fault == "hold_boundary" and name in (BOUNDARY, TOKENS)) or (
                fault == "hold_prefix" and self.cut >= 2 and name in (
                    layer_name(self.cut // 2 - 1), layer_rows_name(self.cut // 2 - 1, 0))):
            self.sender.flush(self.transfer.transfer_id, self.transfer.wait_s())  # on the wire
            self._hold(name)

    def _hold(self, name: str) -> None:
        point = "boundary" if name in (BOUNDARY, TOKENS) else "prefix"
        self.faults.hold(self.request_id, self.transfer, point)


def coarsened(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to the five levels -m, -m/2, 0, m/2, m (m: its largest magnitude)."""
    step = t.abs().amax().float().clamp_min(torch.finfo(torch.float32).tiny) / 2
    return ((t.float() / step).round() * step).to(t.dtype)


class CoarseCodec:
    """`inner`, encoding coarsened K and V (`coarse_codec`); everything else is `inner`'s."""

    def __init__(self, inner: Codec):
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def encode(self, k: torch.Tensor, v: torch.Tensor, checksums: bool = True,
               context: EncodeContext = EncodeContext()) -> EncodedKV:
        return self._inner.encode(coarsened(k), coarsened(v), checksums, context)
def forged_keeping_checksum(buffer: torch.Tensor, algorithm: str) -> torch.Tensor:
    """A copy of a 1-D uint8 buffer of at least 8 bytes with 5 to 8 bytes changed and its
    checksum under `algorithm` (crc32 or wsum64) unchanged."""
    forged = buffer.clone()
    middle = forged.numel() // 2 // 4 * 4 - 4 if forged.numel() >= 12 else 0
    if algorithm == "crc32":
        pattern = torch.tensor(list(CRC32_GENERATOR.to_bytes(5, "little")), dtype=torch.uint8)
        forged[middle:middle + 5] ^= pattern
    else:  # wsum64: words j and j + 1 changed by their weights crossed over: the sum stays
        words, j = forged[middle:middle + 8].view(torch.int32), middle // 4
        words[1] += j % WEIGHT_MODULUS + 1
        words[0] -= (j + 1) % WEIGHT_MODULUS + 1
    return forged
