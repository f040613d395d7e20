"""One handoff over the in-process link, the sender on a thread of its own, and send hooks that
record the message names: what the handoff schedule tests share. `planned(...)` is the plan and
the source for a handoff from a finished prefill (the seed's schedule) or from any source."""

import threading

from rekv_core.handoff import (Delivery, HandoffPlan, Order, Receiving, Sealing, receive_handoff,
                               send_handoff)
from rekv_core.handoff.source import FinishedPrefill
from rekv_core.handoff.transfer import Transfer
from rekv_core.model.executor import PrefillOutput
from rekv_core.transport import Pending
from rekv_core.transport.inprocess import InProcessLink


class MessageNames:
    """Send hooks that record the names of the messages posted, in order."""

    def __init__(self):
        self.names = []

    def before_send(self, message):
        return message

    def after_send(self, name):
        self.names.append(name)


def planned(model, ids, action, source, chunk_tokens=0, codec=None, predicted_ms=0.0):
    """(plan, source): `source` a `PrefillOutput` (made a `FinishedPrefill`) or any source; the
    plan goes as the source does (streamed, token order) with the boundary in `chunk_tokens`."""
    if isinstance(source, PrefillOutput):
        source = FinishedPrefill(source, ids, action.cut, action.sent_layers,
                                 input_rows=action.layer_split)
    delivery = Delivery(source.streamed, chunk_tokens,
                        Order.TOKENS if source.pipelined else Order.LAYERS)
    return HandoffPlan(action, len(ids), model.shape, delivery, codec,
                       predicted_ms=predicted_ms), source


def run_handoff(model, ids, action, source, chunk_tokens=0, receiving=Receiving(), transfer=None,
                hooks=None, fault=None, key=None, encrypted=False, receiver_key=None,
                receive_transfer=None, finish=None):
    """(the receiver's result, the sender's errors); the link must end with nothing held.
    `key` seals (and with `encrypted` encrypts) the handoff; the receiver opens it with
    `receiver_key` (default: the same key), its wait limits in `receive_transfer` (default: a
    stall limit of 30 s). `finish(result)`, when given, runs before the sender is joined (a
    progressive handoff's residuals are still arriving when the result comes back)."""
    errors = []
    plan, source = planned(model, ids, action, source, chunk_tokens)
    with InProcessLink(fault=fault) as link:
        link.receiver.open("r")

        def send():
            try:
                send_handoff(link.sender, plan, source, transfer or Transfer("r"),
                             Sealing(key, encrypted), hooks)
            except Exception as exc:  # noqa: BLE001 - surfaced by the test
                errors.append(exc)
            finally:
                close = getattr(source, "close", None)
                if close is not None:
                    close()

        sender = threading.Thread(target=send)
        sender.start()
        try:
            result = receive_handoff(model, link.receiver,
                                     receive_transfer or Transfer("r", stall_s=30),
                                     Sealing(key if receiver_key is None else receiver_key,
                                             encrypted), receiving)
            if finish is not None:
                finish(result)
        finally:
            sender.join()
        assert link.receiver.pending() == Pending()
    return result, errors
