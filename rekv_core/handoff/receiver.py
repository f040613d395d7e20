"""The decode side of a handoff: rebuild the complete cache and the first-token logits.

`receive_handoff(model, transport, request_id, schedule)` reads one handoff (see `wire`) from an
opened request and always ends it: `close` after success, `abort` after any failure. Schedules:

- `overlap` (eq. 9): as soon as h_c arrives, layers c..L−1 run on this thread while a second
  thread receives and decodes the prefix layers into the cache; both join before the result. On
  CUDA the prefix thread copies and dequantizes on its own stream, and the join makes the compute
  stream wait on that stream's event, so the two paths overlap on the device as well.
- `sequential` (eq. 8): receive and decode the whole prefix, then run the suffix.

Token-only runs the whole prefill on the receiver; transfer-only computes the first logits from the
`head` message. Any transport or payload error, or a timeout, raises; a partial cache is never
returned. The result carries the timing breakdown (seconds; H: until the boundary or first layer is
in, X: prefix transfer and restore, R: suffix, J: join, total), the bytes received by kind, and
`link_sample`: (bytes, seconds) of the link from the messages that landed before this worker began
computing (`transport.arrivals`): before the suffix or the first dequantization, whichever came
first (restoring a BF16 layer is a copy and does not count), or None where the transport does not
time its messages or they said nothing reliable. A computing worker delays its receiving thread, so
later arrivals time the machine, not the wire.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch

from rekv_core.codecs import EncodedKV, get_codec
from rekv_core.handoff.action import Action, WireBytes, split_layer_bytes
from rekv_core.handoff.wire import BOUNDARY, HEAD, PLAN, TOKENS, Plan, layer_name
from rekv_core.model.cache import KVCache
from rekv_core.model.executor import Model, final_logits, prefill, run_layers
from rekv_core.transport import TransportError, TransportReceiver
from rekv_core.transport.arrivals import link_sample

SCHEDULES = ("overlap", "sequential")


@dataclass
class HandoffResult:
    action: Action
    cache: KVCache
    logits: torch.Tensor  # [vocab], float32: the first generated token's distribution
    timings: dict[str, float] = field(default_factory=dict)  # H, X, R, J, total (seconds)
    bytes: WireBytes = field(default_factory=WireBytes)
    link_sample: tuple[int, float] | None = None


class _Inbound:
    """Takes a request's messages in order, keeping their arrivals."""

    def __init__(self, transport: TransportReceiver, request_id: str, timeout: float):
        self.transport, self.request_id, self.timeout = transport, request_id, timeout
        self.arrivals = []

    def expect(self, name: str):
        message = self.transport.recv(self.request_id, self.timeout)
        if message.name != name:
            raise TransportError(f"request {self.request_id}: expected {name!r}, "
                                 f"got {message.name!r}")
        if message.arrival is not None:
            self.arrivals.append(message.arrival)
        return message

    def link_sample(self, before: float | None = None) -> tuple[int, float] | None:
        """From the messages that had landed by `before` (all of them when None)."""
        return link_sample([a for a in self.arrivals if before is None or a.completed <= before])


def _bf16_tensor(message, shape: tuple[int, ...], model: Model) -> torch.Tensor:
    buf = message.buffers.get("h")
    expected = int(torch.Size(shape).numel()) * 2
    if buf is None or buf.dtype != torch.uint8 or buf.numel() != expected:
        got = None if buf is None else buf.numel()
        raise TransportError(f"{message.name}: expected {expected} BF16 bytes, got {got}")
    return buf.view(torch.bfloat16).reshape(shape).to(model.device, model.dtype)


def _on_device(buffers: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: b.to(device, non_blocking=True) for name, b in buffers.items()}


def receive_handoff(model: Model, transport: TransportReceiver, request_id: str,
                    schedule: str = "overlap", timeout: float = 30.0,
                    extra_capacity: int = 0, prompt_len: int | None = None) -> HandoffResult:
    """`prompt_len`, when the caller knows it, lets the cache be allocated before the plan
    arrives (while the sender prefills), not while the first messages land; the plan must then
    agree with it."""
    start = time.perf_counter()
    try:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: must be one of {SCHEDULES}, got {schedule!r}")
        cache = None if prompt_len is None else _empty_cache(model, prompt_len + extra_capacity)
        result = _receive(model, transport, request_id, schedule, timeout, extra_capacity, start,
                          cache)
    except BaseException:
        transport.abort(request_id)
        raise
    transport.close(request_id)
    return result


def _empty_cache(model: Model, capacity: int) -> KVCache:
    shape = model.shape
    return KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, capacity, model.dtype,
                   model.device)


