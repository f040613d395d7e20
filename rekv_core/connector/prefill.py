"""The prefill side's connector: it decides each handoff's plan and sends it.

`PrefillConnector(model, calibration, planner, options)` (or `for_model(...)`, which loads the
policy and this machine's profile) holds what the prefill side learns and plans with: its
calibration (α, γ_p, its send throughput), the planner with the quality gate's policy, its compute
queue (`PrefillBacklog`) and the decode-side compute it has given out (`AssignedWork`). Methods, in
the order a `Prefill.Handoff` call uses them:

- `check(call)`: an offer from a worker of another model (`ModelMismatch`: its fingerprint is not
  `options.fingerprint`), a forced action or delivery this worker cannot serve (`BadRequest`
  naming `forced_action.codec`, `forced_action.split_tokens` or `forced_action.layer_split_tokens`
  (one not below the prompt's length, or not taken by the decode worker) or `forced_schedule.*`),
  or a forced lossy action under the `lossless` quality setting (naming `forced_action` and
  `quality`);
- `decide(call, queue)`: the `Decision` among the actions the call's quality setting allows
  (`plan.quality`), whose `plan` (`HandoffPlan`) says what to send and how:
  the delivery is the forced one or this worker's default (streamed where the decode worker takes
  it and `stream_handoff` is set, in the decode worker's chunk size), and the order is the
  planner's where it may pick one (`pipeline_prefill`, the decode worker takes token order, and
  both pools are idle: under load the measurements its model is corrected by mix load and order,
  see `bench/results/throughput-orders/`), else the forced one, else layer order. `queue`: this
  worker's other handoffs, waiting or running. The decision's decode-side compute is counted for
  offers that do not know it yet, until `ended(transfer_id)`;
- `send(call, decision, sender, transfer, hooks)`: prefill the prompt and send it; return when
  every byte has left, within the transfer's deadline; learn the prefill's and the send's times.
  A streamed handoff in layer order goes to the prefill scheduler (`options.token_budget` > 0:
  `engine.PrefillScheduler`), which batches it with the other prompts in flight, each tick at most
  that many rows, each layer sent as soon as all its rows are computed; the scheduler's deadline is
  the transfer's. The rest compute one prefill at a time (one model, one device, a lock): token
  order chunk by chunk, a codec that ranks tokens layer by layer (`LivePrefill`), each sent as it
  is computed and the lock released at the cut; the seed's schedule every layer first;
- `probe(sender, probe_id, key, timeout_s)`: send a link probe (`handoff.probe`), one at a time
  (`Busy` while another runs: two would share the link, and each pins a thread);
- `memory(prompt_len)`: what one handoff holds here, for admission control;
- `link_gbps(offered)`: the link rate it plans with;
- `ended(transfer_id)`;
- `close()`: stops the scheduler (prompts still in it end with `SchedulerClosed`).
Thread-safe.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from rekv_core.connector.calls import BadRequest, Busy, HandoffCall, ModelMismatch
from rekv_core.engine.prefill_scheduler import (DEFAULT_CATCH_UP, DEFAULT_TOKEN_BUDGET,
                                                PrefillScheduler)
from rekv_core.handoff import Delivery, HandoffPlan, Order, SenderReport, send_handoff
from rekv_core.handoff.probe import ProbeSent, send_probe
from rekv_core.handoff.scheduled_source import ScheduledPrefillSource
from rekv_core.handoff.sender import SendHooks
from rekv_core.handoff.source import ChunkedPrefill, FinishedPrefill, LivePrefill, PrefillSource
from rekv_core.handoff.transfer import Transfer
from rekv_core.model import Model, prefill
from rekv_core.plan.calibration import PrefillCalibration, Queues
from rekv_core.plan.estimates import LINK_PRIOR_GBPS
from rekv_core.plan.planner import Decision, Planner, common_codecs
from rekv_core.plan.policy import Policy, shipped_policy
from rekv_core.plan.prefill_load import AssignedWork, Once, PrefillBacklog
from rekv_core.plan.stretch import interleaved_stretch
from rekv_core.transport import TransportSender


@dataclass(frozen=True)
class PrefillOptions:
    codecs: tuple[str, ...]  # the prefix codecs this worker may send
    stream_handoff: bool = True  # send from inside the prefill where the decode worker takes it
    pipeline_prefill: bool = True  # let the planner pick token order where it applies
    fingerprint: str = ""  # its model's fingerprint (hex, `handoff.fingerprint`)
    token_split: bool = True  # let the planner rank token splits where the decode worker takes them
    lynx_streams: bool = True  # let it rank Lynx's streams of int8 actions where it takes them
    layer_split: bool = True  # let it rank KVPR's per-layer form where the decode worker takes it
    token_budget: int = DEFAULT_TOKEN_BUDGET  # the scheduler's rows per tick; 0: no scheduler
    batch_invariant: bool = False  # each prompt's prefill bit for bit its lone one, whatever batch
    catch_up: int = DEFAULT_CATCH_UP  # layers a short late arrival runs alone to meet the others


@dataclass(frozen=True)
class SentHandoff:
    prefill_s: float  # the prefill's compute
    send_s: float  # first message posted to last byte gone
    report: SenderReport


class PrefillConnector:
    def __init__(self, model: Model, calibration: PrefillCalibration, planner: Planner,
                 options: PrefillOptions):
        self.model, self.shape = model, model.shape
        self.calibration, self.planner, self.options = calibration, planner, options
        self.backlog = PrefillBacklog()
        self.assigned = AssignedWork()
        self._compute = threading.Lock()
        self._probing = threading.Lock()
        self.scheduler = (PrefillScheduler(model, options.token_budget, options.batch_invariant,
                                           options.catch_up)
                          if options.token_budget else None)

    @classmethod
    def for_model(cls, model: Model, options: PrefillOptions, profile: str = "",
                  policy: str = "", link_prior_gbps: float = LINK_PRIOR_GBPS
                  ) -> PrefillConnector:
        """`profile`, `policy`: files (`rekv profile`, `rekv gate`); empty: this machine's
        cached profile, and the policy shipped for the model (none: lossless actions only)."""
        loaded = Policy.load(policy) if policy else shipped_policy(model.shape.name)
        if loaded is not None and loaded.model != model.shape.name:
            raise ValueError(f"policy: written for {loaded.model}, serving {model.shape.name}")
        calibration = PrefillCalibration.for_model(model, options.codecs, profile,
                                                   link_prior_gbps)
        return cls(model, calibration, Planner(loaded), options)

    def check(self, call: HandoffCall) -> None:
        if call.offer.fingerprint != self.options.fingerprint:
            raise ModelMismatch(call.offer.fingerprint, self.options.fingerprint)
        forced = call.forced_action
        if forced is not None and not call.quality.allows(forced):
            raise BadRequest(f"forced_action: {forced} is lossy, and quality is "
                             f"{call.quality.value}")
        if forced is not None and forced.cut:
            try:
                self.planner.deployed(forced.codec)
            except ValueError as exc:
                raise BadRequest(f"forced_action.codec: {exc}") from None
        if forced is not None and forced.split and not call.offer.accepts_token_split:
            raise BadRequest("forced_action.split_tokens: the decode worker does not take a "
                             "token split")
        if forced is not None and forced.progressive and not call.offer.accepts_progressive:
            raise BadRequest("forced_action.progressive: the decode worker does not take Lynx's "
                             "streams")
        if (forced is not None and forced.progressive and call.forced_delivery is not None
                and call.forced_delivery.pipelined):
            raise BadRequest("forced_schedule.pipelined: Lynx's streams go in layer order")
        if forced is not None and forced.layer_split and not call.offer.accepts_layer_split:
            raise BadRequest("forced_action.layer_split_tokens: the decode worker does not take "
                             "KVPR's per-layer form")
        if (forced is not None and forced.layer_split and call.forced_delivery is not None
                and call.forced_delivery.pipelined):
            raise BadRequest("forced_schedule.pipelined: KVPR's per-layer form goes in layer "
                             "order")
        if forced is not None and call.token_ids:
            try:
                forced.check_prompt(len(call.token_ids))
            except ValueError as exc:  # "split: ..." or "layer_split: ...", the proto's *_tokens
                name, _, why = str(exc).partition(":")
                raise BadRequest(f"forced_action.{name}_tokens:{why}") from None
        self._delivery(call)

    def decide(self, call: HandoffCall, queue: int = 0) -> Decision:
        offer = call.offer
        stretch = interleaved_stretch(offer.running_batch, offer.itl_budget_ms,
                                      offer.decode_step_ms)
        # the decode side's compute is interleaved with its running batch (`plan.cost`)
        costs = replace(offer.costs,
                        suffix_ms_per_layer=offer.costs.suffix_ms_per_layer * stretch)
        delivery = self._delivery(call)
        unseen = self.assigned.unseen(offer.address, offer.planned)
        inputs = self.calibration.cost_inputs(
            self.shape, len(call.token_ids), costs, delivery.streamed, delivery.chunk_tokens,
            self._orders(call, delivery, queue),
            Queues(queue, offer.computing, self.backlog.ms, offer.backlog_ms + unseen),
            token_splits=self.options.token_split and offer.accepts_token_split,
            progressive=self.options.lynx_streams and offer.accepts_progressive,
            layer_splits=self.options.layer_split and offer.accepts_layer_split)
        decision = self.planner.decide(inputs, common_codecs(self.options.codecs, offer.codecs),
                                       costs.evidence, call.forced_action, call.quality)
        share = decision.plan.boundary_rows / decision.plan.seq_len  # a split's first l rows
        self.assigned.add(offer.address, call.transfer_id,
                          (self.shape.num_layers - decision.action.cut)
                          * costs.suffix_ms_per_layer * share)
        return decision

    def _delivery(self, call: HandoffCall) -> Delivery:
        """The forced delivery (if the decode worker takes it), else this worker's default."""
        offer, forced = call.offer, call.forced_delivery
        if forced is None:
            return Delivery(self.options.stream_handoff and offer.accepts_streamed,
                            offer.chunk_tokens)
        if forced.streamed and not offer.accepts_streamed:
            raise BadRequest("forced_schedule.streamed: the decode worker does not take a "
                             "streamed handoff")
        if forced.pipelined and not offer.accepts_pipelined:
            raise BadRequest("forced_schedule.pipelined: the decode worker does not take a "
                             "pipelined handoff")
        return forced

    def _orders(self, call: HandoffCall, delivery: Delivery, queue: int) -> frozenset[Order]:
        if call.forced_delivery is not None:
            return frozenset({delivery.order})
        free = (self.options.pipeline_prefill and call.offer.accepts_pipelined
                and delivery.streamed and delivery.chunk_tokens > 0)
        idle = queue == 0 and call.offer.computing == 0
        return frozenset(Order) if free and idle else frozenset({Order.LAYERS})

    def link_gbps(self, offered_gbps: float | None) -> float:
        """The link rate this side plans with, given what a decode worker offers."""
        return self.calibration.link_gbps(offered_gbps)

    def ended(self, transfer_id: str) -> None:
        self.assigned.ended(transfer_id)

    def memory(self, prompt_len: int) -> int:
        """Every layer's K and V and the hidden states the prefill keeps, and the encoded layers
        until they have left (at most BF16-sized)."""
        shape, elem = self.shape, self.model.dtype.itemsize
        computed = shape.num_layers * shape.kv_layer_bytes(prompt_len, elem)
        hidden = 2 * shape.boundary_bytes(prompt_len, elem)
        return computed + hidden + shape.num_layers * shape.kv_layer_bytes(prompt_len)

    def send(self, call: HandoffCall, decision: Decision, sender: TransportSender,
             transfer: Transfer, hooks: SendHooks | None = None) -> SentHandoff:
        """Prefill and send `decision.plan` under `transfer`, whose deadline bounds the wait for
        the compute and for the last byte."""
        plan = decision.plan
        prompt_len = plan.seq_len
        layers = plan.action.sent_layers if plan.streamed else self.shape.num_layers
        queued = self.backlog.add(layers * self.calibration.prefill_ms_per_layer(
            prompt_len, plan.streamed, call.offer.costs.suffix_scale))
        locked = bool(layers) and not self._scheduled(plan)
        if locked and not self._compute.acquire(timeout=transfer.wait_s()):
            queued()
            raise TimeoutError(f"transfer {transfer.transfer_id}: no turn to compute before its "
                               f"deadline")
        release = Once(lambda: (self._compute.release() if locked else None, queued()))
        try:
            transfer.check()
            started = time.perf_counter()
            source = self._source(call, plan, release, transfer)
            prefill_s = time.perf_counter() - started
            send_start = time.perf_counter()
            report = send_handoff(sender, plan, source, transfer, call.sealing, hooks)
        finally:
            release()
        send_s = time.perf_counter() - send_start
        if plan.streamed:  # the sends ran beside the compute: no link figure in them
            prefill_s = source.compute_s
        else:
            self.calibration.observe_send(report.bytes.total, send_s)
        self.calibration.observe_prefill(layers, prompt_len, prefill_s, plan.streamed)
        return SentHandoff(prefill_s, send_s, report)

    def _scheduled(self, plan: HandoffPlan) -> bool:
        """Whether the scheduler computes this plan's prefill (see `send`)."""
        return (self.scheduler is not None and plan.streamed and not plan.pipelined
                and not plan.codec.importance_window)

    def _source(self, call: HandoffCall, plan: HandoffPlan, release: Once,
                transfer: Transfer) -> PrefillSource:
        cut, window = plan.action.cut, plan.codec.importance_window
        through, rows = plan.action.sent_layers, plan.action.layer_split
        if self._scheduled(plan):
            return ScheduledPrefillSource(self.scheduler, call.token_ids, cut, through, rows,
                                          transfer.deadline, f"transfer {transfer.transfer_id}",
                                          on_done=release)
        if plan.pipelined:
            return ChunkedPrefill(self.model, call.token_ids, cut, plan.chunk_tokens,
                                  on_done=release)
        if plan.streamed:
            return LivePrefill(self.model, call.token_ids, cut, on_done=release,
                               importance_window=window, through=through, input_rows=rows)
        inputs = set(range(through)) if rows else set()  # every sent layer's input rows
        out = prefill(self.model, call.token_ids, importance_window=window,
                      boundaries={cut, self.shape.num_layers} | inputs)
        release()
        return FinishedPrefill(out, call.token_ids, cut, through, input_rows=rows)

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()

    def probe(self, sender: TransportSender, probe_id: str, key: bytes | None,
              timeout_s: float) -> ProbeSent:
        if not self._probing.acquire(blocking=False):
            raise Busy("probe: another probe is being sent; ask again later")
        try:
            return send_probe(sender, probe_id, key, timeout_s=timeout_s)
        finally:
            self._probing.release()
