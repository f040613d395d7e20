"""Conversions between the protobuf messages of `proto/rekv/v1` and the services' and connectors'
values.

This is the only module that reads or builds protobuf messages. Readers check each field's form
and raise `InvalidArgument` naming the field (`forced_action.cut`, `offer.codecs`, ...); they never
hand a malformed value on.
"""

from __future__ import annotations

import logging
import math

from rekv_core.codecs import codec_names
from rekv_core.connector import DecodeOffer, HandoffCall, HandoffReply, Quality
from rekv_core.handoff import Action, ActionKind, Delivery, Order, Sealing, WireBytes
from rekv_core.handoff.fingerprint import is_fingerprint
from rekv_core.handoff.seal import KEY_BYTES
from rekv_core.model.sampling import SamplingParams
from rekv_core.plan.evidence import (MAX_PLANNED_TRANSFERS, MAX_SUFFIX_SCALE, DecodeCosts,
                                     Evidence, Measured)
from services.calls import Completion, ConnectCall, Connected, GenerateCall
from services.errors import InvalidArgument
from services.rpc import rekv_pb2

log = logging.getLogger(__name__)


def action_from_proto(message, num_layers: int, field: str = "forced_action") -> Action:
    if message.codec not in codec_names():
        raise InvalidArgument(f"{field}.codec: unknown codec {message.codec!r}; known: "
                              f"{', '.join(codec_names())}")
    if message.cut > num_layers:
        raise InvalidArgument(f"{field}.cut: must lie in [0, {num_layers}], got {message.cut}")
    try:
        return Action(message.codec, message.cut, num_layers, message.boundary or "bf16",
                      message.split_tokens, message.progressive, message.layer_split_tokens)
    except ValueError as exc:
        raise InvalidArgument(_action_field(field, exc)) from None


def _action_field(field: str, exc: ValueError) -> str:
    """An `Action`'s "name: why" as "field.name: why", in the proto's names of its fields."""
    name, _, why = str(exc).partition(":")
    name = f"{name}_tokens" if name in ("split", "layer_split") else name
    return f"{field}.{name}:{why}"


def check_forced_split(forced: Action | None, prompt_len: int) -> None:
    """A forced token split or per-layer form must leave tokens to send as KV."""
    try:
        if forced is not None:
            forced.check_prompt(prompt_len)
    except ValueError as exc:
        raise InvalidArgument(_action_field("forced_action", exc)) from None


def action_to_proto(action: Action):
    return rekv_pb2.Action(codec=action.codec, cut=action.cut, boundary=action.boundary,
                           split_tokens=action.split, progressive=action.progressive,
                           layer_split_tokens=action.layer_split)


def delivery_from_proto(message, field: str = "forced_schedule") -> Delivery:
    """A `Schedule` message (the proto's name for a delivery)."""
    try:
        return Delivery(streamed=message.streamed, chunk_tokens=message.boundary_chunk_tokens,
                        order=Order.TOKENS if message.pipelined else Order.LAYERS)
    except ValueError as exc:
        where = "boundary_" if str(exc).startswith("chunk_tokens") else ""
        raise InvalidArgument(f"{field}.{where}{exc}") from None


def delivery_to_proto(delivery: Delivery):
    return rekv_pb2.Schedule(streamed=delivery.streamed, pipelined=delivery.pipelined,
                             boundary_chunk_tokens=delivery.chunk_tokens)


def wire_bytes_to_proto(wire: WireBytes):
    return rekv_pb2.WireBytes(boundary=wire.boundary, prefix=wire.prefix, scales=wire.scales,
                              tokens=wire.tokens, head=wire.head)


def _wire_bytes_from_proto(message) -> WireBytes:
    return WireBytes(message.boundary, message.prefix, message.scales, message.tokens, message.head)


_QUALITY = {rekv_pb2.QUALITY_LOSSLESS: Quality.LOSSLESS, rekv_pb2.QUALITY_GATED: Quality.GATED}


