"""The decode worker: model, tokenizer, data-plane receiver and connector behind `Decode.Generate`.

`admit(call)` applies this worker's limits and tokenizes; `quality(call)` is the call's quality
setting, the deployment's (`settings.quality`) where the call sets none. The worker's decode
engine (`engine`, `rekv_core.engine`) owns the model's decoding: requests join it as streams, and
every compute of a handoff (suffix, token-only, fallback recompute) goes to its layer batcher
(`layers`, `engine.LayerBatcher`: the runs of several requests at one layer share a call), which
takes its turns there, sized to the ITL budget (`itl_budget_ms`, by default `ITL_BUDGET_FACTOR` x
the single-stream step measured at start, before serving). With `decode_path = per_request` there
is no engine: `decoder(cache)` gives a request's own decode step, for the comparison bench.
Everything about a handoff (the offer, the receive, what is learned from it, the load it counts,
the local recompute that replaces a failed one) is the connector's
(`rekv_core.connector.DecodeConnector`). Thread-safe: the blocking methods run on worker threads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from rekv_core.connector import DecodeConnector, DecodeOptions, Quality
from rekv_core.engine import (DecodeEngine, ItlBudget, LayerBatcher, default_budget_ms,
                              engine_step, measure_costs)
from rekv_core.model import KVCache, decode_steps
from rekv_core.model.turns import UNLIMITED
from rekv_core.transport import create_receiver
from services import wire_convert
from services.calls import GenerateCall
from services.errors import InvalidArgument
from services.metrics import ServiceMetrics
from services.serving import Worker
from services.settings import ServiceSettings

log = logging.getLogger("rekv.decode")

MAX_REQUEST_ID = 128  # characters


class DecodeWorker(Worker):
    def __init__(self, settings: ServiceSettings, metrics: ServiceMetrics):
        super().__init__(settings, metrics)
        self.receiver = create_receiver(settings.transport, self.transport_options())
        self.engine = self._engine(settings, metrics)
        # every handoff's layer runs, batched across requests, in the engine's turns
        self.layers = LayerBatcher(self.model, self.engine or UNLIMITED, settings.batch_invariant,
                                   observer=metrics.layers.called)
        metrics.layers.watch(lambda: self.layers.pending)
        self.connector = DecodeConnector.for_model(
            self.model, self.receiver,
            DecodeOptions(settings.codecs, settings.boundary_chunk_tokens,
                          settings.handoff_timeout_s, settings.encrypt_data_plane,
                          settings.link_gbps, self.fingerprint.hex),
            settings.profile, self.transfers, turns=self.layers,
            engine_state=self.engine.state if self.engine else None)
        metrics.link.set_function(lambda: self.connector.link_gbps)
        metrics.transport_pending.set_function(lambda: self.receiver.pending().total)
        metrics.connections.set_function(self.receiver.connections)

    def _engine(self, settings: ServiceSettings, metrics: ServiceMetrics) -> DecodeEngine | None:
        if settings.decode_path != "batched":
            return None
        step = engine_step(self.model, settings.max_batch,
                           settings.max_prompt_tokens + settings.max_new_tokens,
                           settings.batch_invariant)
        step_ms, token_layer_ms, per_key_ms = measure_costs(self.model, step)
        budget_ms = settings.itl_budget_ms or default_budget_ms(step_ms)
        log.info("decode engine: %s", "batch-invariant (each stream its lone kernels)"
                 if settings.batch_invariant else "one GEMM per weight over the batch")
        log.info("decode engine: up to %d streams a step; ITL budget %.1f ms (%s); idle step "
                 "%.1f ms, %.4f ms per token-layer of prefill work (+%.6f per key attended)",
                 settings.max_batch, budget_ms, "set" if settings.itl_budget_ms else "measured",
                 step_ms, token_layer_ms, per_key_ms)
        engine = DecodeEngine(self.model, settings.max_batch,
                              ItlBudget(budget_ms, step_ms, token_layer_ms, per_key_ms),
                              metrics.engine,
                              step)
        metrics.engine.watch(engine.running, engine.waiting, budget_ms / 1e3)
        return engine.start()

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id if self.tokenizer else None

    def admit(self, call: GenerateCall) -> list[int]:
        """The prompt's token ids, once the call is within this worker's limits."""
        if len(call.request_id) > MAX_REQUEST_ID:
            raise InvalidArgument(f"request_id: longer than {MAX_REQUEST_ID} characters")
        if not 1 <= call.max_new_tokens <= self.settings.max_new_tokens:
            raise InvalidArgument(f"max_new_tokens: must lie in [1, "
                                  f"{self.settings.max_new_tokens}], got {call.max_new_tokens}")
        wire_convert.check_forced_quality(call.forced_action, self.quality(call))
        ids = self._tokenize(call)
        wire_convert.check_forced_split(call.forced_action, len(ids))
        return ids

    def quality(self, call: GenerateCall) -> Quality:
        return call.quality or Quality(self.settings.quality)

    def _tokenize(self, call: GenerateCall) -> list[int]:
        which = "text" if call.text is not None else "token_ids"
        if call.text is not None:
            if self.tokenizer is None:
                raise InvalidArgument("text: this model has no tokenizer; send token_ids")
            ids = self.tokenizer.encode(call.text)
        else:
            ids = call.token_ids
        if not ids:
            raise InvalidArgument(f"{which}: the prompt is empty")
        if len(ids) > self.settings.max_prompt_tokens:
            raise InvalidArgument(f"{which}: {len(ids)} prompt tokens exceed the limit of "
                                  f"{self.settings.max_prompt_tokens}")
        vocab = self.shape.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token_ids: id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) + call.max_new_tokens > self.shape.max_positions:
            raise InvalidArgument(f"max_new_tokens: prompt plus new tokens exceed the model's "
                                  f"context of {self.shape.max_positions}")
        return ids

    def decoder(self, cache: KVCache) -> Callable[[int], torch.Tensor]:
        """One request's decode step, token id -> logits (on a GPU a CUDA graph's replays)."""
        return decode_steps(self.model, cache)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()  # first: a turn the batcher waits for is then granted
        self.layers.close()
        self.connector.close()
        self.receiver.shutdown()
