"""Where a GPU run ran: its provenance (commit, clean tree, start), device, driver, and the
versions of torch, Triton and UCX.

    python bench/gpu/env_info.py [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rekv_cli.bench.machine import machine_info  # noqa: E402
from rekv_cli.bench.provenance import provenance  # noqa: E402

# what the figures measure (`provenance`): this script only (where the run ran, no code of rekv)
MEASURES = ("bench/gpu/env_info.py",)

PACKAGES = ("triton", "ucxx-cu13", "ucxx-cu12", "libucx-cu13", "libucx-cu12", "grpcio",
            "protobuf", "transformers", "cryptography", "gguf", "numpy")  # those found


def driver() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True, timeout=20
                              ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def main() -> int:
    started = provenance(measures=MEASURES)
    parser = argparse.ArgumentParser(description="record where a GPU run ran")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = {**started, **machine_info(device, torch.bfloat16, torch.get_num_threads())}
    info |= {"cuda": torch.version.cuda, "driver": driver(), "packages": versions()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"gpu_memory_gib": round(props.total_memory / 2**30, 1),
                 "gpu_sms": props.multi_processor_count}
    text = json.dumps(info, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
