"""The two services as real processes: gRPC on loopback, KV over UCX (TCP) on loopback.

They run the embedded model in BF16, the serving dtype, with the same thread count as this test
process, so a lossless handoff must reproduce the single-process reference token for token.
"""

import inspect
import re
import threading
import urllib.request

import grpc
import pytest
import torch

from rekv_core.handoff import Action, wire_bytes
from rekv_core.model import get_preset
from rekv_core.plan.planner import Planner
from rekv_core.plan.policy import shipped_policy
from rekv_cli.client import generate
from rekv_cli.launcher import ServicePair
from services.decode.prefill_pool import PrefillPool
from tests.support.reference import greedy_reference
from tests.support.service_logs import logged_at, wait_for_line

SHAPE = get_preset("smollm2-135m")
START_WAIT_S = inspect.signature(PrefillPool).parameters["start_wait_s"].default
MAX_PROMPT = 600
MAX_NEW = 96
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "There is important information hidden in this text. The pass key is 4417. Remember it. "
    + "The grass is green. The sky is blue. " * 12 + "What is the pass key? The pass key is",
)


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    settings = ["--dtype", "bfloat16", "--torch-threads", str(torch.get_num_threads()),
                "--max-prompt-tokens", str(MAX_PROMPT), "--max-new-tokens", str(MAX_NEW),
                "--codecs", "bf16,int8,int4"]
    pair = ServicePair(settings, settings, log_dir=tmp_path_factory.mktemp("services"))
    channel = grpc.insecure_channel(pair.decode_address)
    yield pair, channel
    channel.close()
    codes = pair.stop()
    assert codes == {"decode": 0, "prefill": 0}, "services did not stop cleanly"


@pytest.fixture(scope="module")
def reference(tokenizer):
    return greedy_reference(tokenizer)


def _run(services, request_id, prompt, n, forced=None, **kwargs):
    _, channel = services
    return generate(channel, request_id, prompt, n, forced_action=forced, **kwargs)


def test_the_data_plane_is_connected_and_the_link_timed_before_the_first_request(services):
    """The decode service was ready only after the prefill service had connected to it and sent
    the link probe, which timed the link (or, on a machine too loaded for that, once it had waited
    `PrefillPool.start_wait_s`): no request waits for the connection, and the first is planned on
    a measured link. A request served now is logged after all of that."""
    pair, _ = services
    _run(services, "after-connect", PROMPTS[0], 2, ("bf16", 30))
    decode_log = wait_for_line(pair.log_dir / "decode.log", "link probe from", 120)
    prefill_log = (pair.log_dir / "prefill.log").read_text()
    # connected by the first Connect, or by an earlier one that a loaded machine let time out
    connected = re.search(r"data plane: (\S+) (?:already )?connected in [\d.]+ ms; probe (\d+) "
                          r"bytes", prefill_log)
    assert connected and connected.group(1) == pair.decode.info["ucx"]
    assert int(connected.group(2)) > 0
    probe = re.search(r"link probe from \S+(: ([\d.]+) Gb/s| .* timed nothing)", decode_log)
    assert probe, f"no link probe logged: {decode_log[-2000:]}"
    assert probe.group(2) and float(probe.group(2)) > 0, f"the probe timed nothing: {probe[0]}"
    ready = decode_log.find("decode service ready")
    if probe.end() < ready:  # every request came after these (the first logged on each side)
        assert connected.end() < prefill_log.find("request=")
    else:  # on a loaded machine the pool stops waiting, and a request may meet the connection
        added = decode_log.find("prefill pool: added")
        waited = logged_at(decode_log, ready) - logged_at(decode_log, added)
        assert waited >= START_WAIT_S - 0.1, decode_log[-2000:]  # only once the wait ran out
    assert ready < decode_log.find("request=")  # and ours was served
    assert re.search(r"request=after-connect transfer=\S+ tokens=\d+ action=", prefill_log)
    assert re.search(r"request=after-connect tokens=\d+ action=\S+ handoff_ms=", decode_log)


@pytest.mark.parametrize("forced", [("bf16", 30), ("bf16", 15), ("bf16", 0)],
                         ids=["bf16_transfer", "bf16_recompute", "token_recompute"])
def test_lossless_actions_reproduce_the_reference(services, reference, forced):
    for index, prompt in enumerate(PROMPTS):
        result = _run(services, f"lossless-{forced[1]}-{index}", prompt, 24, forced)
        assert result.summary.action.codec == forced[0] and result.summary.action.cut == forced[1]
        assert not result.summary.fallback
        assert result.token_ids == reference(prompt, 24), f"prompt {index}"
        assert result.messages == len(result.token_ids) + 1  # one per token, then the summary