def _receive(model, transport, request_id, schedule, timeout, extra_capacity, start, cache):
    shape = model.shape
    inbound = _Inbound(transport, request_id, timeout)
    plan = Plan.from_bytes(inbound.expect(PLAN).header)
    plan.check_model(shape)
    action = plan.action
    S = plan.seq_len
    received = WireBytes()
    if cache is None:
        cache = _empty_cache(model, S + extra_capacity)
    elif cache.capacity != S + extra_capacity:
        raise TransportError(f"plan: a prompt of {S} tokens, expected "
                             f"{cache.capacity - extra_capacity}")

    if action.cut == 0:
        message = inbound.expect(TOKENS)
        ids = message.buffers["ids"].view(torch.int32).tolist()
        if len(ids) != S:
            raise TransportError(f"tokens: expected {S} ids, got {len(ids)}")
        h_time = time.perf_counter()
        out = prefill(model, ids, boundaries=())
        cache.load(out.keys, out.values)
        done = time.perf_counter()
        return HandoffResult(action, cache, out.logits,
                             {"H": h_time - start, "X": 0.0, "R": done - h_time, "J": 0.0,
                              "total": done - start}, WireBytes(tokens=S * 4))

    h_c = None
    if action.sends_boundary:
        h_c = _bf16_tensor(inbound.expect(BOUNDARY),
                           (S, shape.hidden_size), model)
        received += WireBytes(boundary=S * shape.hidden_size * 2)
    boundary_at = time.perf_counter()
    codec = get_codec(action.codec)
    kv_shape = (shape.num_kv_heads, S, shape.head_dim)
    prefix = {"bytes": WireBytes(), "error": None, "done": boundary_at, "decoding": None}
    cuda = model.device.type == "cuda"
    side_stream = torch.cuda.Stream(model.device) if cuda else None
    prefix_ready = torch.cuda.Event() if cuda else None

    def receive_prefix() -> None:
        try:
            with torch.cuda.stream(side_stream) if cuda else contextlib.nullcontext():
                _receive_prefix_layers()
                if cuda:
                    prefix_ready.record(side_stream)
                    side_stream.synchronize()
        except BaseException as exc:  # re-raised on the calling thread after the join
            prefix["error"] = exc
        prefix["done"] = time.perf_counter()

    def _receive_prefix_layers() -> None:
        for index in action.prefix_layers:
            message = inbound.expect(layer_name(index))
            encoded = EncodedKV.from_wire(message.header,
                                          _on_device(message.buffers, model.device))
            if tuple(encoded.shape) != kv_shape:
                raise TransportError(f"{message.name}: shape {encoded.shape}, "
                                     f"expected {kv_shape}")
            if prefix["decoding"] is None and action.codec != "bf16":
                prefix["decoding"] = time.perf_counter()
            k, v = codec.decode(encoded)
            cache.write(index, 0, k.to(model.dtype), v.to(model.dtype))
            prefix["bytes"] += split_layer_bytes(encoded.header()["buffers"])

    def run_suffix():
        began = time.perf_counter()
        suffix = run_layers(model, h_c, start=action.cut)
        for offset, (k, v) in enumerate(zip(suffix.keys, suffix.values)):
            cache.write(action.cut + offset, 0, k, v)
        if cuda:
            torch.cuda.current_stream(model.device).synchronize()
        return suffix.logits, began, time.perf_counter()

    if h_c is None:  # transfer-only: nothing to recompute
        receive_prefix()
        suffix_result = None
    elif schedule == "overlap":
        worker = threading.Thread(target=receive_prefix, name=f"rekv-prefix-{request_id}")
        worker.start()
        try:
            suffix_result = run_suffix()
        finally:
            worker.join()
    else:
        receive_prefix()
        suffix_result = run_suffix() if prefix["error"] is None else None
    if prefix["error"] is not None:
        raise prefix["error"]

    join_start = max(prefix["done"], suffix_result[2] if suffix_result else 0.0)
    if suffix_result is None:
        head = _bf16_tensor(inbound.expect(HEAD),
                            (shape.hidden_size,), model)
        received += WireBytes(head=shape.hidden_size * 2)
        logits = final_logits(model, head)
        r_seconds = 0.0
        computing = prefix["decoding"]
    else:
        logits, began, ended = suffix_result
        r_seconds = ended - began
        computing = min(began, prefix["decoding"] or began)
    cache.length = S
    if cuda:
        torch.cuda.current_stream(model.device).wait_event(prefix_ready)
        torch.cuda.current_stream(model.device).synchronize()
    done = time.perf_counter()
    timings = {"H": boundary_at - start, "X": prefix["done"] - boundary_at, "R": r_seconds,
               "J": done - join_start, "total": done - start}
    return HandoffResult(action, cache, logits, timings, received + prefix["bytes"],
                         inbound.link_sample(before=computing))
