"""Small contracts of the handoff package that the handoffs themselves never read back: the
fingerprint's start-up line, a delivery's name and the seed's delivery, a fresh seal's key, and a
Lynx handoff's residuals abandoned (the reading stopped once, its transfer failed, nothing kept)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from rekv_core.codecs import codec_versions
from rekv_core.codecs.base import WIRE_VERSION
from rekv_core.handoff import Delivery, Order
from rekv_core.handoff.fingerprint import fingerprint_of, fingerprint_parts
from rekv_core.handoff.residuals import PendingResiduals
from rekv_core.handoff.seal import KEY_BYTES, Sealing
from rekv_core.handoff.wire import WIRE_FORMAT
from rekv_core.model import get_preset

SHAPE = replace(get_preset("smollm2-135m").with_layers(2), vocab_size=512)
WEIGHTS = "0123456789abcdef" + "f" * 48


def test_the_fingerprint_describes_itself_in_one_line():
    """The hex, then the model's name, the weights' and tokenizer's digests cut to 16 characters
    ('none' without a tokenizer), the dtype, the wire format, the layer header's version and
    every codec as name:version."""
    codecs = ",".join(f"{name}:{version}" for name, version in codec_versions().items())
    assert len(codec_versions()) > 1
    served = fingerprint_of(fingerprint_parts(SHAPE, "bfloat16", WEIGHTS, "9" * 64))
    assert served.describe() == (
        f"{served.hex} (model {SHAPE.name}, weights 0123456789abcdef, dtype bfloat16, tokenizer "
        f"{'9' * 16}, wire {WIRE_FORMAT}, layer header {WIRE_VERSION}, codecs {codecs})")
    by_ids = fingerprint_of(fingerprint_parts(SHAPE, "float32", WEIGHTS, ""))
    assert by_ids.describe() == (
        f"{by_ids.hex} (model {SHAPE.name}, weights 0123456789abcdef, dtype float32, tokenizer "
        f"none, wire {WIRE_FORMAT}, layer header {WIRE_VERSION}, codecs {codecs})")
    assert "\n" not in served.describe()


def test_the_seed_delivery_is_the_whole_boundary_after_the_prefill():
    seed = Delivery.seed()
    assert (seed.streamed, seed.chunk_tokens, seed.order, seed.pipelined) == (
        False, 0, Order.LAYERS, False)
    assert seed == Delivery(streamed=False, chunk_tokens=0)


@pytest.mark.parametrize("delivery,name", [
    (Delivery(streamed=False, chunk_tokens=0), "after_prefill"),
    (Delivery(streamed=False, chunk_tokens=256), "after_prefill/chunk256"),
    (Delivery(streamed=True, chunk_tokens=0), "streamed"),
    (Delivery(streamed=True, chunk_tokens=512), "streamed/chunk512"),
    (Delivery(streamed=True, chunk_tokens=256, order=Order.TOKENS), "pipelined/chunk256"),
])
def test_a_delivery_names_its_order_and_chunk(delivery, name):
    assert str(delivery) == name


def test_a_fresh_sealing_draws_a_new_key_each_time():
    a, b = Sealing.fresh(), Sealing.fresh(encrypted=True)
    assert len(a.key) == KEY_BYTES and len(b.key) == KEY_BYTES and a.key != b.key
    assert a.sealed and not a.encrypted and b.encrypted
    assert a.binding == Sealing().binding


class _Transport:
    """Records the aborts; an abort lets the reader's thread end, as the real one does."""

    def __init__(self, on_abort):
        self.calls: list[tuple] = []
        self._on_abort = on_abort

    def abort(self, request_id):
        self.calls.append(("abort", request_id))
        self._on_abort()


class _Transfer:
    def __init__(self):
        self.calls: list[tuple] = []

    def fail(self, why):
        self.calls.append(("fail", why))


class _Inbound:
    def __init__(self, on_abort):
        self.request_id, self.transport, self.transfer = "r-7", _Transport(on_abort), _Transfer()


class _Incoming:
    def __init__(self, on_abort):
        self.inbound = _Inbound(on_abort)
        self.action = type("Action", (), {"cut": 2})()
        self.full = {0: ("k", "v"), 1: ("k", "v")}  # both layers' residuals in


def _pending():
    release = threading.Event()
    incoming = _Incoming(on_abort=release.set)
    worker = threading.Thread(target=release.wait, daemon=True)  # the reader, until aborted
    worker.start()
    return PendingResiduals(incoming, worker, join=None), incoming, worker


def test_abandoned_residuals_stop_the_reading_once_fail_the_transfer_and_keep_nothing():
    pending, incoming, worker = _pending()
    pending.abandon("the caller left")
    assert not worker.is_alive(), "abandon returned before the reader stopped"
    assert incoming.inbound.transport.calls == [("abort", "r-7")]
    assert incoming.inbound.transfer.calls == [("fail", "residuals: the caller left")]
    assert incoming.full == {}
    assert pending.ready()
    pending.abandon()  # twice: the reading is not aborted, nor the transfer failed, again
    assert incoming.inbound.transport.calls == [("abort", "r-7")]
    assert incoming.inbound.transfer.calls == [("fail", "residuals: the caller left")]
    with pytest.raises(RuntimeError, match="apply after a successful wait"):
        pending.apply(cache=None)


def test_residuals_abandoned_without_a_reason_say_so():
    pending, incoming, _ = _pending()
    pending.abandon()
    assert incoming.inbound.transfer.calls == [("fail", "residuals: abandoned")]
