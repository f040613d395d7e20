"""What a policy file records beside its verdicts: how the gate ran and what it found for the model.

`PolicyMeta` is the typed form of a policy's `meta` object. Two findings change how codecs deploy
(`policy.deployed_codec`): `splitzip` (`SplitZipCalibration`, the model's exponent codebooks for KV
and for boundary states, `gate.calibrate_splitzip`) and `spectrum_probe` (`SpectrumProbe`: whether
the model tolerates SpectrumKV's INT4 tier, and so how many tiers it runs). The rest records the
gate's run (prompt length, prompts, continuation, passkey depths, what BF16 found, dtype, text,
command, the commit it ran from, and the generation-agreement run, `generation`), which
`Policy.merged` compares in part. `from_json` reads the file's object (keys it does not know are
kept in `extra` and written back); `to_json` writes it, leaving out what is unset.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace


@dataclass(frozen=True)
class SplitZipCalibration:
    kv: tuple[int, ...] | None = None  # the codebook for K and V
    boundary: tuple[int, ...] | None = None  # the codebook for boundary states h_c
    prompts: int | None = None  # how many prompts it was ranked on
    prompt_len: int | None = None

    @classmethod
    def from_json(cls, data: dict) -> SplitZipCalibration:
        def codebook(value):
            return tuple(int(e) for e in value) if value else None

        return cls(codebook(data.get("kv")), codebook(data.get("boundary")),
                   data.get("prompts"), data.get("prompt_len"))

    def to_json(self) -> dict:
        return _set({"kv": list(self.kv) if self.kv else None,
                     "boundary": list(self.boundary) if self.boundary else None,
                     "prompts": self.prompts, "prompt_len": self.prompt_len})


@dataclass(frozen=True)
class SpectrumProbe:
    int4_tolerated: bool
    tiers: int  # 3 (FP16, INT8, INT4) when INT4 is tolerated, else 2 (FP16, INT8)
    budget: float | None = None
    context_len: int | None = None
    trials: tuple[dict, ...] = ()  # each passkey trial as the probe recorded it

    @classmethod
    def from_json(cls, data: dict) -> SpectrumProbe:
        return cls(bool(data["int4_tolerated"]), int(data["tiers"]), data.get("budget"),
                   data.get("context_len"), tuple(data.get("trials", ())))

    def to_json(self) -> dict:
        return _set({"int4_tolerated": self.int4_tolerated, "tiers": self.tiers,
                     "budget": self.budget, "context_len": self.context_len,
                     "trials": list(self.trials) if self.trials else None})


@dataclass(frozen=True)
class PolicyMeta:
    prompt_len: int | None = None
    prompts: int | None = None
    continuation: int | None = None
    needle_depths: tuple[float, ...] | None = None
    bf16_needles: tuple[dict, ...] | None = None  # what BF16 found at each depth
    dtype: str | None = None
    text: str | None = None
    command: str | None = None
    commit: str | None = None  # the code the gate ran (`rekv_cli.bench.provenance`)
    tree_clean: bool | None = None
    started: str | None = None
    splitzip: SplitZipCalibration | None = None
    spectrum_probe: SpectrumProbe | None = None
    # the generation-agreement gate's run: its floor, prompts, and per codec the cuts it evaluated
    # (`gate.regate_generations`, `generations.GenerationFloor`)
    generation: dict | None = None
    extra: dict = field(default_factory=dict, compare=False)  # keys of newer or older writers

    @classmethod
    def from_json(cls, data: dict | PolicyMeta | None) -> PolicyMeta:
        if isinstance(data, PolicyMeta):
            return data
        data = dict(data or {})
        splitzip, probe = data.pop("splitzip", None), data.pop("spectrum_probe", None)
        known = {f.name for f in fields(cls)} - {"splitzip", "spectrum_probe", "extra"}
        values = {name: data.pop(name) for name in list(data) if name in known}
        for name in ("needle_depths", "bf16_needles"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values, splitzip=SplitZipCalibration.from_json(splitzip) if splitzip else None,
                   spectrum_probe=SpectrumProbe.from_json(probe) if probe else None, extra=data)

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("splitzip", "spectrum_probe", "extra")}
        for name in ("needle_depths", "bf16_needles"):
            if out[name] is not None:
                out[name] = list(out[name])
        out["splitzip"] = self.splitzip.to_json() if self.splitzip else None
        out["spectrum_probe"] = self.spectrum_probe.to_json() if self.spectrum_probe else None
        return {**self.extra, **_set(out)}

    def merged(self, newer: PolicyMeta) -> PolicyMeta:
        """This meta with every field `newer` sets taken from `newer`."""
        taken = {f.name: getattr(newer, f.name) for f in fields(newer)
                 if f.name != "extra" and getattr(newer, f.name) is not None}
        return replace(self, **taken, extra={**self.extra, **newer.extra})

    @property
    def spectrum_tiers(self) -> int:
        """2 (FP16 + INT8) when the probe found INT4 not tolerated, else 3 (also when no probe
        ran: the gate's verdicts on the 3-tier codec stand on their own)."""
        return self.spectrum_probe.tiers if self.spectrum_probe else 3


def _set(values: dict) -> dict:
    return {name: value for name, value in values.items() if value is not None}
