"""A request's quality setting: which actions the planner may choose for it.

- `Quality.LOSSLESS`: only actions whose cache reproduces the reference bit for bit
  (`Action.lossless`: BF16 at any cut, SplitZip, token-only; an interior cut's boundary is lossless
  in either coding), so a greedy answer equals the single-process reference's token for token;
- `Quality.GATED`: also the lossy actions the quality gate's policy passed (`Policy.eligible`):
  cheaper on slow links, and a greedy answer may leave the reference's late in a long
  continuation (the gate's generation floor: never before token 16, on at most a quarter of 48-token
  continuations; docs/design.md gives the shipped policy's figures).
`offered_codecs(quality, codecs)`: the prefix codecs a decode worker offers under `quality`.
`DEFAULT_QUALITY` is a deployment's default where it sets none (`REKV_QUALITY`, `--quality`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from rekv_core.codecs import get_codec
from rekv_core.handoff import Action


class Quality(str, enum.Enum):
    LOSSLESS = "lossless"
    GATED = "gated"

    def allows(self, action: Action) -> bool:
        return self is Quality.GATED or action.lossless


DEFAULT_QUALITY = Quality.GATED
QUALITIES = tuple(q.value for q in Quality)


def offered_codecs(quality: Quality, codecs: Iterable[str]) -> tuple[str, ...]:
    """`codecs`, less the lossy ones under `lossless` (the planner would not pick them either)."""
    return tuple(c for c in codecs if quality is Quality.GATED or get_codec(c).lossless)
