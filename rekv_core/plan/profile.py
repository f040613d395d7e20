"""The machine profile: per-layer costs measured on the machine that will serve.

`rekv profile` writes it; the services load it at start (`--profile FILE`) instead of their own
short profile, which they measure once per machine and cache (`profile_cache`). JSON:

    {"model": ..., "device": ..., "dtype": ..., "torch_threads": ...,
     "layer_ms": {"lengths": [...], "ms": [...]},          # γ: one layer's prefill at each S
     "quantize_ms_per_mib": {"int8": ..., ...},           # α per MiB of BF16 KV (encode)
     "restore_ms_per_mib": {"int8": ..., ...},            # decode into the cache, per MiB
     "meta": {...}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rekv_core.model import Model
from rekv_core.plan.estimates import LayerCost
from rekv_core.plan.measure import measure_codec_costs, measure_layer_cost


@dataclass
class Profile:
    model: str
    device: str
    dtype: str
    torch_threads: int
    layer_cost: LayerCost
    quantize_ms_per_mib: dict[str, float]
    restore_ms_per_mib: dict[str, float]
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"model": self.model, "device": self.device, "dtype": self.dtype,
                "torch_threads": self.torch_threads, "layer_ms": self.layer_cost.as_dict(),
                "quantize_ms_per_mib": self.quantize_ms_per_mib,
                "restore_ms_per_mib": self.restore_ms_per_mib, "meta": self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        try:
            return cls(model=data["model"], device=data["device"], dtype=data["dtype"],
                       torch_threads=int(data["torch_threads"]),
                       layer_cost=LayerCost(data["layer_ms"]["lengths"], data["layer_ms"]["ms"]),
                       quantize_ms_per_mib=dict(data["quantize_ms_per_mib"]),
                       restore_ms_per_mib=dict(data["restore_ms_per_mib"]),
                       meta=dict(data.get("meta", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"profile {path}: malformed ({exc!r})") from None


def measure_profile(model: Model, codecs, lengths=(64, 256, 1024, 2048),
                    codec_prompt_len: int = 1024) -> Profile:
    costs = {c: measure_codec_costs(c, model.shape, codec_prompt_len, model.device)
             for c in codecs}
    return Profile(model=model.shape.name, device=str(model.device),
                   dtype=str(model.dtype).removeprefix("torch."),
                   torch_threads=torch.get_num_threads(),
                   layer_cost=measure_layer_cost(model, lengths),
                   quantize_ms_per_mib={c: q for c, (q, _) in costs.items()},
                   restore_ms_per_mib={c: r for c, (_, r) in costs.items()},
                   meta={"codec_prompt_len": codec_prompt_len})


def shipped_profile(model: str) -> Profile | None:
    """The reference profile that ships for `model` (measured on the development CPU), if any.
    Compute costs differ by up to 10x between CPUs: `rekv plan` warns when it falls back to it."""
    from importlib import resources

    resource = resources.files("rekv_core.plan").joinpath("profiles", f"{model}.json")
    if not resource.is_file():
        return None
    with resources.as_file(resource) as path:
        return Profile.load(path)
