"""The UCX transport (through `ucxx`): the contract of `base`, between processes and machines.

The decode side runs a `UcxReceiver` (`receiver`), which listens on a host:port (its `address`);
the prefill side runs a `UcxSenderPool` (`sender`), which keeps one `UcxSender` per receiver
address, each with one UCX endpoint made on first use and reused by every later request. Both drive
UCX from one `UcxEngine` (`engine`): a thread with its own asyncio loop, so the blocking
`send/recv/flush` of the contract can be called from any thread, including handoff threads and a
gRPC server's event loop (through `asyncio.to_thread`). ucxx has one global context per process,
so a receiver and a sender pool in one process share one engine (`acquire_engine`,
`release_engine`); `factory` builds them that way.

On the wire every message is tagged, not merely ordered (`framing`): part p of message seq of
request r travels under the 64-bit UCX tag `H(r) << 16 | seq << 4 | p`, where H is a 48-bit BLAKE2
hash of the request id. Part 0 is a small frame (length-prefixed JSON: name, header, buffer names,
sizes and memory kinds); parts 1..15 are the buffers, sent from where they live: device memory for
CUDA tensors (GPU to GPU where UCX has CUDA transports), host memory otherwise. The receiver posts
a receive for exactly the tag it expects next, into a buffer of the announced size, so a message of
another request, or a late message of a closed one, can never be received into this request.
Request ids must be unique per transfer (the services add a nonce to each request's id).

Each open request has a reader on the engine loop that receives its messages in order as soon as
they arrive, up to `prefetch` messages ahead of the consumer, so the wire does not idle while the
consumer decodes the previous layer (a rendezvous send completes only once its receive is posted).
Each message it hands over carries its `Arrival` (how long the reader took to look for it, whether
it was already there, when its last byte landed; `arrivals`), from which the decode worker estimates
the link. A request aborted before its last message (timeout, error, cancelled request) is drained
(`ReceiveState.DRAINING`): its reader discards what it has queued and, for `drain_seconds` after
the last arrival, takes and discards the remaining messages in order, so the sender's pending sends
complete and UCX holds no unexpected data for it; they count as `strays`.
Messages for a request that is never opened are never received: a large one sent by rendezvous makes
the sender's `flush` time out, an eager one stays in UCX's unexpected queue until the worker closes.
The services only send for requests the decode side has opened.

A slower link is emulated in front of the senders by `pacing.PacedSender` (`UcxSenderPool`'s
`pace_gbps`), not by the UCX sender itself.
"""

from rekv_core.transport.ucx.engine import (HOST_EAGER_ENV, UcxEngine, acquire_engine,
                                            release_engine)
from rekv_core.transport.ucx.framing import message_tag
from rekv_core.transport.ucx.receiver import UcxReceiver
from rekv_core.transport.ucx.sender import UcxSender, UcxSenderPool

__all__ = ["HOST_EAGER_ENV", "UcxEngine", "UcxReceiver", "UcxSender", "UcxSenderPool",
           "acquire_engine", "message_tag", "release_engine"]
