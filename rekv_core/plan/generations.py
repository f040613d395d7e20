"""Generation agreement: whether an action changes the answer a user reads.

Teacher-forced scores (perplexity, top-1 agreement) average over positions and never see a
continuation change: a greedy answer that leaves the reference at one near-tied token is a
different answer from there on. So the gate also decodes. For each prompt of the calibration set
(`eval.generation_set`: code, chat-style instructions, prose, a passkey), the BF16 prefill gives
the reference cache and its greedy continuation of `tokens` tokens (`references`). An action's
cache (`gate.reconstructed_cache`: layers 0..c−1 through the codec's round trip; the suffix is
unchanged, its recompute from h_c being bit-identical to the prefill's) decodes greedily from the
same first-token logits, step by step as the decode worker does, until its first token that
differs from the reference's (`score`). Per prompt that position is the first divergence (`tokens`
when the whole continuation matches; never 0: the first token comes from the BF16 suffix). Per
action, `GenerationScore` holds the earliest divergence and the share of prompts whose whole
`tokens`-token continuation matches exactly.

The floor (`GenerationFloor`), which an action must meet on every prompt set it is gated on:
- no prompt diverges before token `min_agreed_tokens` = 16. The start of an answer is what a user
  reads first (a function's signature and first lines, the first sentence of a reply, the passkey
  itself); the actions the issue found unacceptable left the reference at tokens 3 and 12. 16
  fails every divergence within a dozen tokens, with a margin for prompts the set does not hold;
- at least `min_exact_share` = 3/4 of the continuations match over all `tokens` (48). A lossy
  cache perturbs every logit a little, and a small model's greedy path meets near-ties (logits
  within one BF16 step) every few dozen tokens, so demanding that every continuation match would
  admit no lossy action at all; a quarter may drift after token 16, and `gated` documents that
  its answers may differ late in a long continuation. Lossless actions (BF16, SplitZip, token-only)
  match every continuation exactly and need no gate.

`score(..., floor)` stops decoding once the action fails the floor whatever the remaining prompts
do (the search needs only pass or fail; the record says where it stopped).

`largest_passing_cut(passes, high)`: the gate's search for a codec's max cut by bisection, which
assumes more quantized layers never pass where fewer fail (more error never helps), and then
checks that on cuts below the one it found (`verify`); a cut there that fails lowers the max cut
below it, and the search says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rekv_core.codecs import Codec
from rekv_core.eval.generation_set import GenerationPrompt
from rekv_core.model import KVCache, Model, decode_greedy, decode_steps, prefill
from rekv_core.model.executor import PrefillOutput

GENERATION_TOKENS = 48  # tokens of each greedy continuation


@dataclass(frozen=True)
class GenerationFloor:
    min_agreed_tokens: int = 16
    min_exact_share: float = 0.75

    def reasons(self, score: GenerationScore) -> list[str]:
        """Why `score` fails the floor (empty: it passes)."""
        reasons = []
        early = [(k, d) for k, d in zip(score.kinds, score.divergences)
                 if d < min(self.min_agreed_tokens, score.tokens)]  # a whole match is never early
        if early:
            where = ", ".join(f"{kind} at token {d}" for kind, d in early)
            reasons.append(f"greedy output leaves BF16's before token {self.min_agreed_tokens} "
                           f"on {len(early)} of {len(score.divergences)} prompts ({where})")
        if score.exact_share < self.min_exact_share:
            reasons.append(f"{score.exact_share:.0%} of {score.tokens}-token continuations match "
                           f"BF16's exactly < {self.min_exact_share:.0%}")
        return reasons

    def decided(self, score: GenerationScore, prompts: int) -> bool:
        """Whether `score`, over the first of `prompts` prompts, fails whatever the rest do."""
        misses = sum(d < score.tokens for d in score.divergences)
        best_share = (prompts - misses) / prompts  # should every other prompt match
        return (score.earliest < min(self.min_agreed_tokens, score.tokens)
                or best_share < self.min_exact_share)

    def to_json(self) -> dict:
        return {"min_agreed_tokens": self.min_agreed_tokens,
                "min_exact_share": self.min_exact_share}


@dataclass(frozen=True)
class Reference:
    prompt: GenerationPrompt
    state: PrefillOutput  # the BF16 prefill: every layer's K and V, the first token's logits
    tokens: tuple[int, ...]  # BF16's greedy continuation


@dataclass(frozen=True)
class GenerationScore:
    kinds: tuple[str, ...]  # each prompt's kind
    divergences: tuple[int, ...]  # each prompt's first divergence (`tokens`: none)
    tokens: int
    stopped_early: bool = False  # the rest of the prompts were not decoded: it fails anyway

    @property
    def earliest(self) -> int:
        return min(self.divergences, default=self.tokens)

    @property
    def exact_share(self) -> float:
        matched = sum(d >= self.tokens for d in self.divergences)
        return matched / len(self.divergences) if self.divergences else 1.0

    def to_json(self) -> dict:
        return {"generation_tokens": self.tokens, "generation_exact_share": self.exact_share,
                "generation_earliest_divergence": self.earliest,
                **({"generation_stopped_early": True} if self.stopped_early else {}),
                "generation_divergences": [{"kind": k, "first_divergence": d}
                                           for k, d in zip(self.kinds, self.divergences)]}


def references(model: Model, prompts: Sequence[GenerationPrompt], tokens: int,
               importance_window: int = 0) -> list[Reference]:
    """Each prompt's BF16 prefill and greedy continuation (`importance_window`: the token scores
    the actions' codecs rank by)."""
    out = []
    for prompt in prompts:
        state = prefill(model, list(prompt.ids), boundaries=(),
                        importance_window=importance_window)
        cache = KVCache.from_layers(state.keys, state.values, len(prompt.ids) + tokens)
        out.append(Reference(prompt, state, tuple(decode_greedy(model, state.logits, cache,
                                                                tokens))))
    return out


