"""An emulated cross-node link: two network namespaces joined by a veth pair, shaped with `tc tbf`.

`EmulatedLink()` creates namespaces `rekv<id>p` (prefill side) and `rekv<id>d` (decode side), a veth
pair between them with the addresses 10.213.0.1 and .2, which exist only inside those namespaces,
and a token-bucket filter (`tbf`) on both ends; `set_rate(gbps)` reshapes it. Traffic between the
two addresses only ever crosses this pair. `set_up(False)` black-holes the link: both ends of the
pair go down, so no packet crosses and the route between the two addresses goes too; `set_up(True)`
brings both ends and the route back (the `tbf` stays). Open TCP connections are not reset: they
stall, their retransmission timers back off, and they resume at the next retransmission after the
link is back (seconds later after a long outage). `close()` (also on `with` exit, even after an
error) deletes both namespaces, which removes the pair. It needs root and the `ip` and `tc`
commands; `unavailable()` says why when they are missing. This kernel's `tc` has no `netem`: there
is no delay or loss emulation, only rate and the black hole.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

# Private addresses that exist only inside the two namespaces this module makes. (UCX's TCP
# transport does not use link-local 169.254/16 interfaces, so those cannot serve.)
PREFILL_ADDRESS = "10.213.0.1"
DECODE_ADDRESS = "10.213.0.2"


def unavailable() -> str | None:
    """Why an emulated link cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (iproute2)"
    return None


def _run(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip()}")


class EmulatedLink:
    def __init__(self, gbps: float):
        why = unavailable()
        if why:
            raise RuntimeError(f"emulated link: {why}")
        tag = uuid.uuid4().hex[:6]
        self.prefill_ns, self.decode_ns = f"rekv{tag}p", f"rekv{tag}d"
        self._veth = (f"rk{tag}p", f"rk{tag}d")
        self.gbps = gbps
        self._made: list[str] = []
        try:
            for ns in (self.prefill_ns, self.decode_ns):
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
            p, d = self._veth
            _run("ip", "link", "add", p, "netns", self.prefill_ns, "type", "veth", "peer",
                 "name", d, "netns", self.decode_ns)
            for ns, dev, address in ((self.prefill_ns, p, PREFILL_ADDRESS),
                                     (self.decode_ns, d, DECODE_ADDRESS)):
                _run("ip", "-n", ns, "addr", "add", f"{address}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                     *self._tbf(gbps))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _tbf(gbps: float) -> list[str]:
        rate_bits = int(gbps * 1e9)
        burst = max(64 * 1024, rate_bits // 8 // 250)  # about 4 ms of traffic
        return ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "100ms"]

    def set_rate(self, gbps: float) -> None:
        for ns, dev in zip((self.prefill_ns, self.decode_ns), self._veth):
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "change", "dev", dev, "root",
                 *self._tbf(gbps))
        self.gbps = gbps

    def set_up(self, up: bool) -> None:
        """Take both ends of the veth pair down (a black hole) or bring them back up."""
        for ns, dev in zip((self.prefill_ns, self.decode_ns), self._veth):
            _run("ip", "-n", ns, "link", "set", dev, "up" if up else "down")

    def prefix(self, side: str) -> list[str]:
        """The command prefix that runs a program inside one side's namespace."""
        return ["ip", "netns", "exec", self.prefill_ns if side == "prefill" else self.decode_ns]

    def close(self) -> None:
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []

    def __enter__(self) -> EmulatedLink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