def quality_from_proto(value: int, unspecified: bool = False) -> Quality | None:
    """A `Quality` enum value; UNSPECIFIED gives None where `unspecified` allows it (the
    deployment's default applies), else `InvalidArgument`, as does a value the enum lacks."""
    if value == rekv_pb2.QUALITY_UNSPECIFIED and unspecified:
        return None
    if value not in _QUALITY:
        known = ", ".join(rekv_pb2.Quality.Name(q) for q in _QUALITY)
        raise InvalidArgument(f"quality: must be one of {known}"
                              f"{' (or unset)' if unspecified else ''}, got {value}")
    return _QUALITY[value]


def quality_to_proto(quality: Quality) -> int:
    return next(value for value, q in _QUALITY.items() if q is quality)


def check_forced_quality(forced: Action | None, quality: Quality | None) -> None:
    """A forced lossy action under `lossless` asks for two things that cannot both hold."""
    if forced is not None and quality is not None and not quality.allows(forced):
        raise InvalidArgument(f"forced_action: {forced} is lossy, and quality is "
                              f"{quality.value}; force a lossless action or set quality gated")


# ------------------------------------------------------------------ router -> decode worker


def generate_call(request, num_layers: int) -> GenerateCall:
    """A router's `GenerateRequest`; limits that depend on settings are the worker's to check."""
    if not request.request_id:
        raise InvalidArgument("request_id: required")
    which = request.WhichOneof("prompt")
    if which is None:
        raise InvalidArgument("prompt: set token_ids or text")
    forced = (action_from_proto(request.forced_action, num_layers)
              if request.HasField("forced_action") else None)
    sampling = SamplingParams()
    if request.HasField("sampling"):
        s = request.sampling
        try:
            sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p or 1.0,
                                      top_k=s.top_k, seed=s.seed)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
    quality = quality_from_proto(request.quality, unspecified=True)
    check_forced_quality(forced, quality)
    return GenerateCall(
        request_id=request.request_id,
        text=request.text if which == "text" else None,
        token_ids=list(request.token_ids.ids) if which == "token_ids" else None,
        max_new_tokens=request.max_new_tokens, sampling=sampling, forced_action=forced,
        stop_at_eos=request.stop_at_eos if request.HasField("stop_at_eos") else True,
        forced_delivery=(delivery_from_proto(request.forced_schedule)
                         if request.HasField("forced_schedule") else None),
        quality=quality)


def token_response(token: int, text: str):
    return rekv_pb2.GenerateResponse(token_ids=[token], text=text)


def summary_response(done: Completion):
    h = done.handoff
    summary = rekv_pb2.Summary(
        request_id=done.request_id, prompt_tokens=done.prompt_tokens,
        generated_tokens=done.generated_tokens, finish_reason=done.finish_reason,
        ttft_ms=done.ttft_ms, request_ms=done.request_ms,
        action=action_to_proto(h.action), action_kind=h.action.kind.value,
        bytes=wire_bytes_to_proto(h.bytes), predicted_handoff_ms=h.predicted_ms,
        measured_handoff_ms=h.measured_ms, fallback=h.fallback, fallback_reason=h.fallback_reason,
        fallback_scope=h.fallback_scope, recomputed_layers=h.recomputed_layers,
        quality=quality_to_proto(done.quality),
        timings=rekv_pb2.HandoffTimings(prefill_ms=h.prefill_ms, q_ms=h.q_ms, h_ms=h.h_ms,
                                        x_ms=h.x_ms, r_ms=h.r_ms, j_ms=h.j_ms))
    if h.delivery is not None:
        summary.schedule.CopyFrom(delivery_to_proto(h.delivery))
    return rekv_pb2.GenerateResponse(summary=summary)


# ------------------------------------------------------------ decode worker -> prefill worker


