"""The decode side of a handoff: rebuild the complete cache and the first-token logits.

`receive_handoff(model, transport, request_id, schedule)` reads one handoff (see `wire`) from an
opened request and always ends it: `close` after success, `abort` after any failure. Schedules:

- `overlap` (eq. 9): as soon as h_c arrives, layers c..L−1 run on this thread while a second
  thread receives and decodes the prefix layers into the cache; both join before the result. On
  CUDA the prefix thread copies and dequantizes on its own stream, and the join makes the compute
  stream wait on that stream's event, so the two paths overlap on the device as well. That stream
  starts after the cache's allocation and zeroing on the compute stream, and waits for each
  message's `ready` event before reading its buffers (`rekv_core.streams`); so does the compute
  stream before it reads the boundary or the head.
- `sequential` (eq. 8): receive and decode the whole prefix, then run the suffix.

Every message is opened with the handoff's key and its bytes checked against their checksums before
anything reads them (`seal`). Token-only runs the whole prefill on the receiver; transfer-only
computes the first logits from the `head` message. Any transport or payload error, or a timeout,
raises; a partial cache is never returned. The result carries the timing breakdown
(`HandoffTimings`), the bytes received by kind, and `link_sample`: (bytes, seconds) of the link from
the messages that landed before this worker began computing (`transport.arrivals`): before the
suffix or the first decode that computes, whichever came first (restoring a BF16 layer is a copy and
does not count), or None where the transport does not time its messages or they said nothing
reliable. A computing worker delays its receiving thread, so later arrivals time the machine, not
the wire.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from rekv_core import streams
from rekv_core.codecs import EncodedKV, get_codec
from rekv_core.handoff.action import Action, WireBytes, split_layer_bytes
from rekv_core.handoff.seal import check_checksums, check_key, decrypt, open_message
from rekv_core.handoff.transfer import Transfer, TransferCancelled, TransferState, allowed_s
from rekv_core.handoff.wire import BOUNDARY, HEAD, PLAN, TOKENS, Plan, layer_name
from rekv_core.model.cache import KVCache
from rekv_core.model.executor import Model, final_logits, prefill, run_layers
from rekv_core.transport import Message, TransportError, TransportReceiver
from rekv_core.transport.arrivals import Arrival, link_sample
from rekv_core.units import BF16_BYTES, TOKEN_ID_BYTES

SCHEDULES = ("overlap", "sequential")


@dataclass(frozen=True)
class HandoffTimings:
    """The seed's parts of one handoff, in seconds from the call to `receive_handoff`."""

    h_s: float = 0.0  # H: until the boundary (or, for transfer-only, nothing) is in
    x_s: float = 0.0  # X: prefix transfer and restore, from then on
    r_s: float = 0.0  # R: suffix recompute (token-only: the whole prefill)
    j_s: float = 0.0  # J: from the later branch's end to the complete cache
    total_s: float = 0.0


@dataclass
class HandoffResult:
    action: Action
    cache: KVCache
    logits: torch.Tensor  # [vocab], float32: the first generated token's distribution
    timings: HandoffTimings = field(default_factory=HandoffTimings)
    bytes: WireBytes = field(default_factory=WireBytes)
    link_sample: tuple[int, float] | None = None  # (bytes, seconds)


class _Inbound:
    """Takes a request's messages in order, each opened with the handoff's key (`seal`), keeping
    their arrivals."""

    def __init__(self, transport: TransportReceiver, request_id: str, transfer: Transfer,
                 key: bytes | None, encrypted: bool = False):
        self.transport, self.request_id, self.transfer = transport, request_id, transfer
        self.key, self.encrypted = key, encrypted
        self.arrivals: list[Arrival] = []

    def expect(self, name: str) -> Message:
        message = open_message(self.key, self.transport.recv(self.request_id,
                                                             self.transfer.wait_s()))
        if self.encrypted:
            message = decrypt(self.key, message)
        if message.name != name:
            raise TransportError(f"request {self.request_id}: expected {name!r}, "
                                 f"got {message.name!r}")
        if message.arrival is not None:
            self.arrivals.append(message.arrival)
        return message

    def link_sample(self, before: float | None = None) -> tuple[int, float] | None:
        """From the messages that had landed by `before` (all of them when None)."""
        return link_sample([a for a in self.arrivals if before is None or a.completed <= before])


def _bf16_tensor(message: Message, shape: tuple[int, ...], model: Model) -> torch.Tensor:
    buf = message.buffers.get("h")
    expected = int(torch.Size(shape).numel()) * BF16_BYTES
    if buf is None or buf.dtype != torch.uint8 or buf.numel() != expected:
        got = None if buf is None else buf.numel()
        raise TransportError(f"{message.name}: expected {expected} BF16 bytes, got {got}")
    streams.wait_ready(message.ready, [buf])
    check_checksums(message)
    return buf.view(torch.bfloat16).reshape(shape).to(model.device, model.dtype)


