"""How a failed call ends: the gRPC status code, and the reason label the metrics count."""

from __future__ import annotations

import asyncio

import grpc

from rekv_core.codecs import CorruptPayloadError
from rekv_core.connector import BadRequest, Busy, ModelMismatch
from rekv_core.handoff.transfer import TransferCancelled
from rekv_core.transport import TransportError


# the trailing metadata key under which a prefill worker that refuses another model's offer
# (FAILED_PRECONDITION) names its own model fingerprint
FINGERPRINT_TRAILER = "rekv-model-fingerprint"


class InvalidArgument(BadRequest):
    """Bad input from the caller: INVALID_ARGUMENT, with a message naming the field."""


class ResourceExhausted(Busy):
    """Beyond a bound of the worker (its queue, the memory for handoffs in flight):
    RESOURCE_EXHAUSTED, at once, before anything is allocated for the call."""


class HandoffFailed(RuntimeError):
    """The handoff failed and the worker is set to fail fast rather than recompute: UNAVAILABLE."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a failed request ends with, and the reason label for metrics."""
    if isinstance(exc, BadRequest):  # InvalidArgument, or the connector's own
        return grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"
    if isinstance(exc, ModelMismatch):
        return grpc.StatusCode.FAILED_PRECONDITION, "model_mismatch"
    if isinstance(exc, Busy):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "resource_exhausted"
    if isinstance(exc, HandoffFailed):
        return grpc.StatusCode.UNAVAILABLE, "handoff_failed"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "timeout"
    if isinstance(exc, (TransportError, CorruptPayloadError, TransferCancelled)):
        return grpc.StatusCode.UNAVAILABLE, "transfer"
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), "peer_" + exc.code().name.lower()
    return grpc.StatusCode.INTERNAL, "internal"
