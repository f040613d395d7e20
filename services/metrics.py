"""The Prometheus metrics of both services (prometheus-client), served on each one's own port.

Names follow Prometheus conventions: seconds and bytes in base units, `_total` on counters. Each
service gets its own `CollectorRegistry`, so two services in one process (tests) stay apart.
Histograms share buckets from 1 ms to 30 s. `rekv_model_info{model, fingerprint}` says which model
each service runs (`record_model`); the decode service's `rekv_prefill_incompatible{peer}` is 1
for each prefill replica it found serving another model, while it is left out
(`watch_incompatible`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily

from rekv_core.handoff import Action, WireBytes
from rekv_core.handoff.transfer import TransferState
from rekv_core.plan.evidence import HandoffObservation

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BYTE_KINDS = ("boundary", "prefix", "scales", "tokens", "head")
KL_BUCKETS = (1e-5, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
SHARE_BUCKETS = (0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


class ServiceMetrics:
    def __init__(self, role: str):
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"rekv_{name}_seconds", doc, buckets=BUCKETS, registry=r)

        self.handoff = histogram("handoff", "Handoff total: from the request for the KV to a "
                                 "complete cache (decode) or to the last byte sent (prefill)")
        self.prefill = histogram("prefill", "Prefill compute on the prefill worker")
        self.quantize = histogram("quantize", "Q: encoding the prefix layers")
        self.boundary = histogram("boundary_transfer", "H: until the boundary h_c is received")
        self.prefix = histogram("prefix_transfer", "X: prefix transfer and restore")
        self.suffix = histogram("suffix", "R: suffix recompute on the decode worker")
        self.join = histogram("join", "J: joining the two branches")
        self.ttft = histogram("ttft", "Time to first token, from Generate's arrival")
        self.request = histogram("request", "A whole request, until its last message")
        self.prediction_error = Histogram(
            "rekv_handoff_prediction_error_ratio", "Measured over predicted handoff time",
            buckets=(0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0), registry=r)
        direction = "sent" if role == "prefill" else "received"
        self.bytes = Counter(f"rekv_{direction}_bytes", f"Data-plane bytes {direction}, by kind",
                             ["kind"], registry=r)
        self.bf16_bytes = Counter(
            "rekv_bf16_equivalent_bytes", f"Data-plane bytes the same handoffs would have "
            f"{direction} as full BF16 transfer: the reference of the saving", registry=r)
        self.requests = Counter("rekv_requests", "Handled requests by action",
                                ["action", "codec", "cut"], registry=r)
        self.failures = Counter("rekv_failures", "Failed requests by reason", ["reason"],
                                registry=r)
        self.quality = Counter("rekv_quality_requests", "Completed requests by the quality setting "
                               "that applied (decode)", ["quality"], registry=r)
        self.fallbacks = Counter("rekv_fallbacks", "Handoffs that fell back to recomputing the "
                                 "prompt from its token ids", ["reason"], registry=r)
        self.fallback_recompute = Histogram(
            "rekv_fallback_recompute_seconds", "A fallback's recompute on the decode worker, by "
            "scope: partial (the lost layers 0..m) or full (the whole prompt)", ["scope"],
            buckets=BUCKETS, registry=r)
        self.fallback_layers = Counter(
            "rekv_fallback_recomputed_layers", "Layers the fallbacks recomputed, by scope",
            ["scope"], registry=r)
        self.in_flight = Gauge("rekv_handoffs_in_flight", "Handoffs now in progress", registry=r)
        self.transfers = Gauge("rekv_transfers", "Live transfers by state (TransferState)",
                               ["state"], registry=r)
        self.inflight_bytes = Gauge(
            "rekv_inflight_bytes", "Memory declared by the admitted calls (admission control)",
            registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, open fds, CPU seconds
        self.queue = Gauge("rekv_queue_depth", "Requests waiting or running", registry=r)
        self.transport_pending = Gauge(
            "rekv_transport_pending", "Data-plane state still held: open or draining transfers "
            "(decode), messages not yet sent (prefill)", registry=r)
        self.connections = Gauge(
            "rekv_transport_connections", "Data-plane connections held: from live prefill "
            "workers (decode), to decode workers (prefill)", registry=r)
        self.model = Gauge("rekv_model_info", "1 for the model this service runs: its name and "
                           "fingerprint (weights, shape, dtype, tokenizer, wire and codec "
                           "versions)", ["model", "fingerprint"], registry=r)
        self.compute = Gauge("rekv_compute_info", "1 for what this service computes on: the "
                             "device, the dtype and why that dtype (set, or auto's reason: the "
                             "CPU's native BF16 instruction, or why it has none)",
                             ["device", "dtype", "reason"], registry=r)
        self._incompatible = _IncompatiblePeers(dict)
        r.register(self._incompatible)
        self.canary = CanaryMetrics(r) if role == "decode" else None
        self.engine = EngineMetrics(r) if role == "decode" else None
        self.scheduler = PrefillSchedulerMetrics(r) if role == "prefill" else None
        self.layers = LayerBatcherMetrics(r) if role == "decode" else None
        self.link = Gauge("rekv_link_bandwidth_estimate_gbps",
                          "The link rate estimate, Gb/s: the one the decode worker measures and "
                          "offers (decode), the one the planner last used (prefill)", registry=r)

    def record_model(self, name: str, fingerprint: str) -> None:
        self.model.labels(name, fingerprint).set(1)

    def record_compute(self, device: str, dtype: str, reason: str) -> None:
        self.compute.labels(device, dtype, reason).set(1)

    def watch_incompatible(self, peers: Callable[[], Mapping[str, bool]]) -> None:
        """Export `peers()` (decode): each prefill replica's address, and whether it is left out
        now for serving another model."""
        self._incompatible.peers = peers

    def watch_transfers(self, count) -> None:
        """Export `count(state)`, the live transfers in each unfinished state."""
        for state in TransferState:
            if state not in (TransferState.DONE, TransferState.FAILED):
                self.transfers.labels(state.name.lower()).set_function(
                    lambda state=state: count(state))

    def record_fallback(self, scope: str, layers: int, seconds: float) -> None:
        """A failed handoff's recompute here: `scope` partial or full, `layers` recomputed."""
        self.fallback_recompute.labels(scope).observe(seconds)
        self.fallback_layers.labels(scope).inc(layers)

    def record_received(self, handoff: HandoffObservation, predicted_ms: float,
                        bf16_bytes: int) -> None:
        """The decode side of one completed handoff; `bf16_bytes`: what full BF16 transfer of the
        same prompt would have moved."""
        t, action = handoff.timings, handoff.action
        self.handoff.observe(handoff.handoff_s)
        self.boundary.observe(handoff.boundary_s)
        self.prefix.observe(t.x_s)
        self.suffix.observe(t.r_s)
        self.join.observe(t.j_s)
        self._count(action, handoff.wire, bf16_bytes)
        if predicted_ms > 0:
            self.prediction_error.observe(handoff.timings.total_s * 1e3 / predicted_ms)

    def record_sent(self, action: Action, prefill_s: float, quantize_s: float, send_s: float,
                    wire: WireBytes, bf16_bytes: int) -> None:
        """The prefill side of one completed handoff."""
        self.handoff.observe(send_s)
        self.prefill.observe(prefill_s)
        self.quantize.observe(quantize_s)
        self._count(action, wire, bf16_bytes)

    def _count(self, action: Action, wire: WireBytes, bf16_bytes: int) -> None:
        self.bf16_bytes.inc(bf16_bytes)
        for kind in BYTE_KINDS:
            amount = getattr(wire, kind)
            if amount:
                self.bytes.labels(kind).inc(amount)
        self.requests.labels(action.kind.value, action.codec, str(action.cut)).inc()

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port


