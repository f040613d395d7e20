"""A token split's predicted time (`plan.cost`, `Action.split` l) against its schedule, laid out
here one resource at a time: the prefill's thread (every layer computed, each layer encoded, the
suffix layers' rows [l, S) only), the link (after a full prefill the boundary's rows [0, l) first,
streamed right after layer c − 1; each layer's bytes and a message as the prefill hands them over;
the head last, then the last layer's restore), and the decode side (its share of R = (L − c)·γ·l/S
per boundary chunk, from the chunk's arrival and no earlier than D_w). Every figure of the
prediction is checked, over both schedules, one and several chunks, a codec with scales, a coded
boundary, a backlog on either side, and splits that leave the suffix layers fewer rows than a
layer's share; and `split_costs`, the closed form's inputs, against the wire's bytes. Plain float
arithmetic: equal to 1e-12, on any CPU."""

import pytest

from rekv_core.handoff import Action
from rekv_core.handoff.action import wire_bytes
from rekv_core.model.blocks import chunk_bounds
from rekv_core.model.shapes import get_preset
from rekv_core.plan import CostInputs, predict
from rekv_core.plan.calibration import codec_costs
from rekv_core.plan.cost import split_actions, split_costs
from rekv_core.plan.token_split import best_split
from rekv_core.units import MiB

SHAPE = get_preset("smollm2-135m")
L = SHAPE.num_layers
EXACT = 1e-12  # relative: a dozen float64 operations' rounding, far below any term


def _inputs(**kwargs):
    base = dict(shape=SHAPE, prompt_len=2048, link_gbps=1.0, suffix_ms_per_layer=4.0,
                codec_costs=codec_costs({"int8": 0.5, "splitzip": 0.3},
                                        {"int8": 0.2, "bf16": 0.05, "splitzip": 0.4}),
                join_ms=1.5, link_latency_ms=0.7, message_ms=0.1, prefill_ms_per_layer=2.0,
                chunk_tokens=256, token_splits=True)
    base.update(kwargs)
    return CostInputs(**base)


def _schedule(action, inputs):
    """(T, H, X, R, J, bytes, prefill) of a token split, resource by resource."""
    S, c, l = inputs.prompt_len, action.cut, action.split
    rate = inputs.link_gbps * 1e9 / 8 / 1e3  # bytes per ms
    m, lat = inputs.message_ms, inputs.link_latency_ms
    layer_mib = SHAPE.kv_layer_bytes(S) / MiB
    cost = inputs.codec_cost(action.codec)
    alpha, restore = cost.encode_ms_per_mib * layer_mib, cost.restore_ms_per_mib * layer_mib
    kept = (S - l) / S
    codec = action.registered_codec
    whole = codec.layer_bytes((SHAPE.num_kv_heads, S, SHAPE.head_dim))
    rows = codec.layer_bytes((SHAPE.num_kv_heads, S - l, SHAPE.head_dim))
    wire = wire_bytes(action, SHAPE, S)
    coding = 0.0
    if action.boundary != "bf16":
        b = inputs.codec_cost(action.boundary)
        coding = (b.encode_ms_per_mib + b.restore_ms_per_mib) * SHAPE.hidden_size * 2 / MiB
    boundary_row = wire.boundary / l / rate + coding

    arrivals = []  # (ms, rows) of each boundary chunk

    def boundary(link):
        for s0, s1 in chunk_bounds(l, inputs.chunk_tokens):
            link += (s1 - s0) * boundary_row + m
            arrivals.append((link, s1 - s0))
        return link

    prefill = link = inputs.prefill_wait_ms
    if not inputs.streamed:
        prefill = link = inputs.prefill_wait_ms + L * inputs.prefill_ms_per_layer
        link = boundary(link)
    for i in range(L):
        prefix_layer = i < c
        if inputs.streamed:
            prefill += inputs.prefill_ms_per_layer
        prefill += alpha if prefix_layer else alpha * kept
        sent = whole if prefix_layer else rows
        link = max(link, prefill) + (sent.data + sent.scales) / rate + m
        if inputs.streamed and i == c - 1:
            link = boundary(link)
    prefix_end = link + SHAPE.hidden_size * 2 / rate + m + restore * max(kept, 1 / L)
    r = (L - c) * inputs.suffix_ms_per_layer * l / S
    suffix = max(0.0, inputs.decode_wait_ms - lat)
    for at, n in arrivals:
        suffix = max(suffix, at) + r * n / l
    first = arrivals[0][0]
    return (lat + max(suffix, prefix_end) + inputs.join_ms, lat + first,
            max(0.0, prefix_end - first), r, inputs.join_ms, wire.total,
            L * inputs.prefill_ms_per_layer)


