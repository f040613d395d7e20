"""The decode side of a handoff: rebuild the complete cache and the first-token logits.

`receive_handoff(model, transport, transfer, sealing, receiving)` reads one handoff (see `wire`)
from the request `transfer.transfer_id`, opened on `transport`, and always ends it: `close` after
success, `abort` after any failure. Its plan (`HandoffPlan`) arrives first, in-band. Receive modes
(`ReceiveMode`, the receiver's own choice, `Receiving.mode`):

- `overlap` (eq. 9): a second thread reads every message (`incoming.Incoming`): it decodes the
  prefix layers into the cache and hands over the boundary's chunks; as soon as the first chunk
  of h_c is in, layers c..L−1 run on this thread for its rows, then for the next chunk's
  (`run_layers_chunk`, bit-identical to one unchunked run); both join before the result. On CUDA
  the reading thread copies and dequantizes on its own stream, and the join makes the compute
  stream wait on that stream's event, so the two paths overlap on the device as well. That stream
  starts after the cache's allocation and zeroing on the compute stream, and waits for each
  message's `ready` event before reading its buffers (`rekv_core.streams`); so does the compute
  stream before it reads the boundary or the head.
- `sequential` (eq. 8): receive and decode the whole prefix, then run the suffix.

Lynx's streams (`Action.progressive`) always overlap: the result comes back once every anchor
(with the boundary's suffix run, or the head) is in, its cache's prefix at anchor precision, and
`HandoffResult.residuals` (`residuals.PendingResiduals`) reading on for the residuals, which end the
request; the caller drafts on that cache and verifies on the full one (`handoff.progressive`).

The same reading serves a streamed handoff (`Delivery.streamed`), whose prefix comes first, and a
pipelined one (`Order.TOKENS`), whose prefix comes in the boundary's row chunks, each chunk's
after its boundary rows. `Receiving.work`, when given, is told what the plan gives this side to
compute and when it computes (`ComputeObserver`: the decode side's load book counts it). This
side's compute (the suffix, a token-only prefill) runs in pieces, each in a turn of
`Receiving.turns` (`rekv_core.model.turns`: a decode engine interleaves them with its decode
steps); its K, V and logits do not depend on how it was cut.

Every message is opened with the handoff's key and its bytes checked against their checksums before
anything reads them (`seal`). Token-only runs the whole prefill on the receiver; transfer-only
computes the first logits from the `head` message. Any transport or payload error, or a timeout,
raises; a partial cache is never returned. With `Receiving.keep_verified`, a failure that cost only
prefix layers (the boundary whole and the suffix run, or for transfer-only the head verified)
raises `recovery.PartialHandoff` instead, whose `Salvage` keeps every verified layer, so that the
caller recomputes only layers 0..m (`recovery`); the reading then goes on past a prefix layer
whose bytes fail their checks, to keep the layers after it. The result carries the timing breakdown
(`HandoffTimings`), the bytes received by kind, and `link_sample`: (bytes, seconds) of the link from
the messages that landed before this worker began computing (`transport.arrivals`): before the
suffix or the first decode that computes, whichever came first (restoring a BF16 layer is a copy and
does not count), or None where the transport does not time its messages or they said nothing
reliable. A computing worker delays its receiving thread, so later arrivals time the machine, not
the wire.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rekv_core.handoff.action import Action, WireBytes
from rekv_core.handoff.boundary import decode_chunk
from rekv_core.handoff.incoming import Inbound, Incoming, join_reader
from rekv_core.handoff.plan import HandoffPlan
from rekv_core.handoff.recovery import PartialHandoff, Salvage
from rekv_core.handoff.residuals import PendingResiduals
from rekv_core.handoff.seal import Sealing, check_checksums
from rekv_core.handoff.transfer import Transfer, TransferState, allowed_s
from rekv_core.handoff.wire import PLAN, TOKENS
from rekv_core.model.cache import KVCache
from rekv_core.model.executor import Model, final_logits
from rekv_core.model.turns import (UNLIMITED, ComputeTurns, TimedTurns, prefill_in_turns,
                                 run_layers_in_turns)
from rekv_core.transport import TransportError, TransportReceiver
from rekv_core.units import BF16_BYTES, TOKEN_ID_BYTES


class ReceiveMode(enum.Enum):
    OVERLAP = "overlap"  # eq. 9: the suffix beside the prefix, chunk by chunk
    SEQUENTIAL = "sequential"  # eq. 8: the whole prefix, then the suffix


class ComputeObserver(Protocol):
    """Told of one handoff's compute on the receiving side (the decode side's load book)."""

    def planned(self, layers: int, prompt_len: int) -> None:
        """The plan arrived: this side will compute `layers` layers of `prompt_len` tokens."""

    def computing(self, running: bool) -> None:
        """This side starts (True) or stops (False) computing the handoff."""


@dataclass(frozen=True)
class Receiving:
    """The receiving side's own choices for one handoff. `prompt_len`, when known, lets the cache
    be allocated before the plan arrives (while the sender prefills), not while the first
    messages land; the plan must then agree with it. `extra_capacity`: cache rows beyond the
    prompt (the tokens to generate). `keep_verified`: a failure that lost only prefix layers
    raises `PartialHandoff` with what verified (module doc)."""

    mode: ReceiveMode = ReceiveMode.OVERLAP
    prompt_len: int | None = None
    extra_capacity: int = 0
    work: ComputeObserver | None = None
    keep_verified: bool = False
    turns: ComputeTurns = UNLIMITED  # where this side's compute takes its turns (an engine's)

    def __post_init__(self) -> None:
        if not isinstance(self.mode, ReceiveMode):
            raise ValueError(f"mode: must be one of {[m.name for m in ReceiveMode]}, got "
                             f"{self.mode!r}")
        if self.prompt_len is not None and self.prompt_len < 1:
            raise ValueError(f"prompt_len: must be positive, got {self.prompt_len}")
        if self.extra_capacity < 0:
            raise ValueError(f"extra_capacity: must be >= 0, got {self.extra_capacity}")


@dataclass(frozen=True)
class HandoffTimings:
    """The seed's parts of one handoff, in seconds from the call to `receive_handoff`."""

    h_s: float = 0.0  # H: until the boundary (or, for transfer-only, nothing) is in
    x_s: float = 0.0  # X: prefix transfer and restore, from then on
    r_s: float = 0.0  # R: suffix recompute (token-only: the whole prefill)
    j_s: float = 0.0  # J: from the later branch's end to the complete cache
    total_s: float = 0.0
    suffix_end_s: float = 0.0  # when the suffix (token-only: the prefill) ended; 0: none ran