def handoff_request(call: HandoffCall):
    offer, costs = call.offer, call.offer.costs
    evidence = costs.evidence
    measured = [rekv_pb2.MeasuredHandoffs(action=action_to_proto(action),
                                          median_ms=m.median_ms, median_prompt_len=m.prompt_len,
                                          count=m.count, pipelined=pipelined)
                for pipelined, by_action in ((False, evidence.measured),
                                             (True, evidence.measured_pipelined))
                for action, m in by_action.items()]
    request = rekv_pb2.HandoffRequest(
        request_id=call.request_id, transfer_id=call.transfer_id, token_ids=call.token_ids,
        offer=rekv_pb2.DecodeOffer(
            ucx_address=offer.address, codecs=list(offer.codecs), model=offer.model,
            num_layers=offer.num_layers, queue_depth=offer.queue_depth,
            handoffs_in_flight=offer.handoffs_in_flight, computing=offer.computing,
            backlog_ms=offer.backlog_ms, planned_transfers=list(offer.planned),
            suffix_ms_per_layer=costs.suffix_ms_per_layer,
            restore_ms_per_mib=costs.restore_ms_per_mib, join_ms=costs.join_ms,
            message_ms=costs.message_ms, **_measured_only(link_gbps=costs.link_gbps,
                                                          suffix_scale=costs.suffix_scale),
            measured_over_model={kind.value: ratio
                                 for kind, ratio in costs.evidence.over_model.items()},
            measured=measured, accepts_streamed=offer.accepts_streamed,
            accepts_pipelined=offer.accepts_pipelined, boundary_chunk_tokens=offer.chunk_tokens,
            accepts_token_split=offer.accepts_token_split, running_batch=offer.running_batch,
            accepts_progressive=offer.accepts_progressive, model_fingerprint=offer.fingerprint,
            accepts_layer_split=offer.accepts_layer_split, itl_budget_ms=offer.itl_budget_ms,
            decode_step_ms=offer.decode_step_ms))
    if call.forced_action is not None:
        request.forced_action.CopyFrom(action_to_proto(call.forced_action))
    if call.forced_delivery is not None:
        request.forced_schedule.CopyFrom(delivery_to_proto(call.forced_delivery))
    request.handoff_key = call.sealing.key or b""
    request.encrypt_data_plane = call.sealing.encrypted
    request.quality = quality_to_proto(call.quality)
    return request


