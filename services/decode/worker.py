"""The decode worker: model, tokenizer, data-plane receiver, calibration behind `Decode.Generate`.

`admit(call)` applies this worker's limits and tokenizes; `offer(prompt_len, in_flight, queue)` is
what the worker tells the prefill side: γ for the requests generating here plus one, and the
compute committed here by planned handoffs (`backlog`); `receive(transfer, ...)` rebuilds one
handoff's cache from the data plane (the transfer must be opened on `receiver` first) and says
how many requests computed here meanwhile (`sharing`); `recompute(ids, capacity)` is the
fallback that builds the cache here from the token ids; `decoder(cache)` gives a request's decode
step.
Thread-safe: the blocking methods run on worker threads.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import torch

from rekv_core.handoff import HandoffResult, receive_handoff
from rekv_core.handoff.transfer import Transfer, TransferBook, TransferState
from rekv_core.model import KVCache, decode_steps, prefill
from rekv_core.model.tokenizer import load_tokenizer
from rekv_core.plan.calibration import DecodeCalibration
from rekv_core.transport import create_receiver
from rekv_core.transport.base import PREFETCH
from services.calls import MAX_PLANNED_TRANSFERS, DecodeOffer, GenerateCall
from services.decode.sharing import SharingMeter
from services.errors import InvalidArgument
from services.metrics import ServiceMetrics
from services.serving import Worker
from services.settings import ServiceSettings

MAX_REQUEST_ID = 128  # characters
# an offer names the handoffs that ended here this recently too: the prefill side, which counts
# its own decisions' decode work until an offer names them, then knows they are done
NAMES_ENDED_FOR_S = 5.0


class DecodeWorker(Worker):
    def __init__(self, settings: ServiceSettings, metrics: ServiceMetrics):
        super().__init__(settings, metrics)
        self.tokenizer = load_tokenizer(settings.model)
        self.calibration = DecodeCalibration.for_model(self.model, settings.codecs,
                                                       settings.profile)
        self.receiver = create_receiver(settings.transport, self.transport_options())
        self.generating = 0  # requests in their decode loop
        # the local recomputes running now (failed handoffs): their start (monotonic), prompt length
        self.recomputing: dict[int, tuple[float, int]] = {}
        self._recompute_ids = itertools.count()
        self._recompute_lock = threading.Lock()
        self.sharing = SharingMeter(self.computing)
        metrics.link.set_function(lambda: self.calibration.link_gbps)
        metrics.transport_pending.set_function(lambda: sum(self.receiver.pending().values()))
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
        return self._tokenize(call)

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

    def computing(self) -> int:
        """Requests whose compute runs here now: generating, a handoff's suffix or token-only
        recompute, or a failed handoff's local recompute. A handoff still waiting for its data
        computes nothing yet."""
        return self.generating + len(self.recomputing) + handoffs_computing(self.transfers)

    def sharers(self) -> int:
        """How many would share this worker's compute with one more request's suffix: it, and
        the requests generating here (a handoff's compute is counted in `backlog_ms` instead)."""
        return 1 + self.generating

    def backlog(self) -> tuple[float, tuple[str, ...]]:
        """The compute committed here by handoffs whose plan has arrived and by local recomputes
        (ms: each one's layers at the γ offered now, less what it has run: the time it computed,
        not counting a chunked suffix's waits for its chunks, shared with the others computing
        now), and the transfer ids of
        the handoffs whose plan this worker has seen: those, and the ones that ended in the last
        `NAMES_ENDED_FOR_S` (nothing left to count), the latest kept when they are more than an
        offer carries (a local recompute has no id: no prefill worker counts it)."""
        now, sharers = time.monotonic(), self.sharers()
        with self._recompute_lock:
            recomputes = list(self.recomputing.values())
        sharing = max(1, handoffs_computing(self.transfers) + len(recomputes))
        total, planned = 0.0, []
        for began, prompt_len in recomputes:
            total += max(0.0, self.recompute_s(prompt_len) * 1e3 - (now - began) * 1e3 / sharing)
        for transfer in self.transfers.live():
            if transfer.compute_layers == 0 or transfer.ended:
                continue
            work = transfer.compute_layers * self.calibration.suffix_ms_per_layer(
                transfer.prompt_len, sharers)
            computed = transfer.computed_s(now)
            done = 0.0 if computed is None else computed * 1e3 / sharing
            total += max(0.0, work - done)
            planned.append(transfer.transfer_id)
        ended = self.transfers.left_since(now - NAMES_ENDED_FOR_S)
        room = max(0, MAX_PLANNED_TRANSFERS - len(planned))
        return total, tuple(planned[:MAX_PLANNED_TRANSFERS]) + tuple(ended[-room:] if room else ())

    def offer(self, prompt_len: int, in_flight: int, queue: int) -> DecodeOffer:
        backlog_ms, planned = self.backlog()
        return DecodeOffer(model=self.shape.name, num_layers=self.shape.num_layers,
                           address=self.receiver.address, codecs=tuple(self.settings.codecs),
                           queue_depth=queue, handoffs_in_flight=in_flight,
                           costs=self.calibration.offer(prompt_len, self.sharers()),
                           accepts_streamed=True, accepts_pipelined=True,
                           chunk_tokens=self.settings.boundary_chunk_tokens,
                           computing=self.computing(), backlog_ms=backlog_ms,
                           planned=planned)

    def receive(self, transfer: Transfer, prompt_len: int, max_new_tokens: int, key: bytes
                ) -> tuple[HandoffResult, float]:
        """The handoff's result, and how many requests computed here on average (this one
        included) while its suffix ran (1.0 for transfer-only, which computes nothing here)."""
        called = time.perf_counter()
        result = receive_handoff(self.model, self.receiver, transfer.transfer_id, "overlap",
                                 self.settings.handoff_timeout_s, max_new_tokens, prompt_len, key,
                                 transfer, self.settings.encrypt_data_plane)
        t = result.timings
        if t.suffix_end_s <= 0.0:
            return result, 1.0
        return result, self.sharing.average(called + t.h_s, called + t.suffix_end_s)

    def recompute_s(self, prompt_len: int) -> float:
        """What recomputing a prompt here would take, by this worker's calibration."""
        per_layer_ms = self.calibration.suffix_ms_per_layer(prompt_len, self.sharers())
        return per_layer_ms * self.shape.num_layers / 1e3

    def handoff_memory(self, prompt_len: int, max_new_tokens: int) -> int:
        """What one request holds here: its cache, the boundary, the messages read ahead."""
        shape, elem = self.shape, self.elem_bytes()
        cache = shape.num_layers * shape.kv_layer_bytes(prompt_len + max_new_tokens, elem)
        read_ahead = PREFETCH * shape.kv_layer_bytes(prompt_len)
        return cache + shape.boundary_bytes(prompt_len) + read_ahead

    def recompute(self, ids: list[int], capacity: int) -> tuple[KVCache, torch.Tensor]:
        """The prompt's cache and first logits, computed here (counted as this worker's load
        while it runs)."""
        with self._recompute_lock:
            key = next(self._recompute_ids)
            self.recomputing[key] = (time.monotonic(), len(ids))
        try:
            out = prefill(self.model, ids, boundaries=())
        finally:
            with self._recompute_lock:
                del self.recomputing[key]
        return KVCache.from_layers(out.keys, out.values, capacity), out.logits

    def decoder(self, cache: KVCache) -> Callable[[int], torch.Tensor]:
        """One request's decode step, token id -> logits (on a GPU a CUDA graph's replays)."""
        return decode_steps(self.model, cache)

    def close(self) -> None:
        self.sharing.close()
        self.receiver.shutdown()


def handoffs_computing(transfers: TransferBook) -> int:
    """Handoffs whose suffix or token-only recompute runs now (one waiting for data does not)."""
    return sum(transfers.count(state) for state in (TransferState.PREFIX, TransferState.JOINING))
