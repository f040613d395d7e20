"""The Prometheus metrics of both services (prometheus-client), served on each one's own port.

Names follow Prometheus conventions: seconds and bytes in base units, `_total` on counters. Each
service gets its own `CollectorRegistry`, so two services in one process (tests) stay apart.
Histograms share buckets from 1 ms to 30 s.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)

from rekv_core.handoff import Action, WireBytes
from rekv_core.handoff.transfer import TransferState
from rekv_core.plan.evidence import HandoffObservation

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BYTE_KINDS = ("boundary", "prefix", "scales", "tokens", "head")


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
        self.link = Gauge("rekv_link_bandwidth_estimate_gbps",
                          "The link rate estimate, Gb/s: the one the decode worker measures and "
                          "offers (decode), the one the planner last used (prefill)", registry=r)

    def watch_transfers(self, count) -> None:
        """Export `count(state)`, the live transfers in each unfinished state."""
        for state in TransferState:
            if state not in (TransferState.DONE, TransferState.FAILED):
                self.transfers.labels(state.name.lower()).set_function(
                    lambda state=state: count(state))

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
