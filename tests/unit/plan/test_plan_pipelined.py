"""The token-order (pipelined) prediction, worked by hand on a prompt of two boundary chunks.

The schedule `plan.cost` predicts for an interior cut c in token order: the prefill computes
chunk i up to the cut (its share of c·γ_p) and encodes its prefix rows (its share of c·α); its
boundary rows leave once computed and the link is free (rows × the row time, plus a message);
its prefix rows follow them (its share of the prefix bytes, plus c messages); the decode side
runs the suffix on each chunk once it has landed and the decode worker is free (its share of
R). H is the first chunk's arrival, X the prefix's end (its last restore) after it, the total
the later of the suffix and the prefix, with the link latency and the join. Each case below
puts a different branch on the critical path."""

import pytest

from rekv_core.handoff import Action, Order
from rekv_core.handoff.action import wire_bytes
from rekv_core.model.shapes import get_preset
from rekv_core.plan import CostInputs, predict
from rekv_core.plan.evidence import CodecCost
from rekv_core.units import BF16_BYTES, MiB

SHAPE = get_preset("smollm2-135m")  # d = 576, 30 layers
S, C = 512, 10  # two boundary chunks of 256 rows; the cut
ACTION = Action("int8", C, SHAPE.num_layers, boundary="splitzip")
WIRE = wire_bytes(ACTION, SHAPE, S)
LAYER_MIB = SHAPE.kv_layer_bytes(S) / MiB
BOUNDARY_ROW_MIB = SHAPE.hidden_size * BF16_BYTES / MiB  # one BF16 row of h_c


def _inputs(gbps, gamma_p, prefill_wait, decode_wait, m, k):
    return CostInputs(SHAPE, S, gbps, 2.0,
                      codec_costs={"int8": CodecCost(0.5 * k, 0.25 * k),
                                   "splitzip": CodecCost(0.125 * k, 0.0625 * k)},
                      join_ms=0.5, link_latency_ms=0.25, message_ms=m,
                      prefill_ms_per_layer=gamma_p, streamed=True, chunk_tokens=256,
                      orders=frozenset({Order.TOKENS}), prefill_wait_ms=prefill_wait,
                      decode_wait_ms=decode_wait)


def _by_hand(gbps, gamma_p, prefill_wait, decode_wait, m, k):
    """(total, H, X) of the module's schedule, chunk 1 then chunk 2, each half the prompt."""
    per_ms = gbps * 1e9 / 8 / 1e3  # bytes a millisecond
    row = WIRE.boundary / S / per_ms + (0.125 + 0.0625) * k * BOUNDARY_ROW_MIB
    prefix = (WIRE.prefix + WIRE.scales) / per_ms
    alpha, restore, r = 0.5 * k * LAYER_MIB, 0.25 * k * LAYER_MIB, 20 * 2.0
    # chunk 1
    computed_1 = prefill_wait + 0.5 * C * gamma_p
    encoded_1 = computed_1 + 0.5 * C * alpha
    arrived_1 = computed_1 + 256 * row + m  # the link is free
    link_free_1 = max(arrived_1, encoded_1) + 0.5 * prefix + C * m
    suffix_1 = max(arrived_1, decode_wait - 0.25) + 0.5 * r
    # chunk 2
    computed_2 = encoded_1 + 0.5 * C * gamma_p
    encoded_2 = computed_2 + 0.5 * C * alpha
    arrived_2 = max(computed_2, link_free_1) + 256 * row + m
    link_free_2 = max(arrived_2, encoded_2) + 0.5 * prefix + C * m
    suffix_2 = max(arrived_2, suffix_1) + 0.5 * r
    prefix_end = link_free_2 + 0.5 * C * restore
    return (0.25 + max(suffix_2, prefix_end) + 0.5, 0.25 + arrived_1,
            max(0.0, prefix_end - arrived_1))


@pytest.mark.parametrize("case", [
    (8.0, 1.0, 3.0, 40.0, 0.1, 1.0),  # the decode worker busy: its suffix ends last
    (0.05, 0.1, 0.0, 0.0, 0.1, 1.0),  # a slow link: the prefix ends last, chunk 2 waits for it
    (100.0, 0.01, 0.0, 0.0, 0.001, 0.01),  # all fast: the chunks land and the prefix ends in 1 ms
])
def test_the_pipelined_prediction_is_the_two_chunk_schedule(case):
    prediction = predict(ACTION, _inputs(*case))
    total, h, x = _by_hand(*case)
    assert prediction.pipelined
    assert prediction.total_ms == pytest.approx(total, rel=1e-12)
    assert prediction.h_ms == pytest.approx(h, rel=1e-12)
    assert prediction.x_ms == pytest.approx(x, rel=1e-12, abs=1e-12)
    assert (prediction.r_ms, prediction.j_ms) == (40.0, 0.5)
    assert prediction.bytes == WIRE.total and prediction.prefill_ms == C * case[1]
