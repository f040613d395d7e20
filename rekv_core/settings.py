"""Runtime settings, read from the environment in one place and validated once.

`RuntimeSettings.from_env(**overrides)` reads `REKV_MODEL`, `REKV_DEVICE` and `REKV_DTYPE`; explicit
overrides (from command-line flags) win over the environment. BF16 is the only dtype on CUDA; the
CPU runs float32 (default there) or BF16.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RuntimeSettings:
    model: str = "smollm2-135m"  # a preset with weights, synthetic:<preset>, a .gguf or a directory
    device: str = "cpu"  # cpu, cuda or cuda:N
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device == "cuda" or
                (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"device: must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of auto, {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device.startswith("cuda") and self.dtype == "float32":
            raise ValueError("dtype: CUDA runs bfloat16 only, got float32")

    @classmethod
    def from_env(cls, **overrides: str | None) -> RuntimeSettings:
        values = {"model": os.environ.get("REKV_MODEL"), "device": os.environ.get("REKV_DEVICE"),
                  "dtype": os.environ.get("REKV_DTYPE")}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**{k: v for k, v in values.items() if v is not None})

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return DTYPES[self.dtype]
