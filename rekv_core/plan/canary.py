"""The live quality canary's check: a lossy cache against the prompt's recomputed reference.

`canary_steps(model, ids, lossy, lossy_logits, continuation)` is a generator: each `next()` runs
one step (one layer over one chunk of the prompt's rows, or one decode step) and it returns a
`CanaryResult`, so that its caller can stop between steps whenever other work arrives. It
recomputes the prompt's cache and last-token logits from the token ids in the model's dtype (the
reference, as a full prefill makes it) and compares top-1 agreement within the model's resolution
(`within_resolution`), as the quality gate does (`gate.py`), at:
- the first token: the lossy handoff's logits (its suffix ran from the BF16 boundary) against the
  reference's;
- the first decoded position and a short greedy continuation: the reference decodes greedily
  `1 + continuation` tokens (as far as the lossy cache has room) and the lossy cache is scored on
  the same tokens, teacher-forced, as the gate scores its continuation;
and KL(reference || lossy) at the first decoded position (the gate's `next_token_kl`).
The lossy cache is extended in place from its prompt's end (`lossy.length` is reset to the
prompt's length): give it only once its request has finished decoding.

`AgreementWindow(size, threshold)` keeps one action's last `size` checks and says when their top-1
agreement drops below the threshold, and when it recovers; `agreement_threshold(policy, action)`
is that threshold: the top-1 agreement the quality gate measured for the action. `CanaryJudge`
keeps a window per action under one policy (the decode worker's `policy` setting, else the one
shipped for the model). `rekv_core.connector` exports what a service needs of this module.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rekv_core.handoff import Action
from rekv_core.model import KVCache, Model, decode_step, extend, run_layers_chunk
from rekv_core.model.blocks import EXEC_BLOCK, chunk_bounds
from rekv_core.model.executor import embed
from rekv_core.model.layer import final_logits
from rekv_core.plan.gate import within_resolution
from rekv_core.plan.policy import Policy, shipped_policy

# the gate's criterion for an eligible action: every first-position top-1 equals BF16's
GATE_TOP1_AGREEMENT = 1.0
GATE_FIGURE = "continuation_top1_agreement"  # a verdict's top-1 agreement over its positions
CONFIDENCE_Z = 1.645  # one-sided 95%


@dataclass(frozen=True)
class CanaryResult:
    first_token_agrees: bool  # the handoff's first-token top-1 is the reference's
    agreeing: int  # positions whose top-1 agrees: the first token, then each decoded position
    positions: int
    kl: float  # KL(reference || lossy) at the first decoded position, nats

    @property
    def agreement(self) -> float:
        return self.agreeing / self.positions

    @property
    def agrees(self) -> bool:
        return self.agreeing == self.positions


def _agreeing(reference: torch.Tensor, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per row: whether `logits`' top token is tied with `reference`'s maximum (`gate.py`)."""
    picked = reference.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
    return within_resolution(picked, reference.max(-1).values, dtype)


def _reference(model: Model, ids: Sequence[int], capacity: int
               ) -> Generator[None, None, tuple[KVCache, torch.Tensor]]:
    shape = model.shape
    cache = KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, capacity, model.dtype,
                    model.device)
    with torch.inference_mode():
        rows = embed(model, ids)
    for start, end in chunk_bounds(len(ids), EXEC_BLOCK):
        h = rows[start:end]
        for layer in range(shape.num_layers):
            h = run_layers_chunk(model, h, layer, start, cache, stop=layer + 1)
            yield
    cache.length = len(ids)
    return cache, final_logits(model, h[-1])


def _greedy(model: Model, logits: torch.Tensor, cache: KVCache, steps: int
            ) -> Generator[None, None, tuple[list[int], torch.Tensor]]:
    """The greedy tokens from `logits` on, each decoded into `cache`, and the logits after each."""
    tokens, rows = [], []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = decode_step(model, tokens[-1], cache)
        rows.append(logits)
        yield
    return tokens, torch.stack(rows)


def canary_steps(model: Model, ids: Sequence[int], lossy: KVCache, lossy_logits: torch.Tensor,
                 continuation: int) -> Generator[None, None, CanaryResult]:
    """The check (module doc); `lossy` holds the prompt's `len(ids)` positions."""
    prompt_len = len(ids)
    if lossy.length < prompt_len or lossy.capacity < prompt_len + 1:
        raise ValueError(f"lossy: holds {lossy.length} of {prompt_len} prompt positions with "
                         f"room to {lossy.capacity}; the check needs the prompt and one more")
    steps = 1 + max(0, min(continuation, lossy.capacity - prompt_len - 1))
    reference, ref_logits = yield from _reference(model, ids, prompt_len + steps)
    tokens, ref_rows = yield from _greedy(model, ref_logits, reference, steps)
    lossy.length = prompt_len
    with torch.inference_mode():
        lossy_rows = extend(model, tokens, lossy)  # teacher-forced on the reference's tokens
    first = bool(_agreeing(ref_logits, lossy_logits, model.dtype))
    agreeing = int(_agreeing(ref_rows, lossy_rows, model.dtype).sum())
    ref_logp = F.log_softmax(ref_rows[0].float(), dim=-1)
    kl = float((ref_logp.exp() * (ref_logp - F.log_softmax(lossy_rows[0].float(), dim=-1))).sum())
    return CanaryResult(first, int(first) + agreeing, 1 + steps, max(0.0, kl))


