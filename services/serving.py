"""What both services share: the gRPC server's life cycle on uvloop, health, reflection, the
metrics endpoint, the ready file and graceful shutdown; and the base of both workers.

`serve(settings, build)` loads nothing itself: `build(server, metrics, tracing)` adds the
servicers (`tracing`: `services.tracing`, from the `OTEL_*` variables, off by default) and
returns (service names, an async `drain()` the shutdown awaits, and extra ready-file fields). On
SIGTERM or SIGINT the health status turns NOT_SERVING, the server stops accepting calls and gives
in-flight ones `shutdown_grace_s` to finish, after which they are cancelled (their handoffs fail
cleanly and free their buffers); then `drain()` runs, the spans still queued are exported, and the
process exits 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import faulthandler
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rekv_core.handoff import Action, wire_bytes
from rekv_core.handoff.fingerprint import model_fingerprint
from rekv_core.handoff.transfer import TransferBook
from rekv_core.model.tokenizer import load_tokenizer
from rekv_core.transport import TransportOptions
from rekv_core.units import MiB
from services import tls
from services.admission import Admission
from services.metrics import ServiceMetrics
from services.settings import ServiceSettings
from services.tracing import Tracing

log = logging.getLogger("rekv.serve")

MAX_MESSAGE_BYTES = 64 << 20
Build = Callable[[grpc.aio.Server, ServiceMetrics, Tracing],
                 Awaitable[tuple[list[str], Callable[[], Awaitable[None]], dict]]]


class Worker:
    """What both workers hold: settings, metrics, the model and its torch threads, its tokenizer
    (None: served by token ids) and fingerprint (`handoff.fingerprint`: logged, exported as
    `rekv_model_info`, and in every handoff), the book of live transfers and the admission
    bounds."""

    def __init__(self, settings: ServiceSettings, metrics: ServiceMetrics):
        self.settings = settings
        self.metrics = metrics
        self.threads = settings.apply_threads()
        dtype, why = settings.dtype_choice()
        dtype_name = str(dtype).removeprefix("torch.")
        log.info("%s computes in %s on %s (%s), %d torch thread(s)", settings.role, dtype_name,
                 settings.device, why, self.threads)
        metrics.record_compute(settings.device, dtype_name, why)
        self.model = settings.load_model()
        self.shape = self.model.shape
        self.tokenizer = load_tokenizer(settings.model)
        self.fingerprint = model_fingerprint(self.model.weights, self.tokenizer)
        log.info("%s model fingerprint %s", settings.role, self.fingerprint.describe())
        metrics.record_model(self.shape.name, self.fingerprint.hex)
        self.transfers = TransferBook()
        what = "request" if settings.role == "decode" else "handoff"
        self.admission = Admission(admitted_calls(settings), settings.max_inflight_bytes, what)
        metrics.watch_transfers(self.transfers.count)
        metrics.inflight_bytes.set_function(lambda: self.admission.bytes)

    def bf16_bytes(self, prompt_len: int) -> int:
        """What full BF16 transfer of a prompt this long moves: the saving's reference."""
        return wire_bytes(Action.full_bf16(self.shape.num_layers), self.shape, prompt_len).total

    def transport_options(self) -> TransportOptions:
        """The data plane's options on this worker. Host memory travels eagerly into large
        socket buffers; device memory needs UCX's rendezvous protocol. No message may announce
        more than the largest one a handoff of the longest allowed prompt sends (a BF16 layer
        or the boundary), plus a MiB for headers."""
        s = self.settings
        largest = max(self.shape.kv_layer_bytes(s.max_prompt_tokens),
                      self.shape.boundary_bytes(s.max_prompt_tokens))
        return TransportOptions(host=s.advertise_host or s.host, port=s.ucx_port,
                                device=str(self.model.device),
                                loop_nice=s.loop_nice,
                                host_eager=self.model.device.type == "cpu",
                                pace_gbps=s.pace_gbps, max_message_bytes=largest + MiB)


