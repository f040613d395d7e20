"""What a benchmark result records about where it ran: CPU, cores, threads, library versions,
device and dtype (which code it ran is `provenance`'s, read when the run starts)."""

from __future__ import annotations

import os
import platform

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


def machine_info(device: torch.device, dtype: torch.dtype, threads: int) -> dict:
    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": threads,
            "torch": torch.__version__, "python": platform.python_version(),
            "device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