def handoff_call(request, model: str, num_layers: int) -> HandoffCall:
    """A decode worker's `HandoffRequest` to a prefill worker serving `model` with `num_layers`.
    Evidence entries this side cannot read (an unknown kind or codec, a cut beyond L) are left out
    and logged: they inform the choice, they do not make the call invalid."""
    if not request.transfer_id:
        raise InvalidArgument("transfer_id: required")
    if not request.token_ids:
        raise InvalidArgument("token_ids: must not be empty")
    if len(request.handoff_key) != KEY_BYTES:
        raise InvalidArgument(f"handoff_key: must be {KEY_BYTES} bytes, got "
                              f"{len(request.handoff_key)}")
    offer = request.offer
    if offer.model != model or offer.num_layers != num_layers:
        raise InvalidArgument(f"offer.model: decode runs {offer.model!r} with "
                              f"{offer.num_layers} layers, prefill {model!r} with {num_layers}")
    _check_fingerprint(offer.model_fingerprint)
    _check_data_plane_address(offer.ucx_address)
    unknown = [c for c in offer.codecs if c not in codec_names()]
    if unknown:
        raise InvalidArgument(f"offer.codecs: unknown codec(s) {unknown}")
    costs = DecodeCosts(
        suffix_ms_per_layer=_amount(offer.suffix_ms_per_layer, "offer.suffix_ms_per_layer"),
        restore_ms_per_mib={codec: _amount(ms, f"offer.restore_ms_per_mib[{codec!r}]")
                            for codec, ms in offer.restore_ms_per_mib.items()},
        join_ms=_amount(offer.join_ms, "offer.join_ms"),
        message_ms=_amount(offer.message_ms, "offer.message_ms"),
        link_gbps=(_rate(offer.link_gbps, "offer.link_gbps") if offer.HasField("link_gbps")
                   else None),
        evidence=_evidence(offer, num_layers),
        suffix_scale=_scale(offer.suffix_scale) if offer.HasField("suffix_scale") else None)
    forced = (action_from_proto(request.forced_action, num_layers)
              if request.HasField("forced_action") else None)
    quality = quality_from_proto(request.quality)  # the decode worker resolved its default
    check_forced_quality(forced, quality)
    chunk = delivery_from_proto(rekv_pb2.Schedule(
        boundary_chunk_tokens=offer.boundary_chunk_tokens), "offer").chunk_tokens
    return HandoffCall(
        request_id=request.request_id, transfer_id=request.transfer_id,
        token_ids=list(request.token_ids), forced_action=forced,
        sealing=Sealing(bytes(request.handoff_key), request.encrypt_data_plane,
                        bytes.fromhex(offer.model_fingerprint)),
        forced_delivery=(delivery_from_proto(request.forced_schedule)
                         if request.HasField("forced_schedule") else None),
        quality=quality,
        offer=DecodeOffer(model=offer.model, num_layers=offer.num_layers,
                          address=offer.ucx_address, codecs=tuple(offer.codecs),
                          queue_depth=offer.queue_depth,
                          handoffs_in_flight=offer.handoffs_in_flight, costs=costs,
                          accepts_streamed=offer.accepts_streamed,
                          accepts_pipelined=offer.accepts_pipelined, chunk_tokens=chunk,
                          accepts_token_split=offer.accepts_token_split,
                          accepts_progressive=offer.accepts_progressive, computing=offer.computing,
                          accepts_layer_split=offer.accepts_layer_split,
                          backlog_ms=_amount(offer.backlog_ms, "offer.backlog_ms"),
                          planned=_planned(offer.planned_transfers),
                          fingerprint=offer.model_fingerprint,
                          running_batch=offer.running_batch,
                          itl_budget_ms=_amount(offer.itl_budget_ms, "offer.itl_budget_ms"),
                          decode_step_ms=_amount(offer.decode_step_ms, "offer.decode_step_ms")))


def _check_fingerprint(fingerprint: str) -> None:
    """Every decode worker sends its model's fingerprint; the prefill side compares it."""
    if not fingerprint:
        raise InvalidArgument("offer.model_fingerprint: required (the decode worker's model "
                              "fingerprint, 64 hex digits)")
    if not is_fingerprint(fingerprint):
        raise InvalidArgument(f"offer.model_fingerprint: must be 64 lower-case hex digits, got "
                              f"{fingerprint[:80]!r}")


def _planned(ids) -> frozenset[str]:
    if len(ids) > MAX_PLANNED_TRANSFERS:
        raise InvalidArgument(f"offer.planned_transfers: {len(ids)} ids exceed the limit of "
                              f"{MAX_PLANNED_TRANSFERS}")
    return frozenset(ids)


def _check_data_plane_address(address: str, field: str = "offer.ucx_address") -> None:
    """host:port with a port in 1..65535 (an IPv6 host in brackets), or an in-process link's."""
    if not address:
        raise InvalidArgument(f"{field}: required")
    if address.startswith("inprocess:"):
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{field}: {address[:80]!r} is not host:port")


def connect_call(request) -> ConnectCall:
    """A `ConnectRequest`, checked: the data-plane address, and the probe's id and key."""
    _check_data_plane_address(request.ucx_address, "ucx_address")
    if request.probe_id and len(request.probe_key) != KEY_BYTES:
        raise InvalidArgument(f"probe_key: must be {KEY_BYTES} bytes with a probe_id, got "
                              f"{len(request.probe_key)}")
    return ConnectCall(request.ucx_address, request.probe_id or None,
                       bytes(request.probe_key) if request.probe_id else None)


def connect_request(call: ConnectCall):
    return rekv_pb2.ConnectRequest(ucx_address=call.address, probe_id=call.probe_id or "",
                                   probe_key=call.probe_key or b"")


def connect_response(connected: Connected):
    return rekv_pb2.ConnectResponse(connected_now=connected.connected_now,
                                    connect_ms=connected.connect_s * 1e3,
                                    probe_bytes=connected.probe_bytes,
                                    probe_ms=connected.probe_s * 1e3)


