"""How a failed call ends: the gRPC status code, and the reason label the metrics count."""

from __future__ import annotations

import asyncio

import grpc

from rekv_core.codecs import CorruptPayloadError
from rekv_core.transport import TransportError


class InvalidArgument(ValueError):
    """Bad input from the caller: INVALID_ARGUMENT, with a message naming the field."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a failed request ends with, and the reason label for metrics."""
    if isinstance(exc, InvalidArgument):
        return grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "timeout"
    if isinstance(exc, (TransportError, CorruptPayloadError)):
        return grpc.StatusCode.UNAVAILABLE, "transfer"
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), "peer_" + exc.code().name.lower()
    return grpc.StatusCode.INTERNAL, "internal"