def _on_device(buffers: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    # non-blocking only towards a device: a copy to the host must have landed before it is read
    return {name: b.to(device, non_blocking=device.type == "cuda") for name, b in buffers.items()}


def receive_handoff(model: Model, transport: TransportReceiver, request_id: str,
                    schedule: str = "overlap", timeout: float = 30.0,
                    extra_capacity: int = 0, prompt_len: int | None = None,
                    key: bytes | None = None, transfer: Transfer | None = None,
                    encrypted: bool = False) -> HandoffResult:
    """`prompt_len`, when the caller knows it, lets the cache be allocated before the plan
    arrives (while the sender prefills), not while the first messages land; the plan must then
    agree with it. `key`: the handoff's key (`seal.new_key`), which the sender must seal with.
    `transfer`: the handoff's state and deadline, which every wait obeys (without one, each wait
    is bounded by `timeout`); it ends DONE or FAILED. `encrypted`: the sender encrypted every
    buffer under the key (`seal.encrypt`), and each is decrypted on the host."""
    start = time.perf_counter()
    transfer = transfer or Transfer(request_id, stall_s=timeout)
    try:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: must be one of {SCHEDULES}, got {schedule!r}")
        cache = None if prompt_len is None else _empty_cache(model, prompt_len + extra_capacity)
        check_key(key)
        if encrypted and key is None:
            raise ValueError("encrypted: needs the handoff's key")
        inbound = _Inbound(transport, request_id, transfer, key, encrypted)
        result = _receive(model, inbound, schedule, extra_capacity, start, cache)
    except BaseException as exc:
        transport.abort(request_id)
        transfer.fail(f"{type(exc).__name__}: {exc}")
        raise
    transport.close(request_id)
    transfer.advance(TransferState.DONE)
    return result


def _empty_cache(model: Model, capacity: int) -> KVCache:
    shape = model.shape
    return KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, capacity, model.dtype,
                   model.device)


def _receive(model: Model, inbound: _Inbound, schedule: str, extra_capacity: int, start: float,
             cache: KVCache | None) -> HandoffResult:
    plan = Plan.from_bytes(inbound.expect(PLAN).header)
    plan.check_model(model.shape)
    if plan.expect_ms > 0:
        inbound.transfer.expect_within(allowed_s(plan.expect_ms / 1e3))
    inbound.transfer.advance(TransferState.BOUNDARY)
    S = plan.seq_len
    if cache is None:
        cache = _empty_cache(model, S + extra_capacity)
    elif cache.capacity != S + extra_capacity:
        raise TransportError(f"plan: a prompt of {S} tokens, expected "
                             f"{cache.capacity - extra_capacity}")
    if plan.action.cut == 0:
        return _recompute_prompt(model, inbound, plan.action, S, cache, start)
    return _restore_and_recompute(model, inbound, schedule, plan.action, S, cache, start)


def _recompute_prompt(model: Model, inbound: _Inbound, action: Action, S: int, cache: KVCache,
                      start: float) -> HandoffResult:
    """Token-only: the prompt's ids arrive, this worker runs every layer."""
    message = inbound.expect(TOKENS)
    inbound.transfer.advance(TransferState.JOINING)
    check_checksums(message)
    ids = message.buffers["ids"].view(torch.int32).tolist()
    if len(ids) != S:
        raise TransportError(f"tokens: expected {S} ids, got {len(ids)}")
    began = time.perf_counter()
    out = prefill(model, ids, boundaries=())
    cache.load(out.keys, out.values)
    done = time.perf_counter()
    timings = HandoffTimings(h_s=began - start, r_s=done - began, total_s=done - start)
    return HandoffResult(action, cache, out.logits, timings, WireBytes(tokens=S * TOKEN_ID_BYTES))


