"""The policy file: which actions passed the quality gate for a model and a prompt-length range.

JSON written by `rekv gate`, read by the planner and the services:

    {"model": "smollm2-135m", "prompt_len_range": [lo, hi], "epsilon": 0.01,
     "eligible": [{"codec": "int8", "max_cut": 30}, {"codec": "bf16", "max_cut": 30}],
     "verdicts": [{"codec": ..., "cut": ..., "eligible": ..., "reasons": [...], figures...}],
     "meta": {...}}                      # `policy_meta.PolicyMeta`

A codec's eligible cuts are 1..max_cut (layers 0..c−1 travel in that codec; fewer quantized layers
never add error, so a passing cut vouches for every smaller one); `max_cut: 0` means the codec is
not eligible. A lossy token split (KVPR's, `Action.split`) codes layers 0..c−1 whole and layers
c..L−1's rows [l, S): a subset of what the codec's transfer-only action (c = L) codes, so it is
eligible where that is (`max_cut` = L), and its recomputed rows are exact. Lynx's streams
(`Action.progressive`) carry the `int8` action's bytes and emit only tokens verified on its cache:
they are that action, with its verdict. KVPR's per-layer form (`Action.layer_split`) codes a
subset of the rows its (b, c) codes and recomputes the others exactly: the same verdict. Lossless
actions
(`Action.lossless`: token-only, BF16, and a split in a lossless codec) are always eligible. The
embedded model's policy ships in `rekv_core/plan/policies/`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from rekv_core.codecs import Codec, get_codec
from rekv_core.codecs.spectrum import SpectrumCodec
from rekv_core.codecs.splitzip import SplitZipCodec
from rekv_core.handoff import Action
from rekv_core.plan.policy_meta import PolicyMeta


@dataclass
class Policy:
    model: str
    prompt_len_range: tuple[int, int]
    max_cut: dict[str, int]  # codec -> largest eligible cut
    epsilon: float = 0.01
    verdicts: list[dict] = field(default_factory=list)
    meta: PolicyMeta = field(default_factory=PolicyMeta)

    def __post_init__(self) -> None:
        self.meta = PolicyMeta.from_json(self.meta)  # a dict, as the file has it, is read

    def eligible(self, action: Action) -> bool:
        # a token split codes rows of every layer: the codec's cut at L vouches for it
        cut = action.sent_layers
        return action.lossless or (cut <= self.max_cut.get(action.codec, 0)
                                   and deployed_codec(action.codec, self.meta) is not None)

    def splitzip_codebook(self, kind: str) -> list[int] | None:
        """The model's SplitZip exponent codebook for `kind` ("kv" or "boundary"), calibrated by
        `rekv gate` (`gate.calibrate_splitzip`); None when the policy has none."""
        codebooks = self.meta.splitzip
        codebook = getattr(codebooks, kind) if codebooks else None
        return list(codebook) if codebook else None

    def codec(self, name: str) -> Codec:
        """The codec `name` as this model deploys it (`deployed_codec`); ValueError naming it when
        the gate's findings rule it out."""
        codec = deployed_codec(name, self.meta)
        if codec is None:
            raise ValueError(f"codec: {name} is ruled out for {self.model} by the SpectrumKV "
                             f"probe (INT4 not tolerated; FP16 + INT8 needs a budget >= 0.5)")
        return codec

    def spectrum_tiers(self) -> int:
        return self.meta.spectrum_tiers

    def covers(self, prompt_len: int) -> bool:
        low, high = self.prompt_len_range
        return low <= prompt_len <= high

    def to_json(self) -> dict:
        return {"model": self.model, "prompt_len_range": list(self.prompt_len_range),
                "epsilon": self.epsilon,
                "eligible": [{"codec": c, "max_cut": m} for c, m in self.max_cut.items()],
                "verdicts": self.verdicts, "meta": self.meta.to_json()}

    def merged(self, newer: Policy) -> Policy:
        """This policy with `newer`'s verdicts added: a codec `newer` evaluated takes its verdicts
        and cut from `newer`, and `newer`'s meta wins field by field. Both must come from the same
        model, prompt lengths and evaluation (BF16 perplexity and passkeys), else `ValueError`;
        so is a new SpectrumKV tier mode that would leave an older SpectrumKV verdict standing for
        a codec form it did not score."""
        mine, theirs = self.verdicts[:1], newer.verdicts[:1]
        same = (self.model == newer.model and self.prompt_len_range == newer.prompt_len_range
                and self.epsilon == newer.epsilon
                and [v.get("bf16_perplexity") for v in mine]
                == [v.get("bf16_perplexity") for v in theirs]
                and self.meta.bf16_needles == newer.meta.bf16_needles)
        if not same:
            raise ValueError("policy: the two come from different models or evaluations")
        codecs = set(newer.max_cut)
        if self.meta.spectrum_tiers != newer.meta.spectrum_tiers:
            stale = sorted(c for c in self.max_cut if c not in codecs
                           and isinstance(get_codec(c), SpectrumCodec))
            if stale:
                raise ValueError(
                    f"policy: the SpectrumKV probe now gives {newer.meta.spectrum_tiers} tiers, "
                    f"not {self.meta.spectrum_tiers}; gate {', '.join(stale)} again in this run")
        return Policy(self.model, self.prompt_len_range,
                      {**{c: m for c, m in self.max_cut.items() if c not in codecs},
                       **newer.max_cut}, self.epsilon,
                      [v for v in self.verdicts if v["codec"] not in codecs] + newer.verdicts,
                      self.meta.merged(newer.meta))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, data: dict) -> Policy:
        try:
            return cls(model=data["model"], prompt_len_range=tuple(data["prompt_len_range"]),
                       max_cut={e["codec"]: int(e["max_cut"]) for e in data["eligible"]},
                       epsilon=float(data.get("epsilon", 0.01)),
                       verdicts=list(data.get("verdicts", [])),
                       meta=PolicyMeta.from_json(data.get("meta", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"policy: malformed ({exc!r})") from None

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        return cls.from_json(json.loads(Path(path).read_text()))


def deployed_codec(name: str, meta: PolicyMeta | dict) -> Codec | None:
    """The codec `name` built with what the gate found for this model (a policy's `meta`): SplitZip
    with the model's KV codebook; SpectrumKV in the probe's tier mode, None when that mode has no
    form at the codec's budget (2 tiers need b >= 0.5). The registry's codec otherwise."""
    meta = PolicyMeta.from_json(meta)
    codec = get_codec(name)
    if name == "splitzip" and meta.splitzip and meta.splitzip.kv:
        return SplitZipCodec(list(meta.splitzip.kv))
    if isinstance(codec, SpectrumCodec) and meta.spectrum_tiers != codec.tiers:
        try:
            return SpectrumCodec(codec.budget, tiers=meta.spectrum_tiers, sinks=codec.sinks,
                                 backend=codec.backend)
        except ValueError:  # the budget is below what the mode's cheapest tier costs
            return None
    return codec


def shipped_policy(model: str) -> Policy | None:
    """The policy that ships with the package for `model`, if any."""
    resource = resources.files("rekv_core.plan").joinpath("policies", f"{model}.json")
    if not resource.is_file():
        return None
    return Policy.from_json(json.loads(resource.read_text()))