def first_divergence(model: Model, reference: Reference, cache: KVCache) -> int:
    """Greedy decoding from `cache` until its token differs from the reference's: that index, or
    the reference's length when none does."""
    step = decode_steps(model, cache)
    logits = reference.state.logits
    for index, expected in enumerate(reference.tokens):
        if int(logits.argmax()) != expected:
            return index
        if index + 1 < len(reference.tokens):
            logits = step(expected)
    return len(reference.tokens)


def score(model: Model, refs: Sequence[Reference], codec: Codec, cut: int,
          rebuild: Callable[..., KVCache], floor: GenerationFloor | None = None
          ) -> GenerationScore:
    """The action (`codec`, `cut`)'s generation agreement over `refs`; `rebuild(keys, values,
    codec, cut, capacity, importance)` reconstructs its cache (`gate.reconstructed_cache`).
    With `floor`, it stops once the action fails it whatever the remaining prompts do (a
    search's pass or fail is all it needs; `stopped_early` says so)."""
    tokens = len(refs[0].tokens) if refs else 0
    kinds, divergences = [], []
    for ref in refs:
        capacity = len(ref.prompt.ids) + len(ref.tokens)
        cache = rebuild(ref.state.keys, ref.state.values, codec, cut, capacity,
                        ref.state.importance)
        divergences.append(first_divergence(model, ref, cache))
        kinds.append(ref.prompt.kind)
        partial = GenerationScore(tuple(kinds), tuple(divergences), tokens)
        if floor is not None and len(kinds) < len(refs) and floor.decided(partial, len(refs)):
            return dataclasses.replace(partial, stopped_early=True)
    return GenerationScore(tuple(kinds), tuple(divergences), tokens)


@dataclass
class CutSearch:
    max_cut: int
    evaluated: dict[int, bool] = field(default_factory=dict)  # cut -> passed
    monotone: bool = True  # no cut below a passing one failed


def largest_passing_cut(passes: Callable[[int], bool], high: int, verify: int = 2) -> CutSearch:
    """The largest cut in [0, `high`] that `passes` (cut 0 quantizes nothing and always passes):
    `high` first, then bisection; then `verify` cuts spread below the one found, not yet
    evaluated. Where one of those fails, the max cut drops below it and `monotone` is False."""
    search = CutSearch(0)

    def check(cut: int) -> bool:
        search.evaluated[cut] = passes(cut)
        return search.evaluated[cut]

    if high <= 0:
        return search
    low = 0  # passes
    if check(high):
        low = high
    else:
        top = high  # fails
        while top - low > 1:
            middle = (low + top) // 2
            if check(middle):
                low = middle
            else:
                top = middle
    search.max_cut = low
    probes = sorted({round(low * i / (verify + 1)) for i in range(1, verify + 1)} - {0}
                    - set(search.evaluated))
    for cut in probes:
        if not check(cut):
            search.monotone = False
    failed_below = [c for c, ok in search.evaluated.items() if not ok and c <= low]
    if failed_below:
        search.max_cut = min(failed_below) - 1
    return search
