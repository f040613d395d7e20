"""Which prompt rows the prefill scheduler runs in one tick: the policy, with no model in it.

A prompt in progress (`Progress`) is at one layer and one row: it has computed layers [0, layer)
for all its rows and rows [0, row) of `layer`. A tick runs at most `budget` rows (more only to
let one block through when the budget is smaller than a block), each prompt at most once, in
`Pick`s of rows [r0, r1) of the prompt's current layer. A pick ends at the layer's last row or at
a multiple of `EXEC_BLOCK`, so that every later pick starts block-aligned and the rows computed in
pieces are the ones computed whole, bit for bit (`model.blocks`).

The policy (`plan_tick`):

0. late arrivals catch up (`catch_up` layers, 0: off): prompts arrive milliseconds apart, each a
   layer behind the last, and prompts at different layers never share a GEMM. So when every
   prompt in progress is within `catch_up` layers of the lowest and the prompts at the lowest
   layer have at most one block of rows left in it (catching up is cheap), only those run and the
   others wait a tick, until they meet and run as one. A prompt waits at most `catch_up` ticks in
   all (`Progress.held`), so however many prompts arrive after it, catching up delays it by at most
   `catch_up` ticks of at most one block each; a long prompt never holds anyone;
1. the oldest prompt (first submitted) gets at least one block of rows (or what is left of its
   layer): however many short prompts keep arriving, every prompt advances each tick it is the
   oldest, so none starves;
2. the rest of the budget goes to the prompts with the least work left first (rows × layers still
   to run; ties: the older first): a short prompt does not wait behind a long one, it shares the
   tick with it and finishes first (shortest remaining work first, as a scheduler minimising mean
   latency does);
3. a prompt gets its whole layer's remaining rows when they fit, else the largest block-aligned
   piece that fits, else nothing this tick.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rekv_core.model.blocks import EXEC_BLOCK


@dataclass
class Progress:
    seq: int  # submission order: lower is older
    rows: int  # the prompt's length
    through: int  # layers [0, through) to compute
    layer: int = 0
    row: int = 0
    held: int = 0  # ticks this prompt waited for later arrivals to catch up (rule 0)

    @property
    def done(self) -> bool:
        return self.layer >= self.through

    @property
    def work_left(self) -> int:
        return (self.through - self.layer) * self.rows - self.row

    def advance(self, rows: int) -> bool:
        """Count `rows` more rows of the current layer as computed; True when that completed it."""
        self.row += rows
        if self.row < self.rows:
            return False
        self.layer, self.row = self.layer + 1, 0
        return True


@dataclass(frozen=True)
class Pick:
    progress: Progress
    layer: int
    r0: int
    r1: int


def _piece(p: Progress, room: int) -> int:
    """How many rows of `p`'s current layer fit in `room`: all that is left, else a whole number
    of blocks (0 when not even one fits)."""
    left = p.rows - p.row
    return left if left <= room else room // EXEC_BLOCK * EXEC_BLOCK


def _catching_up(active: list[Progress], catch_up: int) -> list[Progress]:
    """Rule 0: the prompts at the lowest layer alone, when the others may wait for them; else
    all. Counts a tick of waiting on each prompt held."""
    lowest = min(p.layer for p in active)
    laggards = [p for p in active if p.layer == lowest]
    ahead = [p for p in active if p.layer != lowest]
    if (not ahead or any(p.layer - lowest > catch_up or p.held >= catch_up for p in ahead)
            or sum(p.rows - p.row for p in laggards) > EXEC_BLOCK):
        return active
    for p in ahead:
        p.held += 1
    return laggards


def plan_tick(prompts: Sequence[Progress], budget: int, catch_up: int = 0) -> list[Pick]:
    """The picks of one tick (see the module's docstring); empty only when no prompt is left."""
    if budget < 1:
        raise ValueError(f"budget: must be at least one row, got {budget}")
    if catch_up < 0:
        raise ValueError(f"catch_up: must be >= 0 layers, got {catch_up}")
    active = [p for p in prompts if not p.done]
    if not active:
        return []
    active = _catching_up(active, catch_up)
    oldest = min(active, key=lambda p: p.seq)
    reserved = min(oldest.rows - oldest.row, EXEC_BLOCK)  # rule 1: set aside for the oldest
    room = budget - reserved
    picks: dict[int, Pick] = {}
    for p in sorted(active, key=lambda p: (p.work_left, p.seq)):
        if p is oldest:
            n = max(reserved, _piece(p, room + reserved))
            room -= n - reserved
        else:
            n = _piece(p, room) if room > 0 else 0
            room -= n
        if n:
            picks[p.seq] = Pick(p, p.layer, p.row, p.row + n)
    return list(picks.values())
