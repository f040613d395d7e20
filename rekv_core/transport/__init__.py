"""Transports: the contract (`base`) and its implementations, imported only when chosen
(`inprocess` for tests, demos and warm-up; UCX for the services)."""

from rekv_core.transport.base import (Message, TransportError, TransportReceiver,
                                      TransportSender)

__all__ = ["Message", "TransportError", "TransportReceiver", "TransportSender"]