class _IncompatiblePeers:
    """A collector: one sample per prefill replica the pool knows, read when scraped."""

    def __init__(self, peers: Callable[[], Mapping[str, bool]]):
        self.peers = peers

    def collect(self):
        family = GaugeMetricFamily(
            "rekv_prefill_incompatible", "1 while this prefill replica is left out because it "
            "refused the offer for serving another model (FAILED_PRECONDITION), else 0",
            labels=["peer"])
        for address, incompatible in sorted(self.peers().items()):
            family.add_metric([address], 1.0 if incompatible else 0.0)
        yield family
class CanaryMetrics:
    """The decode worker's quality canary (services/decode/canary.py), per action."""

    def __init__(self, registry: CollectorRegistry):
        labels = ["codec", "cut"]
        self.checks = Counter("rekv_canary_checks", "Canary checks of lossy handoffs by outcome: "
                              "agree, disagree, or skipped (not_sampled, busy)",
                              [*labels, "outcome"], registry=registry)
        self.kl = Histogram("rekv_canary_kl_divergence", "KL(reference || lossy) at the first "
                            "decoded position, nats", labels, buckets=KL_BUCKETS,
                            registry=registry)
        self.agreement = Histogram(
            "rekv_canary_top1_agreement_ratio", "Share of a check's positions (the first token, "
            "the first decoded position, the continuation) whose top-1 agrees", labels,
            buckets=SHARE_BUCKETS, registry=registry)
        self.window = Gauge("rekv_canary_window_agreement_ratio", "Top-1 agreement over the "
                            "positions of the action's last canary_window checks", labels,
                            registry=registry)
        self.seconds = Histogram("rekv_canary_seconds", "Compute of one canary check",
                                 buckets=BUCKETS, registry=registry)


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineMetrics:
    """The decode engine (rekv_core.engine): its `EngineObserver`, and gauges of its batch."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.itl = Histogram("rekv_itl_seconds", "Inter-token latency: between two tokens of a "
                             "stream (after its first)", buckets=BUCKETS, registry=r)
        self.batch_size = Histogram("rekv_decode_batch_size", "Streams in each batched decode "
                                    "step", buckets=BATCH_BUCKETS, registry=r)
        self.step = Histogram("rekv_decode_step_seconds", "One batched decode step",
                              buckets=BUCKETS, registry=r)
        self.turn = Histogram("rekv_engine_turn_seconds", "One turn of prefill-like work (suffix, "
                              "token-only, recompute) between two decode steps", buckets=BUCKETS,
                              registry=r)
        self.turn_work = Counter("rekv_engine_turn_token_layers", "Prefill-like work done in the "
                                 "engine's turns, token-layers (rows x layers)", registry=r)
        self.running = Gauge("rekv_decode_batch", "Streams in the running batch", registry=r)
        self.waiting = Gauge("rekv_decode_waiting", "Streams waiting to join the batch",
                             registry=r)
        self.budget = Gauge("rekv_itl_budget_seconds", "The ITL budget the engine sizes its "
                            "turns to", registry=r)

    def watch(self, running: Callable[[], int], waiting: Callable[[], int],
              budget_s: float) -> None:
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.budget.set(budget_s)

    def stepped(self, batch: int, seconds: float) -> None:
        self.batch_size.observe(batch)
        self.step.observe(seconds)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def turned(self, token_layers: int, seconds: float, batch: int) -> None:
        self.turn.observe(seconds)
        self.turn_work.inc(token_layers)


ROW_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class PrefillSchedulerMetrics:
    """The prefill worker's scheduler (rekv_core.engine.PrefillScheduler): the prompts in it, and
    the prompts and rows of each batched call."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.prompts = Gauge("rekv_prefill_scheduled_prompts", "Prompts in the prefill "
                             "scheduler, queued or computing", registry=r)
        self.batch_prompts = Histogram("rekv_prefill_batch_prompts", "Prompts in each batched "
                                       "prefill call (one layer)", buckets=BATCH_BUCKETS,
                                       registry=r)
        self.batch_rows = Histogram("rekv_prefill_batch_rows", "Prompt rows in each batched "
                                    "prefill call (one layer)", buckets=ROW_BUCKETS, registry=r)

    def watch(self, prompts: Callable[[], int]) -> None:
        self.prompts.set_function(prompts)

    def called(self, prompts: int, rows: int, seconds: float) -> None:
        self.batch_prompts.observe(prompts)
        self.batch_rows.observe(rows)


class LayerBatcherMetrics:
    """The decode worker's layer batcher (rekv_core.engine.LayerBatcher): the handoffs' layer runs
    in it, and the runs sharing each call."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.runs = Gauge("rekv_decode_layer_runs", "Layer runs of handoffs (suffix, token-only, "
                          "recompute) in the decode worker's layer batcher, waiting or computing",
                          registry=r)
        self.batch_runs = Histogram("rekv_decode_layer_batch_runs", "Layer runs sharing each "
                                    "call of the decode worker's layer batcher",
                                    buckets=BATCH_BUCKETS, registry=r)

    def watch(self, runs: Callable[[], int]) -> None:
        self.runs.set_function(runs)

    def called(self, runs: int, rows: int, seconds: float) -> None:
        self.batch_runs.observe(runs)