def test_a_pipelined_handoff_reproduces_the_reference(services, reference, tokenizer):
    """The prefill in token chunks, each chunk's boundary and prefix rows sent as it passes the
    cut: the same tokens as the single-process reference, over two chunks."""
    prompt = PROMPTS[2] * 3
    assert 256 < len(tokenizer.encode(prompt)) <= MAX_PROMPT
    for forced in (("bf16", 15), ("bf16", 3)):
        result = _run(services, f"pipelined-{forced[1]}", prompt, 16, forced,
                      forced_schedule=(True, 256, True))
        s = result.summary
        assert s.schedule.pipelined and s.schedule.streamed and not s.fallback
        assert (s.action.codec, s.action.cut) == forced
        assert result.token_ids == reference(prompt, 16)
    with pytest.raises(grpc.RpcError) as error:  # token order needs the boundary in chunks
        _run(services, "pipelined-whole", prompt, 4, ("bf16", 15),
             forced_schedule=(True, 0, True))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "forced_schedule.pipelined" in error.value.details()


def test_a_token_split_reproduces_the_reference(services, reference, tokenizer):
    """KVPR's token split, forced over the control plane: h_c of the first 256 tokens, layers
    15..29's KV of the rest, the head; the decode worker recomputes rows [0, 256) of layers 15..29
    while the rest arrives. Streamed and after a full prefill: the reference's tokens, and the
    bytes of the formula. A split not below the prompt's length is refused naming the field."""
    prompt = PROMPTS[2] * 3
    prompt_len = len(tokenizer.encode(prompt))
    assert 256 < prompt_len <= MAX_PROMPT
    action = Action("bf16", 15, SHAPE.num_layers, split=256)
    for schedule in ((True, 256), (False, 0)):
        result = _run(services, f"split-{schedule[0]}", prompt, 16, ("bf16", 15, "bf16", 256),
                      forced_schedule=schedule)
        s = result.summary
        assert s.action_kind == "token_split" and s.action.split_tokens == 256, s
        assert s.schedule.streamed == schedule[0] and not s.fallback
        assert result.token_ids == reference(prompt, 16)
        want = wire_bytes(action, SHAPE, prompt_len)
        assert (s.bytes.boundary, s.bytes.prefix + s.bytes.scales, s.bytes.head) == (
            want.boundary, want.prefix + want.scales, want.head)
    with pytest.raises(grpc.RpcError) as error:
        _run(services, "split-long", "Hello", 4, ("bf16", 15, "bf16", 256))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "forced_action.split_tokens" in error.value.details()


def test_lynx_streams_emit_the_int8_actions_tokens(services, tokenizer):
    """Lynx's progressive streams, forced over the control plane: the decode worker starts on
    the anchors, drafts while the residuals arrive and emits only what the full int8 cache
    verifies: the int8 action's own tokens, joint and transfer-only, with int8's bytes. A codec
    other than int8, or token order, is refused naming the field."""
    prompt = PROMPTS[2]
    prompt_len = len(tokenizer.encode(prompt))
    for cut in (15, SHAPE.num_layers):
        want = _run(services, f"int8-{cut}", prompt, 16, ("int8", cut), stop_at_eos=False)
        result = _run(services, f"lynx-{cut}", prompt, 16, ("int8", cut, "bf16", 0, True),
                      stop_at_eos=False)
        s = result.summary
        assert s.action.progressive and s.action.codec == "int8" and not s.fallback, s
        assert result.token_ids == want.token_ids
        total = wire_bytes(Action("int8", cut, SHAPE.num_layers), SHAPE, prompt_len)
        assert (s.bytes.prefix, s.bytes.scales, s.bytes.boundary, s.bytes.head) == (
            total.prefix, total.scales, total.boundary, total.head)
    with pytest.raises(grpc.RpcError) as error:
        _run(services, "lynx-int4", prompt, 4, ("int4", 15, "bf16", 0, True))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "forced_action.progressive" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        _run(services, "lynx-tokens", prompt, 4, ("int8", 15, "bf16", 0, True),
             forced_schedule=(True, 256, True))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "forced_schedule.pipelined" in error.value.details()