@dataclass
class HandoffResult:
    plan: HandoffPlan  # as it arrived
    cache: KVCache
    logits: torch.Tensor  # [vocab], float32: the first generated token's distribution
    timings: HandoffTimings = field(default_factory=HandoffTimings)
    bytes: WireBytes = field(default_factory=WireBytes)
    link_sample: tuple[int, float] | None = None  # (bytes, seconds)
    residuals: PendingResiduals | None = None  # Lynx: still arriving; the cache is the anchors'

    @property
    def action(self) -> Action:
        return self.plan.action


class _NoWork:
    def planned(self, layers: int, prompt_len: int) -> None:
        pass

    def computing(self, running: bool) -> None:
        pass


def receive_handoff(model: Model, transport: TransportReceiver, transfer: Transfer,
                    sealing: Sealing = Sealing(), receiving: Receiving = Receiving()
                    ) -> HandoffResult:
    """`transfer`: the handoff's state and deadline, which every wait obeys (each wait at most
    its stall limit); it ends DONE or FAILED. `sealing`: the handoff's key (`seal.new_key`),
    which the sender must seal with, and whether every buffer is encrypted (decrypted here on
    the host)."""
    start = time.perf_counter()
    request_id = transfer.transfer_id
    try:
        cache = (None if receiving.prompt_len is None
                 else _empty_cache(model, receiving.prompt_len + receiving.extra_capacity))
        inbound = Inbound(transport, request_id, transfer, sealing)
        result = _receive(model, inbound, receiving, start, cache)
    except BaseException as exc:
        transport.abort(request_id)
        transfer.fail(f"{type(exc).__name__}: {exc}")
        raise
    if result.residuals is None:  # else the residuals end the request (`PendingResiduals`)
        transport.close(request_id)
        transfer.advance(TransferState.DONE)
    return result


def _empty_cache(model: Model, capacity: int) -> KVCache:
    shape = model.shape
    return KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, capacity, model.dtype,
                   model.device)


