"""One handoff over the in-process link, the sender on a thread of its own, and send hooks that
record the message names: what the handoff schedule tests share."""

import threading

from rekv_core.handoff import receive_handoff, send_handoff
from rekv_core.transport.inprocess import InProcessLink


class MessageNames:
    """Send hooks that record the names of the messages posted, in order."""

    def __init__(self):
        self.names = []

    def before_send(self, message):
        return message

    def after_send(self, name):
        self.names.append(name)


def run_handoff(model, ids, action, source, chunk_tokens=0, schedule="overlap", transfer=None,
                hooks=None, fault=None, key=None, encrypted=False, receiver_key=None):
    """(the receiver's result, the sender's errors); the link must end with nothing held.
    `key` seals (and with `encrypted` encrypts) the handoff; the receiver opens it with
    `receiver_key` (default: the same key)."""
    errors = []
    with InProcessLink(fault=fault) as link:
        link.receiver.open("r")

        def send():
            try:
                send_handoff(link.sender, "r", action, model.shape, ids, source,
                             chunk_tokens=chunk_tokens, transfer=transfer, hooks=hooks, key=key,
                             encrypted=encrypted)
            except Exception as exc:  # noqa: BLE001 - surfaced by the test
                errors.append(exc)
            finally:
                close = getattr(source, "close", None)
                if close is not None:
                    close()

        sender = threading.Thread(target=send)
        sender.start()
        try:
            result = receive_handoff(model, link.receiver, "r", schedule, timeout=30,
                                     key=key if receiver_key is None else receiver_key,
                                     encrypted=encrypted)
        finally:
            sender.join()
        assert link.receiver.pending() == {"open_requests": 0, "buffered_messages": 0}
    return result, errors