def _measured_only(**values: float | None) -> dict[str, float]:
    """The optional offer fields that hold a measurement (unset: not measured yet)."""
    return {name: value for name, value in values.items() if value is not None}


def _scale(value: float) -> float:
    """`offer.suffix_scale`, when set: within (0, MAX_SUFFIX_SCALE]; it multiplies the prefill
    side's own compute figures, so an absurd one must not reach them."""
    if not 0.0 < value <= MAX_SUFFIX_SCALE:  # NaN fails too
        raise InvalidArgument(f"offer.suffix_scale: must lie in (0, {MAX_SUFFIX_SCALE:g}] when "
                              f"set (unset: not measured), got {value}")
    return value


def _rate(value: float, field: str) -> float:
    """A measured rate from a peer, when set: finite and > 0 (unset: not measured)."""
    if not 0 < value < math.inf:
        raise InvalidArgument(f"{field}: must be a finite number > 0 when set (unset: not "
                              f"measured), got {value}")
    return value


def _amount(value: float, field: str) -> float:
    """A time, rate or size from a peer: finite and >= 0 (NaN fails both)."""
    if not 0 <= value < math.inf:
        raise InvalidArgument(f"{field}: must be a finite number >= 0, got {value}")
    return value


def _evidence(offer, num_layers: int) -> Evidence:
    kinds = {kind.value: kind for kind in ActionKind}
    over_model = {}
    for kind, ratio in offer.measured_over_model.items():
        if kind in kinds and 0 < ratio < math.inf:
            over_model[kinds[kind]] = ratio
        else:
            log.warning("offer.measured_over_model: %r: %r left out", kind, ratio)
    measured, pipelined = {}, {}
    for m in offer.measured:
        try:
            action = action_from_proto(m.action, num_layers, "offer.measured.action")
        except InvalidArgument as exc:
            log.warning("%s: left out", exc)
            continue
        if not (0 <= m.median_ms < math.inf and m.count):
            log.warning("offer.measured: %s with median %r ms over %d left out", action,
                        m.median_ms, m.count)
            continue
        (pipelined if m.pipelined else measured)[action] = Measured(
            m.median_ms, m.median_prompt_len, m.count)
    return Evidence(over_model, measured, pipelined)


def handoff_response(reply: HandoffReply):
    return rekv_pb2.HandoffResponse(
        action=action_to_proto(reply.action), action_kind=reply.action.kind.value,
        predicted_ms=reply.predicted_ms, model_ms=reply.model_ms,
        candidates=[rekv_pb2.Candidate(action=action_to_proto(p.action),
                                       action_kind=p.action.kind.value, predicted_ms=ms,
                                       bytes=p.bytes)
                    for p, ms in reply.candidates],
        prefill_ms=reply.prefill_ms, q_ms=reply.q_ms, send_ms=reply.send_ms,
        bytes=wire_bytes_to_proto(reply.bytes), link_gbps_estimate=reply.link_gbps,
        queue_depth=reply.queue_depth, schedule=delivery_to_proto(reply.delivery))


def handoff_reply(response, num_layers: int) -> HandoffReply:
    """The prefill worker's answer (its candidates are for its logs and are not read back)."""
    return HandoffReply(
        action=action_from_proto(response.action, num_layers, "action"),
        predicted_ms=_amount(response.predicted_ms, "predicted_ms"),
        model_ms=_amount(response.model_ms, "model_ms"),
        prefill_ms=_amount(response.prefill_ms, "prefill_ms"),
        q_ms=_amount(response.q_ms, "q_ms"), send_ms=_amount(response.send_ms, "send_ms"),
        bytes=_wire_bytes_from_proto(response.bytes),
        link_gbps=_amount(response.link_gbps_estimate, "link_gbps_estimate"),
        queue_depth=response.queue_depth, delivery=delivery_from_proto(response.schedule,
                                                                       "schedule"))