def test_a_layer_split_reproduces_the_reference(services, reference, tokenizer):
    """KVPR's per-layer form, forced over the control plane: each layer sent as KV sends its input
    rows [0, 256) in BF16, the decode worker recomputes their K and V. Joint (streamed) and
    transfer-only (after a full prefill, which keeps every layer's input): the reference's tokens
    and the formula's bytes. Token order is refused naming the field."""
    prompt = PROMPTS[2] * 3
    prompt_len = len(tokenizer.encode(prompt))
    assert 256 < prompt_len <= MAX_PROMPT
    for cut, schedule in ((15, (True, 256)), (SHAPE.num_layers, (False, 0))):
        action = Action("bf16", cut, SHAPE.num_layers, layer_split=256)
        result = _run(services, f"layer-split-{cut}", prompt, 16,
                      ("bf16", cut, "bf16", 0, False, 256), forced_schedule=schedule)
        s = result.summary
        assert s.action.layer_split_tokens == 256 and s.action_kind == action.kind.value, s
        assert s.action.cut == cut and s.schedule.streamed == schedule[0] and not s.fallback
        assert result.token_ids == reference(prompt, 16)
        want = wire_bytes(action, SHAPE, prompt_len)
        assert (s.bytes.boundary, s.bytes.prefix, s.bytes.scales, s.bytes.tokens,
                s.bytes.head) == (want.boundary, want.prefix, want.scales, want.tokens, want.head)
    with pytest.raises(grpc.RpcError) as error:
        _run(services, "layer-split-tokens", prompt, 4, ("bf16", 15, "bf16", 0, False, 256),
             forced_schedule=(True, 256, True))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "forced_schedule.pipelined" in error.value.details()


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_joint_int8_agrees_with_the_reference(services, reference):
    """Free-running greedy decoding from the joint int8 cache against BF16, 64 tokens each:
    the first token must agree, and the continuation must track the reference."""
    prefixes, matches = [], []
    for index, prompt in enumerate(PROMPTS):
        result = _run(services, f"joint-{index}", prompt, 64, ("int8", 15), stop_at_eos=False)
        want = reference(prompt, 64, stop_at_eos=False)
        assert result.summary.action_kind == "joint" and len(result.token_ids) == 64
        assert result.token_ids[0] == want[0]
        prefixes.append(_common_prefix(result.token_ids, want))
        matches.append(sum(a == b for a, b in zip(result.token_ids, want)) / 64)
    print(f"joint int8 (cut 15) vs BF16 over 64 greedy tokens: identical prefix {prefixes}, "
          f"positions equal {matches}")
    # Measured on this machine: identical for the first 17, 12 and 64 tokens. Open-ended text
    # drifts after a near-tie; the passkey answer and its continuation do not.
    assert min(prefixes) >= 8 and prefixes[2] == 64


def test_summary_reports_the_handoff(services):
    result = _run(services, "summary", PROMPTS[2], 4, ("int8", 15))
    s = result.summary
    assert s.request_id == "summary" and s.generated_tokens == 4 and s.finish_reason == "length"
    assert s.bytes.boundary == s.prompt_tokens * 576 * 2 and s.bytes.prefix > 0
    assert s.bytes.scales > 0 and s.bytes.tokens == 0
    assert s.measured_handoff_ms > 0 and s.predicted_handoff_ms > 0 and s.ttft_ms > 0
    assert s.timings.r_ms > 0 and s.timings.prefill_ms > 0


def test_text_and_token_prompts_agree_and_sampling_is_seeded(services, tokenizer):
    by_text = _run(services, "text", PROMPTS[0], 8, ("bf16", 30))
    by_ids = _run(services, "ids", tokenizer.encode(PROMPTS[0]), 8, ("bf16", 30))
    assert by_text.token_ids == by_ids.token_ids
    sampling = {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": 7}
    first = _run(services, "sample-1", PROMPTS[0], 12, ("bf16", 30), sampling=sampling)
    second = _run(services, "sample-2", PROMPTS[0], 12, ("bf16", 30), sampling=sampling)
    assert first.token_ids == second.token_ids


def test_planner_chooses_among_the_actions_its_policy_allows(services, tokenizer):
    """Unforced requests take the planner's choice, which the shipped policy must allow (int4 at
    no cut), and the summary reports it consistently."""
    planner = Planner(shipped_policy("smollm2-135m"))
    for index, prompt in enumerate(PROMPTS):
        s = _run(services, f"planned-{index}", prompt, 4).summary
        action = Action(s.action.codec, s.action.cut, 30)
        assert planner.allowed(action, s.prompt_tokens), str(action)
        assert s.action_kind == action.kind.value and not s.fallback
        assert s.predicted_handoff_ms > 0 and s.measured_handoff_ms > 0
        expected = wire_bytes(action, SHAPE, s.prompt_tokens)
        got = (s.bytes.boundary, s.bytes.prefix, s.bytes.scales, s.bytes.tokens, s.bytes.head)
        assert got == (expected.boundary, expected.prefix, expected.scales, expected.tokens,
                       expected.head)


@pytest.mark.parametrize("kwargs,field", [
    ({"prompt": ""}, "text"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 49152]}, "token_ids"),
    ({"prompt": [5] * (MAX_PROMPT + 1)}, "token_ids"),
    ({"n": 0}, "max_new_tokens"),
    ({"n": MAX_NEW + 1}, "max_new_tokens"),
    ({"forced": ("int3", 10)}, "forced_action.codec"),
    ({"forced": ("int8", 31)}, "forced_action.cut"),
    ({"forced": ("int8", 10, "bf16", 100)}, "forced_action.split_tokens"),
    ({"forced": ("int8", 30, "bf16", 256)}, "forced_action.split_tokens"),
    ({"forced": ("int8", 10, "bf16", 0, False, 100)}, "forced_action.layer_split_tokens"),
    ({"forced": ("int8", 30, "bf16", 0, False, 256)}, "forced_action.layer_split_tokens"),
    ({"sampling": {"temperature": 1.0, "top_p": 1.5}}, "sampling.top_p"),
    ({"request_id": ""}, "request_id"),
])
def test_bad_requests_are_refused_by_field(services, kwargs, field):
    pair, channel = services
    args = {"request_id": "bad", "prompt": "Hello", "n": 4, "forced": None, **kwargs}
    with pytest.raises(grpc.RpcError) as error:
        generate(channel, args["request_id"], args["prompt"], args["n"],
                 forced_action=args["forced"], sampling=args.get("sampling"))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.details()
    _run(services, "after-bad", "Hello", 2, ("bf16", 30))  # still serving


