"""The link probe: bursts of back-to-back messages that time the data plane before any handoff.

A streamed handoff sends each prefix layer as the prefill computes it, so on a link faster than
the compute nothing queues on the wire and the handoff itself says nothing of the link's rate;
token-only sends nothing at all. A decode worker that has never timed the link plans blind. So
when a prefill replica connects to a decode worker (`Prefill.Connect`), it sends a probe:

- `send_probe(sender, request_id, key)` sends stages of `PROBE_MESSAGES` messages named
  `probe` (their header: the stage's number), each stage four times the bytes of the one before
  (`PROBE_STAGES`), flushing after each, and stops after the first stage from the second on that
  took `STAGE_S` or longer to leave (so a slow link costs about two stages, a fast one at most
  the last), then sends `probe.end`;
- `receive_probe(transport, request_id, key, timeout_s)` reads them, each checked against the
  handoff-style key (`seal`: no other process can feed it a rate), and returns a link sample
  (bytes, seconds): every message's bytes after the anchor, over the time from the anchor's last
  byte to the last message's, plus the anchor's arrival `window` (it landed up to that long
  before the reader saw it). The anchor is the second stage's first message when it landed while
  the reader waited for it (the sender paced its sends, or waited for the first stage to be
  taken in): the first stage then warms the reader's code paths, whose first message can be seen
  late, which would make the link look faster. Over TCP the kernel's buffers take the first stage
  in at once and the second queues right behind it on the wire; the anchor is then the first
  message. Each stage is posted at once, so within a stage the
  messages queue on the wire; between stages the wire may idle while the sender waits for the
  last one to leave, which only lengthens the time, as does a reader that falls behind (it makes
  the end later). So the sample is the link's rate, a little less for the gaps between stages,
  or how fast this worker takes bytes in when that is slower, which bounds a handoff just as
  well. It errs high only when the anchor's last byte is stamped late (the reader's thread kept
  from the core just then): by that delay over the probe's time, which on a loaded machine is
  a sizeable share of a probe of a few tens of ms. None when the transport does not stamp
  arrivals (in-process), or neither anchor landed while the reader waited for it.

A handoff's own link samples (`transport.arrivals`) must tell wire time from the sender's pauses
and are rare for streamed handoffs; the probe is back to back by construction. Its bytes are
zeros: a probe carries nothing but its length, which its seal binds (`Protection.SIZES`: no MAC
reads the bytes, which go nowhere). The receiver must have opened `request_id` first,
as for a handoff.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rekv_core.handoff.bulk_mac import Protection
from rekv_core.handoff.seal import open_message, seal
from rekv_core.handoff.transfer import Transfer
from rekv_core.transport import Message, TransportError, TransportReceiver, TransportSender
from rekv_core.transport.arrivals import Arrival
from rekv_core.units import MiB

PROBE = "probe"
PROBE_END = "probe.end"
PROBE_MESSAGES = 8  # per stage at least, each of at most `PROBE_MESSAGE_BYTES`
PROBE_MESSAGE_BYTES = MiB  # within any receiver's message limit (`TransportOptions`)
PROBE_STAGES = (MiB // 2, 2 * MiB, 8 * MiB, 32 * MiB)  # bytes per stage
STAGE_S = 0.02  # a stage that took this long to leave timed the link well enough


@dataclass(frozen=True)
class ProbeSent:
    bytes: int
    seconds: float  # from the first send until the last stage had left


def send_probe(sender: TransportSender, request_id: str, key: bytes | None,
               stages: tuple[int, ...] = PROBE_STAGES, stage_s: float = STAGE_S,
               timeout_s: float = 30.0) -> ProbeSent:
    """Send the probe (module doc) to the receiver behind `sender`; raises `TimeoutError` when a
    stage has not left within `timeout_s`, `TransportError` when it cannot leave."""
    payload = torch.zeros(PROBE_MESSAGE_BYTES, dtype=torch.uint8)
    seq, sent, began = 0, 0, time.perf_counter()
    for number, stage in enumerate(stages):
        size = min(stage // PROBE_MESSAGES, PROBE_MESSAGE_BYTES)
        started = time.perf_counter()
        for _ in range(stage // size):
            sender.send(seal(key, Message(request_id, seq, PROBE, str(number).encode(),
                                          {"bytes": payload[:size]}), Protection.SIZES))
            seq += 1
            sent += size
        sender.flush(request_id, timeout_s)
        if number >= 1 and time.perf_counter() - started >= stage_s:
            break
    sender.send(seal(key, Message(request_id, seq, PROBE_END), Protection.SIZES))
    sender.flush(request_id, timeout_s)
    return ProbeSent(sent, time.perf_counter() - began)


def receive_probe(transport: TransportReceiver, request_id: str, key: bytes | None,
                  timeout_s: float = 30.0) -> tuple[int, float] | None:
    """The probe's link sample (bytes, seconds), or None when it timed nothing; closes the
    receive (aborts it on any error, which is raised: `TimeoutError`, `TransportError`,
    `SealError`)."""
    transfer = Transfer(request_id, time.monotonic() + timeout_s, timeout_s)
    arrivals: list[Arrival] = []
    anchor = 0  # the index of the second stage's first message, once seen
    try:
        while True:
            message = open_message(key, transport.recv(request_id, transfer.wait_s()),
                                   Protection.SIZES)
            if message.name == PROBE_END:
                break
            if message.name != PROBE:
                raise TransportError(f"probe {request_id}: unexpected message {message.name!r}")
            if message.arrival is not None:
                if message.header == b"1" and not anchor:
                    anchor = len(arrivals)
                arrivals.append(message.arrival)
    except BaseException:
        transport.abort(request_id)
        raise
    transport.close(request_id)
    for start in dict.fromkeys((anchor, 0)):
        train = arrivals[start:]
        if (len(train) >= 2 and train[0].came_while_looking
                and train[-1].completed > train[0].completed):
            return (sum(a.nbytes for a in train[1:]),
                    train[-1].completed - train[0].completed + train[0].window)
    return None  # no exact start: each anchor was there before the reader looked
