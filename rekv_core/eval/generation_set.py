"""The generation-agreement calibration set: prompts of the kinds users send, as plain text.

`generation_prompts(tokenizer, text_ids, prose, prose_len, passkey_len)` returns the set the gate
decodes greedily from (`plan.generations`): every `CODE` prompt (the start of a function, a class, a
query), every `CHAT` prompt (an instruction or a question in the plain "Question: /
Answer:" form the embedded model follows; its chat template mostly fails, see `eval.needle`),
`prose` windows of `prose_len` tokens of the evaluation text (taken from its second half, away
from the gate's perplexity windows at its start), and one passkey prompt of about `passkey_len`
tokens (0: none). Each prompt says its kind, so a verdict can say which kind an action broke.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rekv_core.eval.needle import passkey_prompt

CODE = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON configuration file and return "
    "it as a dict, with defaults for missing keys.\"\"\"\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "-- The ten customers with the largest total order value\nSELECT c.name,",
)

CHAT = (
    "Question: Give me three tips for staying healthy.\nAnswer:",
    "Question: Explain what a hash table is to a beginner programmer.\nAnswer:",
    "Question: Write a short, polite email declining a meeting invitation.\nAnswer:",
    "Question: How do I reverse a list in Python?\nAnswer:",
)


@dataclass(frozen=True)
class GenerationPrompt:
    kind: str  # "code", "chat", "prose" or "passkey"
    ids: tuple[int, ...]


def prose_windows(text_ids: Sequence[int], length: int, count: int) -> list[list[int]]:
    """`count` windows of `length` tokens spread over the second half of `text_ids`."""
    half = list(text_ids[len(text_ids) // 2:])
    if count <= 0:
        return []
    if len(half) < length:
        raise ValueError(f"text: {len(half)} tokens in its second half, need at least {length}")
    step = (len(half) - length) // max(1, count - 1) if count > 1 else 0
    return [half[i * step:i * step + length] for i in range(count)]


def passkey_filler(tokenizer, target_tokens: int) -> int:
    """Filler repeats that make a passkey prompt about `target_tokens` long."""
    base = len(tokenizer.encode(passkey_prompt(12345, 0)))
    per_repeat = (len(tokenizer.encode(passkey_prompt(12345, 10))) - base) / 10
    return max(0, int((target_tokens - base) / max(1.0, per_repeat)))


def generation_prompts(tokenizer, text_ids: Sequence[int], prose: int = 1, prose_len: int = 1024,
                       passkey_len: int = 2048) -> list[GenerationPrompt]:
    prompts = [GenerationPrompt("code", tuple(tokenizer.encode(p))) for p in CODE]
    prompts += [GenerationPrompt("chat", tuple(tokenizer.encode(p))) for p in CHAT]
    prompts += [GenerationPrompt("prose", tuple(w))
                for w in prose_windows(text_ids, prose_len, prose)]
    if passkey_len:
        text = passkey_prompt(48613, passkey_filler(tokenizer, passkey_len), 0.5)
        prompts.append(GenerationPrompt("passkey", tuple(tokenizer.encode(text))))
    return prompts
