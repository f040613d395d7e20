"""A hostile process on the data plane, for the fault tests: it can reach the decode worker's UCX
port but holds no handoff key. Run from the repository's root as `python tests/support/rogue_peer.py
ADDRESS WHAT ...`, WHAT being

    random_tcp [COUNT]          COUNT TCP connections of random bytes
    garbage TRANSFER            a frame of random bytes under the transfer's first tag
    oversized TRANSFER          a 64 MiB frame under that tag
    frames COUNT                COUNT frames of random bytes and sizes, each under a random tag
    unsealed|wrong_key TRANSFER
        a well-formed plan and boundary for the transfer (the embedded model's shape), without a
        MAC or sealed with a key of its own

Prints `sent` once everything has left.
"""

from __future__ import annotations

import os
import socket
import sys

RANDOM_BYTES = 4096


def random_tcp(address: str, count: int) -> None:
    host, port = address.rsplit(":", 1)
    for _ in range(count):
        with socket.create_connection((host, int(port)), timeout=5) as connection:
            try:
                connection.sendall(os.urandom(RANDOM_BYTES))
            except OSError:  # the listener may drop the connection at once: that is fine
                pass


def random_frames(address: str, count: int) -> None:
    import random

    import torch

    from rekv_core.transport.ucx import UcxEngine, UcxSender

    engine = UcxEngine(host_eager=True)  # eager: a rendezvous send would wait for a receive
    try:
        sender = UcxSender(engine, address)

        async def send_all():
            for _ in range(count):
                size = random.choice((0, 1, 7, 100, RANDOM_BYTES))
                junk = torch.frombuffer(bytearray(os.urandom(size) or b"\0"), dtype=torch.uint8)
                await sender._endpoint.send(junk.numpy(), tag=random.getrandbits(64),
                                            force_tag=True)

        engine.call(send_all(), 60)
        sender.shutdown()
    finally:
        engine.close()


def forge(address: str, mode: str, transfer: str) -> None:
    import torch

    from rekv_core.handoff import Action
    from rekv_core.handoff.seal import new_key, seal, with_checksums
    from rekv_core.handoff import HandoffPlan
    from rekv_core.handoff.wire import BOUNDARY, PLAN
    from rekv_core.model import get_preset
    from rekv_core.transport import Message
    from rekv_core.transport.ucx import UcxEngine, UcxSender
    from rekv_core.transport.ucx.framing import message_tag

    engine = UcxEngine()
    try:
        sender = UcxSender(engine, address)
        if mode in ("garbage", "oversized"):
            junk = (torch.frombuffer(bytearray(os.urandom(RANDOM_BYTES)), dtype=torch.uint8)
                    if mode == "garbage" else torch.zeros(64 << 20, dtype=torch.uint8))

            async def send_junk():
                await sender._endpoint.send(junk.numpy(), tag=message_tag(transfer, 0, 0),
                                            force_tag=True)

            engine.call(send_junk(), 10)
        else:
            shape = get_preset("smollm2-135m")
            key = new_key() if mode == "wrong_key" else None
            seq_len = 16
            plan = HandoffPlan(Action("bf16", 15, shape.num_layers), seq_len, shape).to_bytes()
            h = {"h": torch.zeros(seq_len * shape.hidden_size * 2, dtype=torch.uint8)}
            for seq, (name, header, buffers) in enumerate(
                    ((PLAN, plan, {}), (BOUNDARY, with_checksums(h), h))):
                sender.send(seal(key, Message(transfer, seq, name, header, buffers)))
            sender.flush(transfer, 10)
        sender.shutdown()
    finally:
        engine.close()


def main(argv: list[str]) -> int:
    address, mode, *rest = argv
    if mode == "random_tcp":
        random_tcp(address, int(rest[0]) if rest else 20)
    elif mode == "frames":
        random_frames(address, int(rest[0]))
    elif mode in ("garbage", "oversized", "unsealed", "wrong_key"):
        forge(address, mode, rest[0])
    else:
        raise SystemExit(f"mode: unknown {mode!r}")
    print("sent", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