def _health_only_server(settings: ServiceSettings, health_servicer
                        ) -> tuple[grpc.aio.Server, int]:
    """With TLS: grpc.health.v1 alone, in plaintext, for probes that cannot speak TLS."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{settings.host}:{settings.health_port}")
    if not port:
        raise OSError(f"health_port: cannot bind {settings.host}:{settings.health_port}")
    return server, port


def run(settings: ServiceSettings, build: Build) -> NoReturn:
    faulthandler.enable()  # a crash in native code leaves every thread's stack in the log
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
    except ImportError:  # not on Linux or macOS: the standard loop still works
        code = asyncio.run(serve(settings, build))
    else:
        code = uvloop.run(serve(settings, build))
    _exit_now(code)


def _exit_now(code: int) -> None:
    """End the process once the drain is done, without the interpreter's teardown: every call
    has ended and every resource the services hold is closed by then, while native libraries'
    own finalizers racing at interpreter exit have crashed a clean stop (UCX's async handler,
    `async.c:149: Assertion handler->id == id`, after a killed peer's endpoints)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def admitted_calls(settings: ServiceSettings) -> int:
    """The calls admission lets in at once (`Worker.admission`): the handoff slots and the queue,
    and on a decode worker with its engine the streams, which hold their call beyond them."""
    decoding = settings.max_batch if (settings.role, settings.decode_path) == (
        "decode", "batched") else 0
    return settings.max_concurrent + decoding + settings.max_queue


def call_threads(settings: ServiceSettings) -> int:
    """Threads for the calls' blocking work (`asyncio.to_thread`): one for every call admission
    lets in (`admitted_calls`), plus a few for the rest (connects, start-up, shutdown). The
    default pool (at most the cores + 4) would hold admitted handoffs back from the prefill
    scheduler and the data plane, a few at a time."""
    return admitted_calls(settings) + 8


async def serve(settings: ServiceSettings, build: Build) -> int:
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(
        call_threads(settings), thread_name_prefix="rekv-call"))
    metrics = ServiceMetrics(settings.role)
    tracing = Tracing.from_env(settings.role)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    names, drain, extra = await build(server, metrics, tracing)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    credentials = tls.server_credentials(settings)
    address = f"{settings.host}:{settings.grpc_port}"
    grpc_port = (server.add_secure_port(address, credentials) if credentials
                 else server.add_insecure_port(address))
    if not grpc_port:
        raise OSError(f"grpc_port: cannot bind {address}")
    probes = _health_only_server(settings, health_servicer) if credentials else None
    metrics_port = metrics.serve(settings.host, settings.metrics_port)
    log.log(logging.WARNING if settings.plaintext else logging.INFO, "%s service security: %s",
            settings.role, tls.describe(settings))
    await server.start()
    if probes is not None:
        await probes[0].start()
    for name in ("", *names[:-2]):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = {"role": settings.role, "grpc": f"{settings.host}:{grpc_port}",
             "metrics": f"{settings.host}:{metrics_port}", "tls": credentials is not None,
             **({"health": f"{settings.host}:{probes[1]}"} if probes else {}), **extra}
    log.info("%s service ready: %s", settings.role, json.dumps(ready))
    if settings.ready_file:
        path = Path(settings.ready_file)
        path.with_suffix(".tmp").write_text(json.dumps(ready))
        path.with_suffix(".tmp").replace(path)

    await stop.wait()
    log.info("%s service stopping: in-flight calls have %.1f s", settings.role,
             settings.shutdown_grace_s)
    await health_servicer.enter_graceful_shutdown()
    if probes is not None:
        await probes[0].stop(0)
    await server.stop(settings.shutdown_grace_s)
    await drain()
    await asyncio.to_thread(tracing.shutdown)
    log.info("%s service stopped", settings.role)
    return 0
