"""The decode side's connector: it offers, receives, and learns from each handoff.

`DecodeConnector(model, calibration, receiver, options, transfers)` (or `for_model(...)`, which
measures or loads this machine's profile) holds what the decode side learns about its costs and
the link (`DecodeCalibration`: the link estimate's one writer, handoffs and probes alike), and its
load (`DecodeLoad`, `SharingMeter`, `ReceiveOverlaps`). A request's handoff uses, in order:

1. `offer(prompt_len, in_flight, queue, quality)`: the `DecodeOffer` for the prefill side: the
   codecs it takes (under the `lossless` quality setting only lossless ones), this worker's
   costs (γ for the requests generating here plus one), its evidence, its link estimate (None
   until measured), and its load (the compute committed here by planned handoffs);
2. `begin(request_id, prompt_len, max_new_tokens, time_remaining)`: a `PendingHandoff` handoff: its
   `Transfer`, whose deadline is the call's less what a local recompute of the prompt would take
   (at least half the call's time is the handoff's), trusting the prefill side's prediction once
   the link is measured; a fresh key, bound to this worker's model fingerprint (`options.
   fingerprint`, which the offer carries too); the receive opened on the data plane, which starts
   taking messages at once;
3. `receive(pending)` (blocking, on a thread): the handoff's result, and how many requests
   computed here on average while its suffix ran;
4. `check_reply(plan, reply)`: the prefill side's reply must name the plan that arrived in-band;
5. `learn(pending, result, sharing, reply)`: the `HandoffObservation` the calibration learned
   from (a receive that another overlapped gives no link sample: its arrivals time both, or the
   machine), and the link sample in Gb/s, if any;
6. `end(pending)` always, once the handoff is over (event-loop thread).
A failed handoff is given up with `abandon(pending, reason)`, and the prompt recovered here by
`recover(ids, capacity, salvage)`, counted as this worker's load while it runs: with the
`Salvage` of a handoff that lost only prefix layers (`receive` raised `PartialHandoff`), layers
0..m alone are recomputed and the verified ones kept (`partial`), else the whole prompt
(`recompute`, `full`; `handoff.recovery`); a caller that gives up `cancel`s it.
`observe_probe(sample)` takes a link probe's sample; `memory(prompt_len, max_new_tokens)` is what
one request holds here, for admission control. Thread-safe, except where an event-loop thread is
named.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rekv_core.connector.calls import DecodeOffer, HandoffReply
from rekv_core.engine import EngineState
from rekv_core.handoff import (HandoffPlan, HandoffResult, Receiving, Sealing,
                               receive_handoff)
from rekv_core.handoff.recovery import FULL, Recovery, Salvage, recompute_lost, recovery
from rekv_core.handoff.seal import new_key
from rekv_core.handoff.transfer import Transfer, TransferBook
from rekv_core.model import KVCache, Model
from rekv_core.model.turns import UNLIMITED, ComputeTurns, prefill_in_turns
from rekv_core.plan.calibration import DecodeCalibration
from rekv_core.plan.decode_load import DecodeLoad, DecodeWork, Receive, ReceiveOverlaps
from rekv_core.plan.estimates import LINK_PRIOR_GBPS
from rekv_core.plan.evidence import HandoffObservation
from rekv_core.plan.lynx_drafts import MAX_DRAFTS, draft_count
from rekv_core.plan.quality import DEFAULT_QUALITY, Quality, offered_codecs
from rekv_core.plan.sharing import SharingMeter
from rekv_core.transport import TransportReceiver
from rekv_core.transport.base import PREFETCH

RECOMPUTE_RESERVE = 1.5  # a handoff's deadline keeps this many local recomputes of the prompt


@dataclass(frozen=True)
class DecodeOptions:
    codecs: tuple[str, ...]  # the prefix codecs this worker accepts
    chunk_tokens: int = 0  # the boundary chunk size it asks for
    stall_s: float = 60.0  # the longest wait for one data-plane message
    encrypt: bool = False  # have every data-plane buffer encrypted
    link_prior_gbps: float = LINK_PRIOR_GBPS  # what it files handoffs under before a sample
    fingerprint: str = ""  # its model's fingerprint (hex, `handoff.fingerprint`)


@dataclass
class PendingHandoff:
    """One handoff between `begin` and `end`."""

    transfer: Transfer
    sealing: Sealing
    prompt_len: int
    max_new_tokens: int
    work: DecodeWork
    receive: Receive


@dataclass(frozen=True)
class Recovered:
    """A failed handoff's prompt, restored here: its cache, first logits, and what it took."""

    cache: KVCache
    logits: torch.Tensor
    recovery: Recovery


