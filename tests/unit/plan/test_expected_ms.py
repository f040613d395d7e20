"""An action's own recent median, measured at another prompt length, scaled to this one by the
model: the model's time then is taken in the order the median was measured in, at that length,
with the suffix's γ linear in S."""

import dataclasses

import pytest

from rekv_core.handoff import Action, Order
from rekv_core.model.shapes import get_preset
from rekv_core.plan import CostInputs, predict
from rekv_core.plan.calibration import codec_costs
from rekv_core.plan.evidence import Evidence, Measured
from rekv_core.plan.planner import expected_ms

ACTION = Action("int8", 12, 30)


def _inputs(orders):
    return CostInputs(get_preset("smollm2-135m"), 1024, 1.0, 4.0,
                      codec_costs({"int8": 0.5}, {"int8": 0.25}), prefill_ms_per_layer=3.0,
                      streamed=True, chunk_tokens=256, orders=orders)


@pytest.mark.parametrize("pipelined", [False, True])
def test_an_own_median_at_another_length_is_scaled_by_the_model_in_its_order(pipelined):
    order = Order.TOKENS if pipelined else Order.LAYERS
    both = _inputs(frozenset({Order.LAYERS, Order.TOKENS}))
    own = Measured(700.0, 256, 3)
    evidence = (Evidence(measured_pipelined={ACTION: own}) if pipelined
                else Evidence(measured={ACTION: own}))
    prediction = predict(ACTION, dataclasses.replace(both, orders=frozenset({order})))
    assert prediction.pipelined is pipelined
    then = dataclasses.replace(both, orders=frozenset({order}), prompt_len=256,
                               suffix_ms_per_layer=4.0 * 256 / 1024)
    then_ms = predict(ACTION, then).total_ms
    assert expected_ms(prediction, both, evidence) == pytest.approx(
        700.0 * prediction.total_ms / then_ms)
    # the other order's model at that length, or γ unscaled, would give another time
    other = dataclasses.replace(then, orders=frozenset({Order.TOKENS if not pipelined
                                                        else Order.LAYERS}))
    assert predict(ACTION, other).total_ms != pytest.approx(then_ms)
    unscaled = dataclasses.replace(then, suffix_ms_per_layer=4.0)
    assert predict(ACTION, unscaled).total_ms != pytest.approx(then_ms)
