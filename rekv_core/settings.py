"""Runtime settings, read from the environment in one place and validated once.

`RuntimeSettings.from_env(**overrides)` reads `REKV_MODEL`, `REKV_DEVICE`, `REKV_DTYPE` and
`REKV_TORCH_THREADS` (through `rekv_core.env`, the one reader of the environment); explicit
overrides (from command-line flags) win over the environment. The services' settings extend this
object (`services.settings.ServiceSettings`). BF16 is
the only dtype on CUDA; the CPU runs float32 or BF16, and `auto` picks BF16 where the CPU computes
BF16 dot products natively (AVX-512 BF16 or AMX, `rekv_core.cpu_bf16`), float32 elsewhere:
`dtype_choice()` says which and why, for the startup log and the `rekv_compute_info` metric.

CPU threads: a handoff runs two branches at once, the suffix compute and the prefix receive and
decode. The compute branch is the expensive one, so `apply_threads()` gives torch's intra-op pool
every core this process may use (`torch_threads = 0`); the prefix branch dequantizes one layer
(a small fraction of a layer's compute) between waits on the wire and takes its cycles
from that pool. Reserving a core for it instead would halve the suffix's speed on a 2-core machine;
`rekv bench handoff` reports the measured cost of the sharing (suffix seconds per layer alone and
while the prefix branch runs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rekv_core import cpu_bf16, env
from rekv_core.model.shapes import DEFAULT_MODEL
from rekv_core.plan.estimates import LINK_PRIOR_GBPS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RuntimeSettings:
    model: str = DEFAULT_MODEL  # a preset with weights, synthetic:<preset>, a .gguf or a directory
    device: str = "cpu"  # cpu, cuda or cuda:N
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with native BF16, else float32
    torch_threads: int = 0  # torch intra-op threads on the CPU; 0: every usable core
    link_gbps: float = LINK_PRIOR_GBPS  # the link rate assumed until it is measured

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device == "cuda" or
                (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"device: must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of auto, {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device.startswith("cuda") and self.dtype == "float32":
            raise ValueError("dtype: CUDA runs bfloat16 only, got float32")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads: must be >= 0, got {self.torch_threads}")
        if not self.link_gbps > 0:
            raise ValueError(f"link_gbps: must be positive, got {self.link_gbps}")

    @classmethod
    def from_env(cls, **overrides: str | None) -> RuntimeSettings:
        values = {name: env.get(f"REKV_{name.upper()}")
                  for name in ("model", "device", "dtype", "torch_threads")}
        values.update({k: v for k, v in overrides.items() if v is not None})
        if isinstance(values["torch_threads"], str):
            try:
                values["torch_threads"] = int(values["torch_threads"])
            except ValueError:
                raise ValueError(f"torch_threads: must be an integer, got "
                                 f"{values['torch_threads']!r}") from None
        return cls(**{k: v for k, v in values.items() if v is not None})

    def load_model(self):
        """The model these settings name, on their device in their dtype (a `Model`)."""
        from rekv_core.model import Model, load_weights

        return Model(load_weights(self.model, self.torch_dtype, self.device))

    def apply_threads(self) -> int:
        """Set torch's intra-op thread count; returns it."""
        threads = self.torch_threads or usable_cores()
        torch.set_num_threads(threads)
        return threads

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype_choice()[0]

    def dtype_choice(self) -> tuple[torch.dtype, str]:
        """The dtype the model runs in, and why (set, CUDA, or the CPU's BF16 support)."""
        if self.dtype != "auto":
            return DTYPES[self.dtype], "set"
        if self.device.startswith("cuda"):
            return torch.bfloat16, "auto: CUDA"
        support = cpu_bf16.native()
        if support.native:
            return torch.bfloat16, f"auto: native BF16 on this CPU ({support.reason})"
        return torch.float32, f"auto: {support.reason}"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