@dataclass(frozen=True)
class Learned:
    observation: HandoffObservation
    link_sample_gbps: float | None


class DecodeConnector:
    def __init__(self, model: Model, calibration: DecodeCalibration,
                 receiver: TransportReceiver, options: DecodeOptions,
                 transfers: TransferBook | None = None, turns: ComputeTurns = UNLIMITED,
                 engine_state: Callable[[], EngineState] | None = None):
        self.model, self.shape = model, model.shape
        self.turns = turns  # where this worker's prefill-like compute takes its turns
        self.engine_state = engine_state  # its decode engine's batch and budget, if it has one
        self.calibration, self.receiver, self.options = calibration, receiver, options
        self.load = DecodeLoad(transfers or TransferBook())
        self.sharing = SharingMeter(self.load.computing)
        self.overlaps = ReceiveOverlaps()

    @classmethod
    def for_model(cls, model: Model, receiver: TransportReceiver, options: DecodeOptions,
                  profile: str = "", transfers: TransferBook | None = None,
                  turns: ComputeTurns = UNLIMITED,
                  engine_state: Callable[[], EngineState] | None = None) -> DecodeConnector:
        calibration = DecodeCalibration.for_model(model, options.codecs, profile,
                                                  options.link_prior_gbps)
        return cls(model, calibration, receiver, options, transfers, turns, engine_state)

    @property
    def link_measured(self) -> bool:
        return self.calibration.link.measured

    def lynx_drafts(self, prompt_len: int, cut: int) -> int:
        """How many tokens to draft on a Lynx handoff's anchors (`plan.lynx_drafts`): its
        residuals' bytes (half of each int8 layer's codes) at the link estimate, over a turn
        between two of the engine's steps; without an engine, the most (drafting stops anyway
        once the residuals are in)."""
        if self.engine_state is None:
            return MAX_DRAFTS
        residual_bytes = cut * self.shape.kv_layer_bytes(prompt_len, 1) / 2
        wait_ms = residual_bytes * 8 / (self.link_gbps * 1e9) * 1e3
        return draft_count(wait_ms, max(self.engine_state().step_ms, 1e-3))

    @property
    def link_gbps(self) -> float:
        """The link estimate, or the prior before any sample."""
        return self.calibration.link_gbps

    def offer(self, prompt_len: int, in_flight: int, queue: int,
              quality: Quality = DEFAULT_QUALITY) -> DecodeOffer:
        backlog = self.load.backlog(self.calibration.suffix_ms_per_layer,
                                    self.shape.num_layers)
        engine = self.engine_state() if self.engine_state else None
        return DecodeOffer(model=self.shape.name, num_layers=self.shape.num_layers,
                           address=self.receiver.address,
                           codecs=offered_codecs(quality, self.options.codecs),
                           queue_depth=queue, handoffs_in_flight=in_flight,
                           costs=self.calibration.offer(prompt_len, self.load.sharers()),
                           accepts_streamed=True, accepts_pipelined=True, accepts_token_split=True,
                           accepts_progressive=True, accepts_layer_split=True,
                           chunk_tokens=self.options.chunk_tokens,
                           computing=self.load.computing(), backlog_ms=backlog.ms,
                           planned=backlog.planned, fingerprint=self.options.fingerprint,
                           running_batch=engine.running if engine else 0,
                           itl_budget_ms=engine.itl_budget_ms if engine else 0.0,
                           decode_step_ms=engine.step_ms if engine else 0.0)

    def recompute_s(self, prompt_len: int) -> float:
        """What recomputing a prompt here would take now, by this worker's calibration."""
        per_layer_ms = self.calibration.suffix_ms_per_layer(prompt_len, self.load.sharers())
        return per_layer_ms * self.shape.num_layers / 1e3

    def begin(self, request_id: str, prompt_len: int, max_new_tokens: int,
              time_remaining: float | None, transfer_id: str) -> PendingHandoff:
        """Event-loop thread. `transfer_id`: unique per handoff (the data plane's request id)."""
        deadline = None
        if time_remaining is not None:
            reserve = RECOMPUTE_RESERVE * self.recompute_s(prompt_len)
            deadline = time.monotonic() + max(time_remaining - reserve, time_remaining / 2)
        transfer = Transfer(transfer_id, deadline, self.options.stall_s, self.load.transfers,
                            trust_predictions=self.link_measured)
        receive = self.overlaps.begin(computing=self.load.computing() > 0)
        self.receiver.open(transfer_id)
        sealing = Sealing(new_key(), self.options.encrypt,
                          bytes.fromhex(self.options.fingerprint))
        return PendingHandoff(transfer, sealing, prompt_len, max_new_tokens,
                              self.load.work(transfer), receive)

    def receive(self, pending: PendingHandoff) -> tuple[HandoffResult, float]:
        """The result, and the mean number of requests computing here (this one included) while
        its suffix ran (1.0 for transfer-only, which computes nothing here)."""
        called = time.perf_counter()
        result = receive_handoff(self.model, self.receiver, pending.transfer, pending.sealing,
                                 Receiving(prompt_len=pending.prompt_len,
                                           extra_capacity=pending.max_new_tokens,
                                           work=pending.work, keep_verified=True,
                                           turns=self.turns))
        t = result.timings
        if t.suffix_end_s <= 0.0:
            return result, 1.0
        return result, self.sharing.average(called + t.h_s, called + t.suffix_end_s)

    def abandon(self, pending: PendingHandoff, reason: str) -> None:
        """Give the handoff up: it fails, and its receive is aborted (which wakes its reader and
        drains whatever the prefill side still sends)."""
        pending.transfer.fail(reason)
        self.receiver.abort(pending.transfer.transfer_id)

    def cancel(self, pending: PendingHandoff) -> None:
        """The caller gave up (cancelled, or past its deadline): wake the receive and drain."""
        pending.transfer.cancel()
        self.receiver.abort(pending.transfer.transfer_id)

    def end(self, pending: PendingHandoff) -> None:
        """Event-loop thread."""
        self.overlaps.end(pending.receive)

    @staticmethod
    def check_reply(plan: HandoffPlan, reply: HandoffReply) -> None:
        """ValueError when the reply names another action or delivery than the plan that
        arrived on the data plane."""
        if reply.action != plan.action or reply.delivery != plan.delivery:
            raise ValueError(f"the reply names {reply.action} sent {reply.delivery}, the plan "
                             f"on the data plane {plan.action} sent {plan.delivery}")

    def learn(self, pending: PendingHandoff, result: HandoffResult, sharing: float,
              reply: HandoffReply) -> Learned:
        if pending.receive.shared:
            result = replace(result, link_sample=None)
        observation = HandoffObservation(
            action=result.action, prompt_len=pending.prompt_len, load=sharing,
            timings=result.timings, wire=result.bytes, link_sample=result.link_sample,
            prefill_s=reply.prefill_ms / 1e3, modelled_ms=reply.model_ms,
            streamed=result.plan.streamed, pipelined=result.plan.pipelined)
        return Learned(observation, self.calibration.observe(observation))

    def observe_probe(self, sample: tuple[int, float]) -> float | None:
        """A link probe's (bytes, seconds); the link estimate after it."""
        return self.calibration.observe_probe(*sample)

    def recompute(self, ids: list[int], capacity: int) -> tuple[KVCache, torch.Tensor]:
        """The prompt's cache and first logits, computed here."""
        shape = self.shape
        cache = KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, capacity,
                        self.model.dtype, self.model.device)
        with self.load.recomputing(len(ids)):
            logits = prefill_in_turns(self.model, ids, cache, self.turns)
        return cache, logits

    def recover(self, ids: list[int], capacity: int, salvage: Salvage | None) -> Recovered:
        """After a failed handoff: layers 0..m recomputed over the `salvage` (partial), or the
        whole prompt (full) where there is none or it cannot be used."""
        if salvage is not None and salvage.cache.capacity != capacity:
            salvage = None
        decided = recovery(salvage, ids, self.shape.num_layers)
        if decided.scope == FULL:
            return Recovered(*self.recompute(ids, capacity), decided)
        with self.load.recomputing(len(ids), decided.layers):
            cache = recompute_lost(self.model, ids, salvage, self.turns)
        return Recovered(cache, salvage.logits, decided)

    def memory(self, prompt_len: int, max_new_tokens: int) -> int:
        """Its cache, the boundary, the messages read ahead."""
        shape, elem = self.shape, self.model.dtype.itemsize
        cache = shape.num_layers * shape.kv_layer_bytes(prompt_len + max_new_tokens, elem)
        read_ahead = PREFETCH * shape.kv_layer_bytes(prompt_len)
        return cache + shape.boundary_bytes(prompt_len) + read_ahead

    def close(self) -> None:
        self.sharing.close()