def _receive(model: Model, inbound: Inbound, receiving: Receiving, start: float,
             cache: KVCache | None) -> HandoffResult:
    plan = HandoffPlan.from_bytes(inbound.expect(PLAN).header, model.shape)
    work = receiving.work or _NoWork()
    # rows to compute here: a token split's first l, else every token
    work.planned(model.shape.num_layers - plan.action.cut, plan.boundary_rows)
    if plan.predicted_ms > 0:
        inbound.transfer.expect_within(allowed_s(plan.predicted_ms / 1e3))
    inbound.transfer.advance(TransferState.BOUNDARY)
    S, extra = plan.seq_len, receiving.extra_capacity
    if cache is None:
        cache = _empty_cache(model, S + extra)
    elif cache.capacity != S + extra:
        raise TransportError(f"plan: a prompt of {S} tokens, expected "
                             f"{cache.capacity - extra}")
    turns = TimedTurns(receiving.turns, work.computing, model.device)
    if plan.action.cut == 0:
        return _recompute_prompt(model, inbound, plan, cache, start, turns)
    return _restore_and_recompute(model, inbound, receiving, plan, cache, start, turns)


def _recompute_prompt(model: Model, inbound: Inbound, plan: HandoffPlan, cache: KVCache,
                      start: float, turns: TimedTurns) -> HandoffResult:
    """Token-only: the prompt's ids arrive, this worker runs every layer."""
    S = plan.seq_len
    message = inbound.expect(TOKENS)
    inbound.transfer.advance(TransferState.JOINING)
    check_checksums(message, inbound.sealing.sealed)
    ids = message.buffers["ids"].view(torch.int32).tolist()
    if len(ids) != S:
        raise TransportError(f"tokens: expected {S} ids, got {len(ids)}")
    began = time.perf_counter()
    logits = prefill_in_turns(model, ids, cache, turns)
    done = time.perf_counter()
    timings = HandoffTimings(h_s=began - start, r_s=done - began, total_s=done - start,
                             suffix_end_s=done - start)
    return HandoffResult(plan, cache, logits, timings, WireBytes(tokens=S * TOKEN_ID_BYTES))

@dataclass(frozen=True)
class _Suffix:
    logits: torch.Tensor | None  # None for a token split
    began: float  # the first chunk in hand, its compute starting
    ended: float
    compute_s: float  # the chunks' compute, without the waits between them
    wire_bytes: int  # the boundary's, as it travelled


def _run_suffix(model: Model, plan: HandoffPlan, incoming: Incoming, cache: KVCache,
                turns: TimedTurns) -> _Suffix:
    """Layers c..L−1, one boundary chunk at a time as each arrives, in turns
    (`run_layers_in_turns`)."""
    cuda = model.device.type == "cuda"
    shape = (model.shape.hidden_size,)
    h = None
    began = 0.0
    wire = 0
    for index, (s0, s1) in enumerate(plan.boundary_chunks):
        message = incoming.next_chunk(index)
        wire += message.payload_bytes
        rows = decode_chunk(message, (s1 - s0, *shape), plan.action.boundary,
                            incoming.inbound.sealing.sealed).to(model.device, model.dtype)
        now = time.perf_counter()
        transfer = incoming.inbound.transfer
        if index == 0:
            began = now
            transfer.advance(TransferState.PREFIX)
        h = run_layers_in_turns(model, rows, plan.action.cut, model.shape.num_layers, s0, cache,
                                turns)
    # a token split's last row is not recomputed: its logits come from the head
    logits = None if plan.action.split else final_logits(model, h[-1])
    if cuda:
        torch.cuda.current_stream(model.device).synchronize()
    return _Suffix(logits, began, time.perf_counter(), turns.compute_s, wire)


