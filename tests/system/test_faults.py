"""Faults injected into real processes: the decode service never loses a request it accepted.

One decode service runs throughout, pointed at a fixed prefill port, where a prefill service runs
with `--fault-inject by_request` (services/prefill/faults.py: a request id `hold_boundary/x` holds
that handoff after its boundary, `flip_bit/x` flips a bit of it, ...); tests kill it with SIGKILL
(and start another), or send from a hostile process (tests/support/rogue_peer.py). After each fault
the request must complete with the reference's tokens (recomputed on the decode side, and counted
by reason; only the lost layers where only prefix layers were lost), nothing may stay held (the
data plane's pending state, the handoffs and transfers in flight), and the services must keep
serving. (`REKV_FUZZ_UCX_CONNECTIONS` and
`REKV_FUZZ_UCX_FRAMES` raise the number of random-byte connections and random frames for a bench
run.)
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from rekv_cli.client import generate, generate_request
from rekv_cli.launcher import ServiceProcess
from rekv_core.model import Model, greedy_generate, load_weights
from services.rpc import rekv_pb2_grpc
from tests.support.paths import ROGUE_PEER, ROOT

# each answer the reference's under any batch (the batch-invariant kernels on both workers)
THREADS = ["--torch-threads", "1", "--dtype", "bfloat16", "--batch-invariant", "true"]
PROMPT = ("The history of the city begins with a small settlement on the river. " * 6
          + "In the end, the city")
NEW_TOKENS = 6
BF16_JOINT = ("bf16", 15)
SEED = (False, 0)  # the seed's schedule: the boundary first, then layers 0..c-1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(tokenizer):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the services: a recompute there is then bit-identical
    try:
        model = Model(load_weights("smollm2-135m", torch.bfloat16))
        return greedy_generate(model, tokenizer.encode(PROMPT), NEW_TOKENS,
                               tokenizer.eos_token_id)
    finally:
        torch.set_num_threads(threads)


class Cluster:
    """A decode service, and prefill services started on demand at the address it calls."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.prefill_port = _free_port()
        self.decode = ServiceProcess("decode", [
            "--prefill-address", f"127.0.0.1:{self.prefill_port}", *THREADS,
            "--prefill-refresh-s", "0.5"], log_dir)
        self.decode.wait_ready(300)
        self.channel = grpc.insecure_channel(self.decode.info["grpc"])
        self.started = 0
        self.serving: ServiceProcess | None = None
        self.decode_threads = 0  # after its first fallback (its pools started)

    def prefill(self) -> ServiceProcess:
        """The prefill service at the decode service's prefill address, started when none runs;
        it injects the fault a request id names (`fault/name`)."""
        if self.serving is not None and self.serving.process.poll() is None:
            return self.serving
        self.started += 1
        directory = self.log_dir / f"prefill-{self.started}"
        directory.mkdir()
        self.serving = ServiceProcess("prefill", [
            "--grpc-port", str(self.prefill_port), *THREADS, "--fault-inject", "by_request",
            "--fault-hold-s", "60"], directory)
        self.serving.wait_ready(300)
        return self.serving

    def kill_prefill(self) -> None:
        self.serving.process.send_signal(signal.SIGKILL)
        self.serving.stop()
        self.serving = None

    def request(self, name: str, timeout: float = 120.0, forced=BF16_JOINT, schedule=None):
        return generate(self.channel, name, PROMPT, NEW_TOKENS, forced_action=forced,
                        timeout=timeout, forced_schedule=schedule)

    def metrics(self, process: ServiceProcess) -> str:
        with urllib.request.urlopen(f"http://{process.info['metrics']}/metrics") as response:
            return response.read().decode()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("faults"))
    yield cluster
    cluster.channel.close()
    assert cluster.decode.stop() == 0
    if cluster.serving is not None:
        assert cluster.serving.stop() == 0


def _held(text: str) -> dict[str, float]:
    """What a service still holds: every gauge that must fall back to zero when it is idle."""
    found = {}
    for name in ("rekv_transport_pending", "rekv_handoffs_in_flight"):
        found[name] = float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
    for state, value in re.findall(r'^rekv_transfers\{state="(\w+)"\} (\S+)$', text, re.M):
        found[f"transfers.{state}"] = float(value)
    return found


