"""A Prometheus server of our own for the dashboard checks: Debian's `prometheus` binary
(.ci/install-prometheus.sh) with config, storage and log under a work directory, listening on a free
loopback port, scraping the given jobs every `SCRAPE_S`; its HTTP API read as JSON.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

SCRAPE_S = 1.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Prometheus:
    """A Prometheus server of our own: config, storage and log under `workdir`, loopback only."""

    def __init__(self, jobs: dict[str, list[str]], workdir: Path, ready_timeout: float = 30.0):
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        scrapes = "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: {json.dumps(targets)}\n"
            for job, targets in jobs.items())
        config.write_text(f"global:\n  scrape_interval: {SCRAPE_S:g}s\n  scrape_timeout: "
                          f"{SCRAPE_S:g}s\n  evaluation_interval: {SCRAPE_S:g}s\n"
                          f"scrape_configs:\n{scrapes}")
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.targets = sum(len(t) for t in jobs.values())
        deadline = time.monotonic() + ready_timeout
        while self.api("/api/v1/status/buildinfo").get("status") != "success":
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus not ready; log:\n{self.log_path.read_text()}")
            time.sleep(0.2)
        self.version = self.api("/api/v1/status/buildinfo")["data"]["version"]

    def api(self, path: str, **params) -> dict:
        """GET (POST with `params`) from the HTTP API: its JSON answer, errors included (a parse
        error is a 400 with status "error"; a non-JSON error body becomes one); {} while the server
        does not answer."""
        data = urllib.parse.urlencode(params).encode() if params else None
        try:
            with urllib.request.urlopen(self.url + path, data, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            body = error.read()
            try:
                return json.loads(body)
            except ValueError:  # a starting server answers 503 in plain text
                return {"status": "error", "error": body.decode(errors="replace") or "no body"}
        except OSError:
            return {}

    def query(self, expr: str, at: float) -> dict:
        return self.api("/api/v1/query", query=expr, time=f"{at:.3f}")

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict:
        return self.api("/api/v1/query_range", query=expr, start=f"{start:.3f}",
                        end=f"{end:.3f}", step=f"{step:g}")

    def wait_scraped_after(self, moment: float, scrapes: int = 2, timeout: float = 30.0) -> None:
        """Until every target has been scraped `scrapes` intervals after `moment` (unix s)."""
        deadline = time.monotonic() + timeout
        want = moment + scrapes * SCRAPE_S
        while time.monotonic() < deadline:
            answer = self.query("timestamp(up == 1)", time.time())
            stamps = [float(s["value"][1]) for s in answer.get("data", {}).get("result", [])]
            if len(stamps) == self.targets and min(stamps) >= want:
                return
            time.sleep(0.25)
        raise TimeoutError(f"targets not all scraped {scrapes} times after {moment}: "
                           f"{self.api('/api/v1/targets')}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
