"""Start the two services as separate processes on this machine and stop them cleanly.

`ServicePair(...)` starts `rekv serve prefill` then `rekv serve decode` pointed at it (on 127.0.0.1
unless `--host` says otherwise; in plaintext unless the arguments or the environment give a
certificate; free ports chosen by the services and read back from their ready
files; each optionally under a command prefix such as `ip netns exec NS`), waits until both
answer, and on `stop()` sends SIGTERM and waits for a clean exit (SIGKILL only past `stop_timeout`).
Used by `rekv demo` and by the end-to-end tests; logs go to `log_dir`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class ServiceProcess:
    def __init__(self, role: str, args: list[str], log_dir: Path, env: dict | None = None,
                 prefix: list[str] = ()):
        self.role = role
        self.ready_file = log_dir / f"{role}.ready.json"
        self.log_path = log_dir / f"{role}.log"
        self.ready_file.unlink(missing_ok=True)
        if "--tls-cert" not in args and "REKV_TLS_CERT" not in {**os.environ, **(env or {})}:
            args = ["--plaintext", "true", *args]  # on this machine's loopback, said explicitly
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "rekv_cli", "serve", role, "--ready-file",
             str(self.ready_file), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.info: dict = {}

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                return self.info
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.role} service exited with {self.process.returncode}; "
                                   f"log:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.role} service not ready after {timeout} s; "
                           f"log:\n{self.log_path.read_text()[-4000:]}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


class ServicePair:
    def __init__(self, prefill_args: list[str] = (), decode_args: list[str] = (),
                 log_dir: str | Path | None = None, env: dict | None = None,
                 ready_timeout: float = 300.0, prefill_prefix: list[str] = (),
                 decode_prefix: list[str] = ()):
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="rekv-services-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.prefill = ServiceProcess("prefill", list(prefill_args), self.log_dir, env,
                                      prefill_prefix)
        try:
            prefill_info = self.prefill.wait_ready(ready_timeout)
            self.decode = ServiceProcess(
                "decode", ["--prefill-address", prefill_info["grpc"], *decode_args],
                self.log_dir, env, decode_prefix)
            self.decode.wait_ready(ready_timeout)
        except BaseException:
            self.prefill.stop()
            if hasattr(self, "decode"):
                self.decode.stop()
            raise

    @property
    def decode_address(self) -> str:
        return self.decode.info["grpc"]

    def metrics_url(self, role: str) -> str:
        return f"http://{getattr(self, role).info['metrics']}/metrics"

    def stop(self) -> dict[str, int]:
        return {"decode": self.decode.stop(), "prefill": self.prefill.stop()}

    def __enter__(self) -> ServicePair:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
