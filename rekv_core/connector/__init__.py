"""The handoff's one entry point on each side, as vLLM's KV connector is for its engine.

Contract (who calls what, in which order; every method is thread-safe unless it says otherwise):

Decode side, `DecodeConnector` (offers, receives, learns), per request:
    offer(prompt_len, in_flight, queue, quality) -> DecodeOffer, sent to the prefill side
    begin(request_id, prompt_len, max_new_tokens, time_remaining, transfer_id) -> PendingHandoff
                                                  (event loop; opens the receive: call before
                                                  the prefill side may send)
    receive(pending)                           -> (HandoffResult, sharing)   blocking
    check_reply(plan, reply)                   the reply must name the plan that arrived
    learn(pending, result, sharing, reply)     -> Learned                     after success
    abandon(pending, reason)                   after any failure; then recompute(ids, capacity)
    end(pending)                               always, last (event loop)
  and at any time: observe_probe(sample) (the link estimate's only writer besides learn),
  link_measured, recompute_s(prompt_len), memory(prompt_len, max_new_tokens), close().

Prefill side, `PrefillConnector` (decides, sends), per call:
    check(call)                                BadRequest naming the field, ModelMismatch for
                                                  another model's offer; before admission
    decide(call, queue)                        -> Decision, whose `plan` is the HandoffPlan
    send(call, decision, sender, transfer, hooks) -> SentHandoff            blocking
    ended(transfer_id)                         always, last
  and at any time: probe(sender, probe_id, key, timeout_s) (Busy while another runs),
  memory(prompt_len).

What crosses between the two (`calls`): `HandoffCall` with its `DecodeOffer` and its `Quality`
(the request's quality setting, `rekv_core.plan.quality`, re-exported here) one way, the in-band
`HandoffPlan` on the data plane, `HandoffReply` back. The connectors own the calibration, the load
bookkeeping (`rekv_core.plan.decode_load`, `prefill_load`, `sharing`), the planner and the plan; a
service around them parses, calls its connector and replies, and never does load or calibration
arithmetic of its own. Neither connector imports grpc or protobuf: another serving engine can
embed them.
"""

from rekv_core.connector.calls import (BadRequest, Busy, DecodeOffer, HandoffCall,
                                       HandoffReply, ModelMismatch)
from rekv_core.connector.decode import DecodeConnector, DecodeOptions, Learned, PendingHandoff
from rekv_core.connector.prefill import PrefillConnector, PrefillOptions, SentHandoff
from rekv_core.plan.canary import (CanaryJudge, CanaryResult,  # the decode side's quality canary
                                   canary_steps)
from rekv_core.plan.planner import Decision  # what `PrefillConnector.decide` returns
from rekv_core.plan.quality import DEFAULT_QUALITY, QUALITIES, Quality

__all__ = ["BadRequest", "Busy", "CanaryJudge", "CanaryResult", "DEFAULT_QUALITY", "Decision",
           "DecodeConnector", "DecodeOffer", "DecodeOptions", "HandoffCall", "HandoffReply",
           "Learned", "ModelMismatch", "PendingHandoff", "PrefillConnector", "PrefillOptions",
           "QUALITIES", "Quality", "SentHandoff", "canary_steps"]
