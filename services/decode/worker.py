"""The decode worker: model, tokenizer, data-plane receiver and connector behind `Decode.Generate`.

`admit(call)` applies this worker's limits and tokenizes; `quality(call)` is the call's quality
setting, the deployment's (`settings.quality`) where the call sets none; `decoder(cache)` gives a
request's decode step. Everything about a handoff (the offer, the receive, what is learned from it,
the load it counts, the local recompute that replaces a failed one) is the connector's
(`rekv_core.connector.DecodeConnector`). Thread-safe: the blocking methods run on worker threads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rekv_core.connector import DecodeConnector, DecodeOptions, Quality
from rekv_core.model import KVCache, decode_steps
from rekv_core.transport import create_receiver
from services import wire_convert
from services.calls import GenerateCall
from services.errors import InvalidArgument
from services.metrics import ServiceMetrics
from services.serving import Worker
from services.settings import ServiceSettings

MAX_REQUEST_ID = 128  # characters


class DecodeWorker(Worker):
    def __init__(self, settings: ServiceSettings, metrics: ServiceMetrics):
        super().__init__(settings, metrics)
        self.receiver = create_receiver(settings.transport, self.transport_options())
        self.connector = DecodeConnector.for_model(
            self.model, self.receiver,
            DecodeOptions(settings.codecs, settings.boundary_chunk_tokens,
                          settings.handoff_timeout_s, settings.encrypt_data_plane,
                          settings.link_gbps, self.fingerprint.hex),
            settings.profile, self.transfers)
        metrics.link.set_function(lambda: self.connector.link_gbps)
        metrics.transport_pending.set_function(lambda: self.receiver.pending().total)
        metrics.connections.set_function(self.receiver.connections)

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
        return self._tokenize(call)

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
        self.connector.close()
        self.receiver.shutdown()
