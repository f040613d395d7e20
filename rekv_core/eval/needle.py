"""Passkey-retrieval prompts ("needle in a haystack"), generated in code.

`passkey_prompt(passkey, filler_repeats, depth)` hides `The pass key is N. Remember it.` at a
relative `depth` (0 = start, 1 = end) of repeated filler sentences and ends with the question, in
plain text (the embedded model retrieves it in this form; its chat template mostly fails).
`answer_found(text, passkey)` says whether a continuation states the key.
"""

from __future__ import annotations

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
QUESTION = "What is the pass key? The pass key is"


def passkey_prompt(passkey: int, filler_repeats: int, depth: float = 0.5) -> str:
    if not 0 <= depth <= 1:
        raise ValueError(f"depth: must lie in [0, 1], got {depth}")
    if filler_repeats < 0:
        raise ValueError(f"filler_repeats: must be >= 0, got {filler_repeats}")
    before = round(filler_repeats * depth)
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    return ("There is important information hidden in a lot of irrelevant text. Find it and "
            "memorize it. " + FILLER * before + needle + FILLER * (filler_repeats - before)
            + QUESTION)


def answer_found(text: str, passkey: int) -> bool:
    return str(passkey) in text