def _restore_and_recompute(model: Model, inbound: Inbound, receiving: Receiving,
                           plan: HandoffPlan, cache: KVCache, start: float,
                           turns: TimedTurns) -> HandoffResult:
    """A cut c ≥ 1: the prefix restored by the reading thread beside the suffix, which runs on
    this thread one boundary chunk at a time (overlap), or after the whole prefix (sequential)."""
    action, S, mode = plan.action, plan.seq_len, receiving.mode
    hidden = model.shape.hidden_size
    incoming = Incoming(model, inbound, plan, cache, start, receiving.keep_verified)
    suffix = pending = None
    if action.progressive:
        suffix, pending = _anchors_and_suffix(model, plan, incoming, turns)
    elif not action.sends_boundary:  # transfer-only: nothing to recompute
        inbound.transfer.advance(TransferState.PREFIX)
        incoming.run()
    elif mode is ReceiveMode.OVERLAP:
        worker = threading.Thread(target=incoming.run, name=f"rekv-prefix-{inbound.request_id}")
        worker.start()
        try:
            suffix = _run_suffix(model, plan, incoming, cache, turns)
        except BaseException:  # wake the reading thread instead of waiting out its timeout
            inbound.transport.abort(inbound.request_id)
            raise
        finally:
            join_reader(worker, inbound)
    else:
        incoming.run()
        whole = incoming.error is None or (receiving.keep_verified and incoming.boundary_complete)
        suffix = _run_suffix(model, plan, incoming, cache, turns) if whole else None
    if pending is None and (incoming.error is not None or incoming.losses):
        _raise_what_is_lost(model, plan, incoming, cache, suffix)
    inbound.transfer.advance(TransferState.JOINING)

    received = WireBytes(boundary=suffix.wire_bytes if suffix else 0)
    boundary_at = suffix.began if suffix else start
    join_start = max(incoming.done, suffix.ended if suffix else 0.0)
    if action.sends_head:
        logits = _head_logits(model, incoming)
        received += WireBytes(head=hidden * BF16_BYTES)
    else:
        logits = suffix.logits
    if suffix is None:
        r_seconds, computing = 0.0, incoming.decoding_began
    else:
        r_seconds = suffix.compute_s
        computing = min(suffix.began, incoming.decoding_began or suffix.began)
    cache.length = S
    incoming.join_compute_stream(anchors=pending is not None)
    done = time.perf_counter()
    timings = HandoffTimings(h_s=boundary_at - start, x_s=max(0.0, incoming.done - boundary_at),
                             r_s=r_seconds, j_s=done - join_start, total_s=done - start,
                             suffix_end_s=suffix.ended - start if suffix else 0.0)
    return HandoffResult(plan, cache, logits, timings, received + incoming.bytes,
                         inbound.link_sample(before=computing), pending)


def _anchors_and_suffix(model: Model, plan: HandoffPlan, incoming: Incoming, turns: TimedTurns
                        ) -> tuple[_Suffix | None, PendingResiduals]:
    """Lynx: the reading thread restores the anchors (then reads on for the residuals) beside
    the suffix; back once both are done, the residuals still coming."""
    inbound = incoming.inbound
    worker = threading.Thread(target=incoming.run, name=f"rekv-prefix-{inbound.request_id}")
    worker.start()
    try:
        if plan.action.sends_boundary:
            suffix = _run_suffix(model, plan, incoming, incoming.cache, turns)
        else:
            suffix = None
            inbound.transfer.advance(TransferState.PREFIX)
        incoming.wait_anchors()
    except BaseException:
        inbound.transport.abort(inbound.request_id)
        join_reader(worker, inbound)
        raise
    return suffix, PendingResiduals(incoming, worker, join_reader)


def _head_logits(model: Model, incoming: Incoming) -> torch.Tensor:
    """The first logits from the head message (transfer-only, a token split)."""
    head = decode_chunk(incoming.head, (model.shape.hidden_size,), "bf16",
                        incoming.inbound.sealing.sealed)
    return final_logits(model, head.to(model.device, model.dtype))


def _raise_what_is_lost(model: Model, plan: HandoffPlan, incoming: Incoming, cache: KVCache,
                        suffix: _Suffix | None) -> None:
    """The reading failed or lost layers: `PartialHandoff` when only prefix layers are lost and
    the first logits stand (from the suffix, or the verified head), else the failure itself."""
    cause = incoming.error or next(iter(incoming.losses.values()))
    verified = incoming.verified()
    lost_only_prefix = incoming.keep_verified and len(verified) < plan.action.cut
    head_bytes = WireBytes(head=model.shape.hidden_size * BF16_BYTES)
    if lost_only_prefix and suffix is not None and not plan.action.split:
        logits, received = suffix.logits, WireBytes(boundary=suffix.wire_bytes)
    elif lost_only_prefix and suffix is not None and incoming.head is not None:
        logits = _head_logits(model, incoming)
        received = WireBytes(boundary=suffix.wire_bytes) + head_bytes
    elif lost_only_prefix and not plan.action.sends_boundary and incoming.head is not None:
        logits, received = _head_logits(model, incoming), head_bytes
    else:
        raise cause
    cache.length = plan.seq_len
    incoming.join_compute_stream()
    salvage = Salvage(plan, cache, logits, verified, received + incoming.bytes)
    raise PartialHandoff(salvage, cause) from cause
