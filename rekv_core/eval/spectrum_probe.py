"""SpectrumKV's deployment-time probe: does this model tolerate INT4 KV for its low-rank tokens?

Three aggressive passkey trials under the 3-tier policy (seed spec section 2): budget b = 0.3
(sinks aside, 80% of the tokens at INT4, 20% at INT8), a prompt of about `context_len` (4096)
tokens, the key at depths 0.25, 0.5 and 0.75. The model passes only if all three retrieve the key
exactly; then it runs SpectrumKV with FP16+INT8+INT4 (`tiers=3`), otherwise with FP16+INT8
(`tiers=2`, which needs a budget of at least 0.5).

`probe_int4_tolerance(run_needle_trial)` holds the policy and the verdict; the model work is the
caller's `run_needle_trial(trial) -> str`, so this module needs no model (and a fake one tests it).
The caller (the `rekv gate` wiring) is expected to: build `passkey_prompt(trial.passkey, filler,
trial.depth)` with the filler sized to `trial.context_len` tokens (as the gate's `_needles` does),
prefill it computing each layer's token importance (`rekv_core.model.importance`), pass every
layer's K and V through `SpectrumCodec(trial.budget, tiers=trial.tiers)` with that importance, and
return the greedy continuation decoded from the reconstructed cache (about 10 tokens) as text.

"Exactly": the first number in the continuation is the key (`retrieved_exactly`); the gate's
`answer_found` accepts the key anywhere in the text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

PROBE_BUDGET = 0.3
PROBE_CONTEXT = 4096
PROBE_DEPTHS = (0.25, 0.5, 0.75)
PROBE_TIERS = 3
_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class NeedleTrial:
    depth: float  # relative position of the key in the filler, 0 (start) to 1 (end)
    passkey: int
    context_len: int  # prompt tokens, about
    budget: float  # SpectrumKV budget for every layer's K and V
    tiers: int  # SpectrumKV tier mode under test


def probe_passkey(depth: float) -> int:
    """A five-digit key per depth, fixed so reruns are comparable (the gate's rule)."""
    return 10000 + int(depth * 80000) + 17


def retrieved_exactly(text: str, passkey: int) -> bool:
    match = _NUMBER.search(text)
    return match is not None and match.group() == str(passkey)


def probe_int4_tolerance(run_needle_trial: Callable[[NeedleTrial], str],
                         context_len: int = PROBE_CONTEXT,
                         depths: Sequence[float] = PROBE_DEPTHS,
                         budget: float = PROBE_BUDGET) -> dict:
    """Run one trial per depth (all of them, for the record) and give the verdict:
    {"int4_tolerated", "tiers" (the mode to deploy), "budget", "context_len", "trials": [{depth,
    passkey, answer, found}]}."""
    if context_len < 1:
        raise ValueError(f"context_len: must be positive, got {context_len}")
    if not depths:
        raise ValueError("depths: need at least one")
    trials = []
    for depth in depths:
        if not 0 <= depth <= 1:
            raise ValueError(f"depths: each must lie in [0, 1], got {depth}")
        trial = NeedleTrial(depth=depth, passkey=probe_passkey(depth), context_len=context_len,
                            budget=budget, tiers=PROBE_TIERS)
        answer = run_needle_trial(trial)
        if not isinstance(answer, str):
            raise TypeError(f"run_needle_trial: must return the decoded text, got "
                            f"{type(answer).__name__}")
        trials.append({**asdict(trial), "answer": answer,
                       "found": retrieved_exactly(answer, trial.passkey)})
    tolerated = all(t["found"] for t in trials)
    return {"int4_tolerated": tolerated, "tiers": 3 if tolerated else 2, "budget": budget,
            "context_len": context_len, "trials": trials}
