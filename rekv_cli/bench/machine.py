"""What a benchmark result records about where it ran: CPU, threads, library versions, commit."""

from __future__ import annotations

import os
import platform
import subprocess
import time

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def git_commit() -> str | None:
    """This checkout's commit; where there is no git repository (a copy of the tree on a lent
    machine), the `REKV_COMMIT` environment variable the caller set."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("REKV_COMMIT")


def machine_info(device: torch.device, dtype: torch.dtype, threads: int) -> dict:
    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": threads,
            "torch": torch.__version__, "python": platform.python_version(),
            "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "git_commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
