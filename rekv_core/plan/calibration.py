"""What each worker learns about its own costs, so the planner's eq. 9 describes this deployment.

Decode side, `DecodeCalibration`. From a profile file (or, without one, this machine's profile:
measured once and cached, `profile_cache.cached_profile`) it knows one layer's suffix cost at any
prompt length (γ, a `LayerCost`) and its restore cost per codec. From every handoff it completes
(`observe(HandoffObservation)`) it learns (the process's first handoff, which runs cold code paths,
teaches only the link estimate):

- γ's scale: the measured suffix time over what the profile predicts for it (EWMA);
- J, the join (EWMA);
- m, the fixed cost of one data-plane message: what a prefix's time leaves unexplained by its bytes
  on the wire and its restore, per message (EWMA), from prefixes the suffix did not hold back;
- the link rate: the median of its recent link samples (`LinkEstimate`; a sample is the bytes of a
  handoff's back-to-back messages over the time they took to land, see `transport.arrivals`, or a
  link probe's, `observe_probe`: the estimate's one writer);
- its recent handoffs by action and by kind (`RecentHandoffs`): the planner's `Evidence`.

`offer(prompt_len, load)` turns all of it into the `DecodeCosts` the worker sends with a request;
its link rate is None until the first sample. Until then the worker files its handoffs under the
link prior (the services' `link_gbps`).

Prefill side, `PrefillCalibration`: α, the encode cost per codec (profile or cached), γ_p, its
prefill's cost per layer (the profile's, scaled by what its prefills after the first took), and the
throughput of its own sends, which stands in for the link until the decode side has measured it
(it includes encoding, so it is only a fallback; before any send, the link prior).
`cost_inputs(shape, prompt_len, costs, ...)` joins the two sides' figures into the planner's
`CostInputs`, marking the link unmeasured while the decode side offers no rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from rekv_core.handoff import Order
from rekv_core.model.executor import Model
from rekv_core.model.shapes import ModelShape
from rekv_core.plan.cost import CostInputs
from rekv_core.plan.estimates import LINK_PRIOR_GBPS, Ewma, LayerCost, LinkEstimate
from rekv_core.plan.evidence import (CodecCost, DecodeCosts, Evidence, HandoffObservation,
                                     offered_suffix_scale)
from rekv_core.plan.measure import measure_codec_costs
from rekv_core.plan.planner import LINK_SAMPLE_BYTES
from rekv_core.plan.profile import Profile
from rekv_core.plan.profile_cache import STARTUP_CODEC_LENGTH, cached_profile
from rekv_core.plan.recent import RecentHandoffs
from rekv_core.units import MiB

# `LINK_SAMPLE_BYTES` (from the planner, whose unmeasured-link choice prefers an action that sends
# that much): a handoff's back-to-back runs must carry this much to time the link.

# While the suffix runs, the decode worker's UCX loop yields the core (`ucx_loop_nice`), so a prefix
# that ends within this factor of the suffix's time was held back by it: its X says how long the
# suffix took, not what a message costs.
PREFIX_HELD_BACK_RATIO = 1.2


@dataclass(frozen=True)
class Queues:
    """The load both pools carry as a request is planned (`cost.CostInputs`'s load fields)."""

    prefill_queue: int = 0  # other handoffs waiting for or running on the prefill's compute
    decode_queue: int = 0  # other requests computing on the decode worker now
    prefill_wait_ms: float = 0.0  # compute queued ahead on the prefill worker
    decode_wait_ms: float = 0.0  # compute committed ahead on the decode worker


def codec_costs(encode_ms_per_mib: dict[str, float], restore_ms_per_mib: dict[str, float]
                ) -> dict[str, CodecCost]:
    """The two sides' per-codec figures as one table (a side's missing figure: free)."""
    return {codec: CodecCost(encode_ms_per_mib.get(codec, 0.0),
                             restore_ms_per_mib.get(codec, 0.0))
            for codec in {**encode_ms_per_mib, **restore_ms_per_mib}}


class DecodeCalibration:
    """Thread-safe: its estimates lock themselves."""

    def __init__(self, shape: ModelShape, layer_cost: LayerCost,
                 restore_ms_per_mib: dict[str, float], recent: RecentHandoffs | None = None,
                 link_prior_gbps: float = LINK_PRIOR_GBPS):
        if link_prior_gbps <= 0:
            raise ValueError(f"link_gbps: must be positive, got {link_prior_gbps}")
        self.shape = shape
        self.layer_cost = layer_cost
        self.restore_ms_per_mib = dict(restore_ms_per_mib)
        self.recent = recent or RecentHandoffs()
        self.gamma_scale = Ewma(1.0)  # measured suffix time over the profile's prediction
        self.join_ms = Ewma(0.0)
        self.message_ms = Ewma(0.0)
        self.link = LinkEstimate(min_bytes=LINK_SAMPLE_BYTES)
        self.link_prior_gbps = link_prior_gbps
        self._warm = False  # a handoff has been observed

    @classmethod
    def for_model(cls, model: Model, codecs: tuple[str, ...], profile: str = "",
                  link_prior_gbps: float = LINK_PRIOR_GBPS) -> DecodeCalibration:
        """From a profile file, or this machine's cached profile when `profile` is empty
        (measured now if there is none); a codec the profile lacks is measured now too, never
        taken as free."""
        loaded = _profile(model, codecs, profile)
        return cls(model.shape, loaded.layer_cost,
                   _codec_costs(model, codecs, loaded.restore_ms_per_mib, restore=True),
                   link_prior_gbps=link_prior_gbps)

    @property
    def link_gbps(self) -> float:
        """The link estimate, or the prior before any sample: what handoffs are filed under."""
        return self.link.or_prior(self.link_prior_gbps)

    def suffix_ms_per_layer(self, prompt_len: int, load: float) -> float:
        """γ now: the profile's, scaled by what recent suffixes took, times `load`, the requests
        that would share this worker's compute (this one included)."""
        return self.layer_cost.at(prompt_len) * self.gamma_scale.value * max(1, load)

    def offer(self, prompt_len: int, load: float) -> DecodeCosts:
        link = self.link_gbps
        return DecodeCosts(
            suffix_ms_per_layer=self.suffix_ms_per_layer(prompt_len, load),
            restore_ms_per_mib=dict(self.restore_ms_per_mib), join_ms=self.join_ms.value,
            message_ms=self.message_ms.value, link_gbps=self.link.gbps,
            evidence=Evidence(self.recent.corrections(link),
                              self.recent.measured(prompt_len, link),
                              self.recent.measured(prompt_len, link, pipelined=True)),
            suffix_scale=(offered_suffix_scale(self.gamma_scale.value) if self.gamma_scale.samples
                          else None))

    def observe_probe(self, nbytes: int, seconds: float) -> float | None:
        """A link probe's sample (`handoff.probe`); the estimate after it."""
        return self.link.observe(nbytes, seconds)

    def observe(self, handoff: HandoffObservation) -> float | None:
        """Learn from one completed handoff; returns its link sample in Gb/s, if it had one."""
        t = handoff.timings
        sample_gbps = None
        if handoff.link_sample is not None:
            nbytes, seconds = handoff.link_sample
            sample_gbps = nbytes * 8 / seconds / 1e9
            self.link.observe(nbytes, seconds)
        if self._warm:  # the process's first handoff runs cold code paths: it sets no estimate
            self.join_ms.update(t.j_s * 1e3)
            self._observe_suffix(handoff)
            self._observe_prefix(handoff)
        self._warm = True
        self.recent.observe(handoff.action, handoff.prompt_len, handoff.modelled_ms,
                            handoff.timings.total_s * 1e3, self.link_gbps, handoff.pipelined)
        return sample_gbps

    def _observe_suffix(self, handoff: HandoffObservation) -> None:
        layers = self.shape.num_layers - handoff.action.cut
        expected = self.layer_cost.at(handoff.prompt_len) * layers * max(1, handoff.load)
        if layers and expected > 0:
            self.gamma_scale.update(handoff.timings.r_s * 1e3 / expected)

    def _observe_prefix(self, handoff: HandoffObservation) -> None:
        """m from X: what the bytes and the restore do not explain, per message. Only from
        transfer-only, or a prefix that was still arriving well after the suffix was done; not
        from the per-layer form, whose X holds its recompute."""
        action, t = handoff.action, handoff.timings
        if action.cut == 0 or self.link.samples == 0 or handoff.streamed or action.layer_split:
            return
        if t.r_s > 0 and t.x_s <= PREFIX_HELD_BACK_RATIO * t.r_s:
            return
        layers = action.cut
        wire_ms = (handoff.wire.prefix + handoff.wire.scales) * 8 / (self.link_gbps * 1e9) * 1e3
        restore_ms = (self.restore_ms_per_mib.get(action.codec, 0.0) * layers
                      * self.shape.kv_layer_bytes(handoff.prompt_len) / MiB)
        # X runs from the boundary; transfer-only has none, and its X from the receive's start
        # holds the prefill (which the prefix follows) too
        x_s = t.x_s if action.sends_boundary else max(0.0, t.h_s + t.x_s - handoff.prefill_s)
        self.message_ms.update(max(0.0, (x_s * 1e3 - wire_ms - restore_ms) / layers))


class PrefillCalibration:
    def __init__(self, quantize_ms_per_mib: dict[str, float],
                 link_prior_gbps: float = LINK_PRIOR_GBPS, layer_cost: LayerCost | None = None):
        if link_prior_gbps <= 0:
            raise ValueError(f"link_gbps: must be positive, got {link_prior_gbps}")
        self.quantize_ms_per_mib = dict(quantize_ms_per_mib)
        # bytes over seconds of whole sends, encoding included: the link's stand-in until the
        # decode side has measured it
        self.send_throughput = LinkEstimate()
        self.link_prior_gbps = link_prior_gbps
        self.layer_cost = layer_cost  # γ_p by prompt length; None: the prefill is not counted
        # measured prefill compute over the layer cost's, for prefills run whole (False) and
        # streamed (True): a streamed prefill computes while its layers are sent, and where
        # the sends share its cores (a CPU) each layer takes longer
        self.gamma_scale = {False: Ewma(1.0), True: Ewma(1.0)}
        self._warm = False  # a prefill has been observed

    @classmethod
    def for_model(cls, model: Model, codecs: tuple[str, ...], profile: str,
                  link_prior_gbps: float) -> PrefillCalibration:
        """From a profile file, or this machine's cached profile when `profile` is empty
        (measured now if there is none); a codec the profile lacks is measured now too, never
        taken as free."""
        loaded = _profile(model, codecs, profile)
        return cls(_codec_costs(model, codecs, loaded.quantize_ms_per_mib, restore=False),
                   link_prior_gbps, loaded.layer_cost)

    def link_gbps(self, offered_gbps: float | None) -> float:
        """The decode side's measurement of the link when it has one, else this side's send
        throughput, else the prior."""
        if offered_gbps is not None:
            return offered_gbps
        return self.send_throughput.or_prior(self.link_prior_gbps)

    def prefill_ms_per_layer(self, prompt_len: int, streamed: bool = False,
                             peer_scale: float | None = None) -> float:
        """γ_p now: the layer cost at this length, scaled by what recent prefills of the same
        kind (streamed or whole) took; by the other kind's until one of this kind is seen; by
        `peer_scale` (the decode side's measured suffix over its profile) until any is:
        the profiles of both sides err alike (a layer timed alone, not in the model's pass), so
        the side that measured first must not make the other look cheap."""
        if self.layer_cost is None:
            return 0.0
        scale = self.gamma_scale[streamed]
        if scale.samples == 0:
            scale = self.gamma_scale[not streamed]
        if scale.samples == 0 and peer_scale is not None:
            return self.layer_cost.at(prompt_len) * peer_scale
        return self.layer_cost.at(prompt_len) * scale.value

    def cost_inputs(self, shape: ModelShape, prompt_len: int, costs: DecodeCosts,
                    streamed: bool = False, chunk_tokens: int = 0,
                    orders: frozenset[Order] = frozenset({Order.LAYERS}),
                    load: Queues = Queues(), token_splits: bool = False,
                    progressive: bool = False, layer_splits: bool = False) -> CostInputs:
        return CostInputs(shape, prompt_len, self.link_gbps(costs.link_gbps),
                          costs.suffix_ms_per_layer,
                          codec_costs(self.quantize_ms_per_mib, costs.restore_ms_per_mib),
                          costs.join_ms, message_ms=costs.message_ms,
                          prefill_ms_per_layer=self.prefill_ms_per_layer(
                              prompt_len, streamed, costs.suffix_scale),
                          streamed=streamed, chunk_tokens=chunk_tokens, orders=orders,
                          link_measured=costs.link_gbps is not None,
                          prefill_queue=load.prefill_queue, decode_queue=load.decode_queue,
                          prefill_wait_ms=load.prefill_wait_ms,
                          decode_wait_ms=load.decode_wait_ms, token_splits=token_splits,
                          progressive=progressive, layer_splits=layer_splits)

    def observe_prefill(self, layers: int, prompt_len: int, seconds: float,
                        streamed: bool = False) -> None:
        """Learn γ_p's scale from a prefill of `layers` layers that took `seconds` (`streamed`:
        computed while its layers were sent)."""
        if self.layer_cost is None or layers == 0:
            return
        if not self._warm:  # the first prefill runs cold code paths
            self._warm = True
            return
        expected = self.layer_cost.at(prompt_len) * layers
        if expected > 0 and seconds > 0:
            self.gamma_scale[streamed].update(seconds * 1e3 / expected)

    def observe_send(self, nbytes: int, seconds: float) -> None:
        self.send_throughput.observe(nbytes, seconds)


def _profile(model: Model, codecs: tuple[str, ...], path: str) -> Profile:
    """The profile file at `path`, or this machine's cached profile when `path` is empty."""
    return Profile.load(path) if path else cached_profile(model, codecs)


def _codec_costs(model: Model, codecs: tuple[str, ...], known: dict[str, float], restore: bool
                 ) -> dict[str, float]:
    """Per-MiB cost of each codec (decode when `restore`, else encode): `known`'s figure where
    it has one, else measured on this machine now."""
    which = 1 if restore else 0
    return {codec: known[codec] if codec in known else measure_codec_costs(
        codec, model.shape, STARTUP_CODEC_LENGTH, model.device)[which] for codec in codecs}