CASES = {
    "after-prefill": {},
    "streamed": dict(streamed=True),
    "one-chunk": dict(chunk_tokens=0),
    "streamed-one-chunk": dict(streamed=True, chunk_tokens=0),
    "fast-link": dict(link_gbps=400.0),
    "streamed-fast-link": dict(streamed=True, link_gbps=400.0, prefill_ms_per_layer=30.0),
    "busy-decode": dict(decode_wait_ms=5000.0),
    "streamed-busy-decode": dict(streamed=True, decode_wait_ms=5000.0),
    "busy-prefill": dict(prefill_wait_ms=300.0, prefill_ms_per_layer=3.0),
    "streamed-busy-prefill": dict(streamed=True, prefill_wait_ms=300.0, prefill_ms_per_layer=3.0),
    "dear-recompute": dict(suffix_ms_per_layer=200.0),
    "streamed-dear-recompute": dict(streamed=True, suffix_ms_per_layer=200.0),
    # nothing on the prefill side, a link too fast to matter: the suffix starts at once
    "instant-prefill": dict(streamed=True, link_gbps=1e6, prefill_ms_per_layer=0.0,
                            codec_costs={}, message_ms=0.0, suffix_ms_per_layer=50.0),
}
ACTIONS = {
    "int8": lambda S: Action("int8", 10, L, split=1024),
    "bf16": lambda S: Action("bf16", 20, L, split=512),
    "int8-splitzip": lambda S: Action("int8", 10, L, "splitzip", split=1024),
    "one-row-chunk-left": lambda S: Action("int8", 25, L, split=S - 256),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("make", ACTIONS)
def test_a_token_split_predicts_its_schedule(case, make):
    inputs = _inputs(**CASES[case])
    action = ACTIONS[make](inputs.prompt_len)
    p = predict(action, inputs)
    expected = _schedule(action, inputs)
    got = (p.total_ms, p.h_ms, p.x_ms, p.r_ms, p.j_ms, p.bytes, p.prefill_ms)
    assert got == pytest.approx(expected, rel=EXACT, abs=1e-9)
    assert p.action == action and not p.pipelined


@pytest.mark.parametrize("S, l", [(4096, 3840), (8192, 7936)])
@pytest.mark.parametrize("streamed", [False, True])
def test_the_last_restore_is_of_the_rows_kept_and_at_least_a_layers_share(S, l, streamed):
    """The suffix layers keep 1/16 and 1/32 of their rows; a layer's share is 1/30."""
    inputs = _inputs(prompt_len=S, streamed=streamed, link_gbps=400.0,
                     codec_costs=codec_costs({}, {"int8": 500.0}))
    action = Action("int8", 29, L, split=l)
    p = predict(action, inputs)
    expected = _schedule(action, inputs)
    assert (p.total_ms, p.x_ms) == pytest.approx(expected[:3:2], rel=EXACT)


def test_a_split_prediction_by_hand():
    """bf16, after a full prefill, one chunk, no codec cost, 8 Gb/s (1e6 bytes/ms): the
    boundary's 512 rows first, then every layer (10 whole, 20 of 1536 rows), then the head."""
    inputs = CostInputs(SHAPE, 2048, 8.0, 3.0, prefill_ms_per_layer=2.0, message_ms=0.5,
                        link_latency_ms=1.0, join_ms=4.0, token_splits=True)
    action = Action("bf16", 10, L, split=512)
    kv_row = 2 * SHAPE.num_kv_heads * SHAPE.head_dim * 2  # K and V of one token, BF16
    boundary = 512 * SHAPE.hidden_size * 2 / 1e6 + 0.5
    layers = 10 * (2048 * kv_row / 1e6 + 0.5) + 20 * (1536 * kv_row / 1e6 + 0.5)
    prefix_end = 60.0 + boundary + layers + SHAPE.hidden_size * 2 / 1e6 + 0.5
    r = 20 * 3.0 * 512 / 2048
    p = predict(action, inputs)
    assert p.r_ms == pytest.approx(r, rel=EXACT)
    assert p.h_ms == pytest.approx(1.0 + 60.0 + boundary, rel=EXACT)
    assert p.x_ms == pytest.approx(prefix_end - 60.0 - boundary, rel=EXACT)
    assert p.total_ms == pytest.approx(1.0 + max(prefix_end, 60.0 + boundary + r) + 4.0,
                                       rel=EXACT)
    assert p.j_ms == 4.0 and p.prefill_ms == L * 2.0


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_split_costs_follow_the_wires_bytes(streamed, codec):
    inputs = _inputs(streamed=streamed, link_gbps=2.0)
    rate = 2.0 * 1e9 / 8 / 1e3
    for cut in (1, 10, L - 1):
        layer = wire_bytes(Action(codec, 1, L), SHAPE, 2048)  # one layer's codes and scales
        layer_ms = (layer.prefix + layer.scales) / rate
        costs = split_costs(inputs, codec, cut)
        assert costs.boundary_row_ms == pytest.approx(SHAPE.hidden_size * 2 / rate, rel=EXACT)
        assert costs.suffix_row_ms == pytest.approx((L - cut) * layer_ms / 2048, rel=EXACT)
        assert costs.recompute_row_ms == pytest.approx((L - cut) * 4.0 / 2048, rel=EXACT)
        prefix = pytest.approx(cut * layer_ms, rel=EXACT)
        assert (costs.prefix_ms, costs.prefix_first_ms) == ((0.0, prefix) if streamed
                                                            else (prefix, 0.0))


@pytest.mark.parametrize("cut", [0, L, L + 1, -1])
def test_split_costs_name_a_cut_that_is_not_interior(cut):
    with pytest.raises(ValueError, match=rf"cut: must lie in \(0, {L}\), got {cut}"):
        split_costs(_inputs(), "int8", cut)


def test_every_interior_cut_from_the_first_is_offered_its_split():
    """With a cheap recompute only the lowest cuts, whose many suffix layers make a row dear to
    send, split at all: the first layer's cut is among them, each at the closed form's l."""
    inputs = CostInputs(SHAPE, 2048, 1.0, 1.0, prefill_ms_per_layer=1.0, message_ms=0.1,
                        token_splits=True)
    expected = [Action(codec, c, L, split=l) for codec in ("int8", "bf16") for c in range(1, L)
                if 0 < (l := best_split(split_costs(inputs, codec, c), 2048)) < 2048]
    assert split_actions(inputs, ["int8", "bf16"]) == expected
    assert any(a.cut == 1 for a in expected)