class _PrefixBranch:
    """Receives layers 0..c−1 and restores them into the cache; on CUDA, on its own stream.

    `run()` never raises: the failure is kept in `error` for the calling thread to re-raise."""

    def __init__(self, model: Model, inbound: _Inbound, action: Action, S: int, cache: KVCache,
                 started: float):
        self.model, self.inbound, self.action, self.cache = model, inbound, action, cache
        self.codec = get_codec(action.codec)
        self.kv_shape = (model.shape.num_kv_heads, S, model.shape.head_dim)
        self.bytes = WireBytes()
        self.error: BaseException | None = None
        self.done = started
        self.decoding_began: float | None = None  # the first restore that computes
        self.cuda = model.device.type == "cuda"
        self.stream = streams.side_stream(model.device)
        streams.follow(self.stream, model.device)  # the cache is allocated and zeroed first
        self.ready = torch.cuda.Event() if self.cuda else None

    def run(self) -> None:
        try:
            with streams.on_stream(self.stream):
                self._receive_layers()
                if self.cuda:
                    self.ready.record(self.stream)
        except BaseException as exc:  # re-raised on the calling thread after the join
            self.error = exc
        finally:
            streams.settle(self.stream)  # even after a failure nothing may write into the cache
        self.done = time.perf_counter()

    def _receive_layers(self) -> None:
        codec = self.codec
        for index in self.action.prefix_layers:
            message = self.inbound.expect(layer_name(index))
            streams.wait_ready(message.ready, message.buffers.values())
            encoded = EncodedKV.from_wire(message.header,
                                          _on_device(message.buffers, self.model.device))
            if tuple(encoded.shape) != self.kv_shape:
                raise TransportError(f"{message.name}: shape {encoded.shape}, "
                                     f"expected {self.kv_shape}")
            if self.decoding_began is None and not codec.restore_is_copy:
                self.decoding_began = time.perf_counter()
            k, v = codec.decode(encoded)
            self.cache.write(index, 0, k.to(self.model.dtype), v.to(self.model.dtype))
            self.bytes += split_layer_bytes(encoded.header()["buffers"])

    def join_compute_stream(self) -> None:
        """On CUDA: the compute stream waits for every restore before the cache is used."""
        if self.cuda:
            stream = torch.cuda.current_stream(self.model.device)
            stream.wait_event(self.ready)
            stream.synchronize()


@dataclass(frozen=True)
class _Suffix:
    logits: torch.Tensor
    began: float
    ended: float


def _run_suffix(model: Model, h_c: torch.Tensor, cut: int, cache: KVCache) -> _Suffix:
    began = time.perf_counter()
    suffix = run_layers(model, h_c, start=cut)
    for offset, (k, v) in enumerate(zip(suffix.keys, suffix.values)):
        cache.write(cut + offset, 0, k, v)
    if model.device.type == "cuda":
        torch.cuda.current_stream(model.device).synchronize()
    return _Suffix(suffix.logits, began, time.perf_counter())


def _join(worker: threading.Thread, inbound: _Inbound) -> None:
    """Wait for the prefix branch; past the transfer's deadline, abort the request, which wakes
    its receive at once, and wait for the branch to stop writing into the cache."""
    try:
        worker.join(max(0.0, inbound.transfer.wait_s()))
    except (TimeoutError, TransferCancelled):
        pass
    if worker.is_alive():
        inbound.transport.abort(inbound.request_id)
        worker.join()


def _restore_and_recompute(model: Model, inbound: _Inbound, schedule: str, action: Action,
                           S: int, cache: KVCache, start: float) -> HandoffResult:
    """A cut c ≥ 1: the boundary (unless c = L), then the prefix beside the suffix."""
    shape = model.shape
    received = WireBytes()
    h_c = None
    if action.sends_boundary:
        h_c = _bf16_tensor(inbound.expect(BOUNDARY), (S, shape.hidden_size), model)
        received += WireBytes(boundary=S * shape.hidden_size * BF16_BYTES)
    boundary_at = time.perf_counter()
    inbound.transfer.advance(TransferState.PREFIX)
    prefix = _PrefixBranch(model, inbound, action, S, cache, boundary_at)
    suffix = None
    if h_c is None:  # transfer-only: nothing to recompute
        prefix.run()
    elif schedule == "overlap":
        worker = threading.Thread(target=prefix.run, name=f"rekv-prefix-{inbound.request_id}")
        worker.start()
        try:
            suffix = _run_suffix(model, h_c, action.cut, cache)
        except BaseException:  # wake the prefix thread instead of waiting out its timeout
            inbound.transport.abort(inbound.request_id)
            raise
        finally:
            _join(worker, inbound)
    else:
        prefix.run()
        suffix = _run_suffix(model, h_c, action.cut, cache) if prefix.error is None else None
    if prefix.error is not None:
        raise prefix.error
    inbound.transfer.advance(TransferState.JOINING)

    join_start = max(prefix.done, suffix.ended if suffix else 0.0)
    if suffix is None:
        head = _bf16_tensor(inbound.expect(HEAD), (shape.hidden_size,), model)
        received += WireBytes(head=shape.hidden_size * BF16_BYTES)
        logits, r_seconds, computing = final_logits(model, head), 0.0, prefix.decoding_began
    else:
        logits, r_seconds = suffix.logits, suffix.ended - suffix.began
        computing = min(suffix.began, prefix.decoding_began or suffix.began)
    cache.length = S
    prefix.join_compute_stream()
    done = time.perf_counter()
    timings = HandoffTimings(h_s=boundary_at - start, x_s=prefix.done - boundary_at, r_s=r_seconds,
                             j_s=done - join_start, total_s=done - start)
    return HandoffResult(action, cache, logits, timings, received + prefix.bytes,
                         inbound.link_sample(before=computing))
