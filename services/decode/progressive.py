"""The decode worker's tokens past a Lynx handoff, before its batch takes the stream over.

A progressive handoff (`Action.progressive`) comes back from `Handoffs.run` on its anchors: the
first token is exact (from the boundary's suffix or the head) and already sent; the residuals
still arrive (`Handed.residuals`). `verified_tokens(...)` drafts on the anchor cache in the
worker's turns and verifies once the residuals are in (`rekv_core.handoff.progressive`), and
returns the verified tokens after the first (greedy decoding's on the full `int8` cache) with the
`Handed` to go on from: the cache then holds them. A sampled stream (temperature > 0) drafts
nothing: it waits for the residuals and goes on. The number of drafts is the connector's
(`DecodeConnector.lynx_drafts`): what fits before the residuals' expected arrival at the link
rate this worker has measured.

When the residuals are lost (`ResidualsLost`) nothing drafted is sent: the worker falls back as
for any failed handoff (`Handoffs.fallback`): it recomputes the prompt here (the first token
already sent stands: it came from the prefill's exact hidden state), or with
`on_handoff_failure = fail` the call ends with UNAVAILABLE. A request cancelled meanwhile
abandons the residuals (the receive aborted) and cancels the `Handoff` call. The call's reply,
which follows the last residual, is not waited for: `Handoffs` checks it against the plan and
learns from it when it comes (a disagreeing or missing one is logged: the tokens were verified on
the data plane's bytes); the call's own deadline bounds it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from rekv_core.handoff.progressive import continue_on_anchors
from rekv_core.handoff.residuals import ResidualsLost
from services.calls import GenerateCall
from services.decode.handoff import Handed, Handoffs

log = logging.getLogger("rekv.decode")


async def verified_tokens(handoffs: Handoffs, call: GenerateCall, ids: list[int],
                          handed: Handed, first: int) -> tuple[list[int], Handed]:
    """(the verified tokens after `first`, the `Handed` whose cache holds them)."""
    worker = handoffs.worker
    residuals = handed.residuals
    cut = handed.report.action.cut
    k = worker.connector.lynx_drafts(len(ids), cut) if call.sampling.greedy else 0
    began = time.perf_counter()
    try:
        continued = await asyncio.to_thread(continue_on_anchors, worker.model, handed.cache,
                                            first, residuals, k, worker.connector.turns)
    except ResidualsLost as lost:
        if handed.reply is not None:
            handed.reply.cancel()
        fallback = await handoffs.fallback_after_lost_residuals(
            ids, handed.cache.capacity, began, lost)
        return [], dataclasses.replace(fallback, logits=handed.logits)
    except BaseException:
        let_go(handed, "the request ended")
        raise
    log.info("request=%s lynx drafted=%d accepted=%d emitted=%d residuals_ms=%.1f "
             "verified_ms=%.1f", call.request_id, continued.drafted, continued.accepted,
             len(continued.emitted), residuals.waited_ms, (time.perf_counter() - began) * 1e3)
    report = dataclasses.replace(handed.report, bytes=handed.report.bytes + residuals.bytes)
    return continued.emitted, dataclasses.replace(handed, report=report, residuals=None,
                                                  reply=None)


def let_go(handed: Handed, why: str) -> None:
    """Lynx's residuals, if `handed` still waits for them, abandoned (the receive aborted) and
    its `Handoff` call cancelled; nothing otherwise."""
    if handed.residuals is not None:
        handed.residuals.abandon(why)
    if handed.reply is not None:
        handed.reply.cancel()