def _metrics(pair, role) -> str:
    with urllib.request.urlopen(pair.metrics_url(role), timeout=10) as response:
        return response.read().decode()


def _value(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not exported"
    return float(match.group(1))


def test_deadline_frees_both_sides(services):
    pair, channel = services
    long_prompt = [17] * MAX_PROMPT
    with pytest.raises(grpc.RpcError) as error:
        generate(channel, "late", long_prompt, MAX_NEW, ("int8", 15), timeout=0.05)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    waited = threading.Event()
    for _ in range(200):  # the prefill side finishes its send, the decode side drains it
        if all(_value(_metrics(pair, role), "rekv_transport_pending") == 0 and
               _value(_metrics(pair, role), "rekv_handoffs_in_flight") == 0
               for role in ("decode", "prefill")):
            break
        waited.wait(0.1)
    for role in ("decode", "prefill"):
        text = _metrics(pair, role)
        assert _value(text, "rekv_transport_pending") == 0, role
        assert _value(text, "rekv_handoffs_in_flight") == 0, role
    _run(services, "after-late", PROMPTS[0], 4, ("int8", 15))


def _counts(pair) -> dict[str, float]:
    decode, prefill = _metrics(pair, "decode"), _metrics(pair, "prefill")
    joint = 'rekv_requests_total{action="joint",codec="int8",cut="15"}'
    boundary = 'rekv_received_bytes_total{kind="boundary"}'
    invalid = 'rekv_failures_total{reason="invalid_argument"}'
    return {"request": _value(decode, "rekv_request_seconds_count"),
            "ttft": _value(decode, "rekv_ttft_seconds_count"),
            "decode_handoff": _value(decode, "rekv_handoff_seconds_count"),
            "joint": _value(decode, joint) if joint in decode else 0.0,
            "boundary_bytes": _value(decode, boundary) if boundary in decode else 0.0,
            "invalid": _value(decode, invalid) if invalid in decode else 0.0,
            "prefill": _value(prefill, "rekv_prefill_seconds_count"),
            "sent_prefix": _value(prefill, 'rekv_sent_bytes_total{kind="prefix"}')
            if 'rekv_sent_bytes_total{kind="prefix"}' in prefill else 0.0,
            "link": _value(decode, "rekv_link_bandwidth_estimate_gbps")}


def test_metrics_count_every_request(services, tokenizer):
    """Two requests and one refused: the histograms and counters move by exactly that much,
    whatever ran before."""
    pair, channel = services
    before = _counts(pair)
    joint = _run(services, "counted-joint", PROMPTS[2], 3, ("int8", 15))
    _run(services, "counted-bf16", PROMPTS[0], 2, ("bf16", 30))
    with pytest.raises(grpc.RpcError):
        generate(channel, "counted-bad", "Hello", 0)
    after = _counts(pair)
    delta = {key: after[key] - before[key] for key in before}
    assert delta["request"] == delta["ttft"] == delta["decode_handoff"] == 2
    assert delta["prefill"] == 2 and delta["joint"] == 1 and delta["invalid"] == 1
    assert delta["boundary_bytes"] == joint.summary.bytes.boundary
    assert delta["sent_prefix"] > 0 and after["link"] > 0