def assert_nothing_held(cluster: Cluster, *processes: ServiceProcess, within: float = 20.0):
    """Aborted transfers drain for a few seconds; then every gauge must read zero."""
    deadline = time.monotonic() + within
    while True:
        held = {p.role: {k: v for k, v in _held(cluster.metrics(p)).items() if v}
                for p in processes}
        if not any(held.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still held after {within} s: {held}")
        time.sleep(0.25)


def gauge(cluster: Cluster, process: ServiceProcess, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", cluster.metrics(process), re.M).group(1))


def wait_for_transfer_state(cluster: Cluster, state: str, timeout: float = 60.0) -> None:
    """Until the decode service counts a transfer in `state` (`rekv_transfers{state}`): a hold
    on the prefill side says what left, not what has arrived."""
    pattern = re.compile(rf'^rekv_transfers\{{state="{state}"\}} (\S+)$', re.M)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = pattern.search(cluster.metrics(cluster.decode))
        if match and float(match.group(1)) >= 1:
            return
        time.sleep(0.02)
    raise TimeoutError(f"no transfer reached {state} on the decode service")


def threads(process: ServiceProcess) -> int:
    status = Path(f"/proc/{process.process.pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)$", status, re.M).group(1))


def fallbacks(cluster: Cluster) -> dict[str, float]:
    text = cluster.metrics(cluster.decode)
    return {reason: float(value) for reason, value in
            re.findall(r'^rekv_fallbacks_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


def recoveries(cluster: Cluster) -> dict[str, tuple[float, float]]:
    """By scope: (fallbacks, layers recomputed)."""
    text = cluster.metrics(cluster.decode)
    counts = dict(re.findall(r'^rekv_fallback_recompute_seconds_count\{scope="(\w+)"\} (\S+)$',
                             text, re.M))
    layers = dict(re.findall(r'^rekv_fallback_recomputed_layers_total\{scope="(\w+)"\} (\S+)$',
                             text, re.M))
    return {scope: (float(counts[scope]), float(layers.get(scope, 0))) for scope in counts}


def wait_for_hold(process: ServiceProcess, request_id: str, timeout: float = 120.0) -> str:
    """The transfer id the prefill service holds for `request_id` (from its log)."""
    pattern = re.compile(rf"holding request={re.escape(request_id)} transfer=(\S+) at")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = pattern.search(process.log_path.read_text())
        if match:
            return match.group(1)
        time.sleep(0.05)
    raise TimeoutError(f"no hold for {request_id}:\n{process.log_path.read_text()[-3000:]}")


class InBackground:
    """A request on its own thread; `result()` returns its outcome or raises its error."""

    def __init__(self, cluster: Cluster, name: str, schedule=None):
        self.outcome = None
        self.thread = threading.Thread(target=self._run, args=(cluster, name, schedule))
        self.thread.start()

    def _run(self, cluster: Cluster, name: str, schedule) -> None:
        try:
            self.outcome = cluster.request(name, schedule=schedule)
        except BaseException as exc:
            self.outcome = exc

    def result(self, timeout: float = 180.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the request never ended"
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def _rogue(*args: str) -> None:
    done = subprocess.run([sys.executable, str(ROGUE_PEER), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0 and "sent" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("fault", ["flip_bit", "forge_checksum", "replay"])
def test_tampered_messages_are_never_written_into_a_cache(cluster, reference, fault):
    prefill = cluster.prefill()
    assert not cluster.request(f"before-{fault}").summary.fallback  # replay: the one replayed
    before = fallbacks(cluster).get("integrity", 0)
    result = cluster.request(f"{fault}/tampered")
    assert result.token_ids == reference
    assert result.summary.fallback_reason.startswith("integrity"), result.summary
    assert fallbacks(cluster)["integrity"] == before + 1
    assert_nothing_held(cluster, cluster.decode, prefill)


def test_a_lost_lynx_residual_falls_back_without_sending_an_unverified_token(cluster, reference):
    """Lynx's streams with a bit flipped in the first residual: the decode side has sent the exact
    first token and drafted on the anchors; the residual fails its checks, nothing drafted is
    sent, the prompt is recomputed here, and the request completes with the reference's tokens."""
    prefill = cluster.prefill()
    before = fallbacks(cluster).get("integrity", 0)
    result = cluster.request("flip_residual/lynx", forced=("int8", 15, "bf16", 0, True))
    assert result.token_ids == reference
    assert result.summary.fallback_reason.startswith("integrity"), result.summary
    assert fallbacks(cluster)["integrity"] == before + 1
    assert_nothing_held(cluster, cluster.decode, prefill)


def test_a_process_without_the_key_cannot_inject_kv(cluster, reference):
    """While the real prefill holds each handoff before sending anything, another process sends
    forged messages under the open transfer's tags: rejected, and the request still completes."""
    address = cluster.decode.info["ucx"]
    prefill = cluster.prefill()
    for mode, reason in (("wrong_key", "integrity"), ("unsealed", "integrity"),
                         ("garbage", "transfer"), ("oversized", "transfer")):
        before = fallbacks(cluster).get(reason, 0)
        pending = InBackground(cluster, f"hold_negotiation/forged-{mode}")
        transfer = wait_for_hold(prefill, f"hold_negotiation/forged-{mode}")
        _rogue(address, mode, transfer)
        result = pending.result()
        assert result.token_ids == reference, mode
        assert result.summary.fallback_reason.startswith(reason), result.summary
        assert fallbacks(cluster)[reason] == before + 1
    _rogue(address, "random_tcp", os.environ.get("REKV_FUZZ_UCX_CONNECTIONS", "20"))
    _rogue(address, "frames", os.environ.get("REKV_FUZZ_UCX_FRAMES", "50"))
    assert_nothing_held(cluster, cluster.decode, prefill)
    assert not cluster.request("after-forgeries").summary.fallback


def test_decode_killed_mid_stream_and_restarted(cluster, reference, tmp_path):
    """A caller that cancels mid-stream frees the decode side; one whose decode process is killed
    mid-stream sees a clear error; the restarted decode service (same ports) serves the next
    request, and the prefill service, which kept its connection to the old process, reconnects
    without a restart."""
    prefill = cluster.prefill()
    ports = ["--grpc-port", str(_free_port()), "--ucx-port", str(_free_port())]
    args = ["--prefill-address", f"127.0.0.1:{cluster.prefill_port}", *THREADS, *ports]
    decode = ServiceProcess("decode", args, tmp_path)
    try:
        decode.wait_ready(300)
        with grpc.insecure_channel(decode.info["grpc"]) as channel:
            cancelled = rekv_pb2_grpc.DecodeStub(channel).Generate(
                generate_request("cancelled-mid-stream", PROMPT, 64, BF16_JOINT,
                                 stop_at_eos=False), timeout=120)
            with pytest.raises(grpc.RpcError) as error:
                for index, _ in enumerate(cancelled):
                    if index == 2:
                        cancelled.cancel()
            assert error.value.code() == grpc.StatusCode.CANCELLED
            assert_nothing_held(cluster, decode, prefill)
            connections = gauge(cluster, prefill, "rekv_transport_connections")
            stream = rekv_pb2_grpc.DecodeStub(channel).Generate(
                generate_request("long", PROMPT, 64, BF16_JOINT, stop_at_eos=False), timeout=120)
            with pytest.raises(grpc.RpcError) as error:
                for _ in stream:
                    decode.process.send_signal(signal.SIGKILL)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        decode.stop()
        decode = ServiceProcess("decode", args, tmp_path)
        decode.wait_ready(300)
        with grpc.insecure_channel(decode.info["grpc"]) as channel:
            results = [generate(channel, f"restarted-{i}", PROMPT, NEW_TOKENS,
                                forced_action=BF16_JOINT, timeout=120) for i in range(2)]
        assert all(r.token_ids == reference for r in results)
        assert not results[-1].summary.fallback, "the prefill side never reconnected"
        assert_nothing_held(cluster, decode, prefill)
        # the connection to the killed process was replaced, not added to
        assert gauge(cluster, prefill, "rekv_transport_connections") == connections
    finally:
        assert decode.stop() == 0


def _cancel_while_held(cluster: Cluster, prefill: ServiceProcess) -> None:
    """A caller that cancels its call while the handoff is held mid-transfer: both sides let go
    of it (the prefill side sees its own call cancelled and stops sending)."""
    stub = rekv_pb2_grpc.DecodeStub(cluster.channel)
    call = stub.Generate(generate_request("hold_boundary/cancelled", PROMPT, NEW_TOKENS,
                                          BF16_JOINT), timeout=120)
    wait_for_hold(prefill, "hold_boundary/cancelled")
    call.cancel()
    with pytest.raises(grpc.RpcError) as error:
        list(call)
    assert error.value.code() == grpc.StatusCode.CANCELLED
    assert_nothing_held(cluster, cluster.decode, prefill)


def test_prefill_killed_mid_handoff_loses_nothing(cluster, reference):
    """SIGKILL during negotiation, after the boundary, and mid-prefix; at the boundary a caller
    also cancels first. Each request completes with the reference's tokens; then a new prefill
    process at the same address serves handoffs again."""
    for point in ("negotiation", "boundary", "prefix"):
        prefill = cluster.prefill()
        if point == "boundary":
            _cancel_while_held(cluster, prefill)
        before = fallbacks(cluster).get("prefill_unavailable", 0)
        pending = InBackground(cluster, f"hold_{point}/killed")
        wait_for_hold(prefill, f"hold_{point}/killed")
        cluster.kill_prefill()
        result = pending.result()
        assert result.token_ids == reference, point
        assert result.summary.fallback, "a dead prefill cannot have completed the handoff"
        summary = result.summary
        if summary.fallback_scope == "partial":  # only where the whole boundary had left first:
            # pipelined (one chunk here) or the seed's schedule, never streamed in layer order
            assert point != "negotiation" and (
                summary.schedule.pipelined or not summary.schedule.streamed), summary
            assert summary.recomputed_layers == BF16_JOINT[1]
        else:
            assert (summary.fallback_scope, summary.recomputed_layers) == ("full", 30), summary
        assert fallbacks(cluster)["prefill_unavailable"] == before + 1
        assert_nothing_held(cluster, cluster.decode)
        cluster.decode_threads = cluster.decode_threads or threads(cluster.decode)

    clean = cluster.prefill()  # the same address, a new process: the handoff works again
    again = cluster.request("after-kills")
    assert again.token_ids == reference and not again.summary.fallback
    assert_nothing_held(cluster, cluster.decode, clean)
    # the endpoints of the three killed processes are gone; the new one's is live
    assert gauge(cluster, cluster.decode, "rekv_transport_connections") == 1
    assert gauge(cluster, clean, "rekv_transport_connections") == 1
    assert threads(cluster.decode) <= cluster.decode_threads + 4  # a pool's spares at most


def test_only_the_lost_layers_are_recomputed(cluster, reference):
    """A bit flipped in the last prefix layer, and a prefill killed mid-prefix after its boundary
    left (the seed's schedule): the decode service keeps the verified layers and the suffix and
    recomputes layers 0..14 alone, with the reference's tokens, and counts it by scope."""
    prefill = cluster.prefill()
    before = recoveries(cluster).get("partial", (0.0, 0.0))
    flipped = cluster.request("flip_late_bit/partial")
    pending = InBackground(cluster, "hold_prefix/killed-partial", schedule=SEED)
    wait_for_hold(prefill, "hold_prefix/killed-partial")
    wait_for_transfer_state(cluster, "prefix")  # the boundary is in hand, not only sent
    cluster.kill_prefill()
    killed = pending.result()
    for result, reason in ((flipped, "integrity"), (killed, "prefill_unavailable")):
        assert result.token_ids == reference, result.summary
        assert result.summary.fallback_reason.startswith(reason), result.summary
        assert result.summary.fallback_scope == "partial", result.summary
        assert result.summary.recomputed_layers == BF16_JOINT[1]
        assert result.summary.bytes.boundary > 0
    assert recoveries(cluster)["partial"] == (before[0] + 2, before[1] + 2 * BF16_JOINT[1])
    assert_nothing_held(cluster, cluster.decode)