def agreement_threshold(policy: Policy | None, action: Action) -> float:
    """The top-1 agreement the quality gate measured for `action` over the positions it decodes
    (the first and its continuation), at the smallest evaluated cut of the codec at or above
    `action.cut` (a larger cut never quantizes fewer layers); without one, the gate's criterion
    for an eligible action (every first-position top-1 agrees: 1.0)."""
    if policy is not None:
        measured = sorted((v["cut"], v[GATE_FIGURE]) for v in policy.verdicts
                          if v.get("codec") == action.codec and v.get("cut", 0) >= action.cut
                          and GATE_FIGURE in v)
        if measured:
            return min(GATE_TOP1_AGREEMENT, float(measured[0][1]))
    return GATE_TOP1_AGREEMENT


def upper_bound(agreeing: int, positions: int, z: float = CONFIDENCE_Z) -> float:
    """Wilson score upper bound of an agreement rate seen as `agreeing` of `positions`: exactly
    1 when every position agreed (the formula's float rounding lands just under 1 for some
    counts, which a threshold of 1 would read as a drop)."""
    if agreeing == positions:
        return 1.0
    p, z2 = agreeing / positions, z * z
    centre = p + z2 / (2 * positions)
    spread = z * math.sqrt(p * (1 - p) / positions + z2 / (4 * positions * positions))
    return min(1.0, (centre + spread) / (1 + z2 / positions))


@dataclass(frozen=True)
class WindowChange:
    below: bool  # True: the agreement dropped below the threshold; False: it recovered
    agreement: float  # top-1 agreement over the window's positions
    mean_kl: float


class AgreementWindow:
    """One action's last `size` checks, judged once full: below the threshold when even the
    upper bound of the agreement over their positions (`upper_bound`, one-sided 95%) is, so that a
    healthy action's rare disagreements at a rate the gate measured do not raise it. Not
    thread-safe."""

    def __init__(self, size: int, threshold: float):
        if size < 1:
            raise ValueError(f"size: must be >= 1, got {size}")
        self.threshold = threshold
        self._checks: deque[CanaryResult] = deque(maxlen=size)
        self._below = False

    @property
    def agreement(self) -> float | None:
        """Top-1 agreement over the positions of the checks held (None: none yet)."""
        if not self._checks:
            return None
        return sum(c.agreeing for c in self._checks) / sum(c.positions for c in self._checks)

    def add(self, check: CanaryResult) -> WindowChange | None:
        """Record a check; a change when the full window crossed the threshold, else None."""
        self._checks.append(check)
        if len(self._checks) < (self._checks.maxlen or 0):
            return None
        agreeing = sum(c.agreeing for c in self._checks)
        positions = sum(c.positions for c in self._checks)
        below = upper_bound(agreeing, positions) < self.threshold
        if below == self._below:
            return None
        self._below = below
        mean_kl = sum(c.kl for c in self._checks) / len(self._checks)
        return WindowChange(below, agreeing / positions, mean_kl)


class CanaryJudge:
    """Every action's `AgreementWindow` of `window` checks under `policy`'s thresholds. Not
    thread-safe."""

    def __init__(self, policy: Policy | None, window: int):
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window}")
        self.policy, self.window = policy, window
        self._windows: dict[tuple[str, int], AgreementWindow] = {}

    @classmethod
    def for_model(cls, model_name: str, policy_path: str, window: int) -> CanaryJudge:
        """Judged by the policy file at `policy_path` (`rekv gate`), else the one shipped for
        `model_name` (none: the gate's criterion)."""
        policy = Policy.load(policy_path) if policy_path else shipped_policy(model_name)
        if policy is not None and policy.model != model_name:
            raise ValueError(f"policy: written for {policy.model}, serving {model_name}")
        return cls(policy, window)

    def add(self, action: Action, check: CanaryResult
            ) -> tuple[AgreementWindow, WindowChange | None]:
        """`action`'s window with `check` added, and the change that made, if any."""
        key = (action.codec, action.cut)
        if key not in self._windows:
            self._windows[key] = AgreementWindow(self.window,
                                                 agreement_threshold(self.policy, action))
        window = self._windows[key]
        return window, window.add(check)
