"""Transports: the contract (`base`) and its implementations, chosen by name through `factory`
and imported only when chosen (`inprocess` for tests, demos and warm-up; `ucx` for the services).
`pacing` emulates a slower link in front of any sender; `pool` keeps one sender per receiver."""

from rekv_core.transport.base import (Message, Pending, ReceiveState, TransportError,
                                      TransportReceiver, TransportSender)
from rekv_core.transport.factory import (TRANSPORTS, TransportOptions, create_receiver,
                                         create_sender_pool)
from rekv_core.transport.pool import SenderPool

__all__ = ["Message", "Pending", "ReceiveState", "SenderPool", "TRANSPORTS", "TransportError",
           "TransportOptions", "TransportReceiver", "TransportSender", "create_receiver",
           "create_sender_pool"]
