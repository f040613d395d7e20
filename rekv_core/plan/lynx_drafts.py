"""How many tokens to draft on Lynx's anchor cache: what fits before the residual stream lands.

Once the anchors (and any recomputed suffix) are in, the decode side drafts greedily on the
anchor-precision cache until the residuals arrive, then verifies every draft in one pass
(`model.speculation`). A draft costs one decode step; drafting past the residuals' arrival would
delay the verification that the first token after the handoff waits for, so
k = min(`MAX_DRAFTS`, ⌊expected residual wait / anchor step⌋); 0 means the residuals will be in
before one draft could finish, and the worker waits for them instead.
"""

from __future__ import annotations

MAX_DRAFTS = 8  # one verification pass over k + 1 rows stays about one decode step's cost


def draft_count(residual_wait_ms: float, step_ms: float, max_drafts: int = MAX_DRAFTS) -> int:
    if not step_ms > 0:
        raise ValueError(f"step_ms: must be positive, got {step_ms}")
    if max_drafts < 0:
        raise ValueError(f"max_drafts: must be >= 0, got {max_drafts}")
    return max(0, min(max_drafts, int(max(0.0, residual_wait_ms) // step_ms)))
