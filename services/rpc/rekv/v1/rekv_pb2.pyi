from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Quality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUALITY_UNSPECIFIED: _ClassVar[Quality]
    QUALITY_LOSSLESS: _ClassVar[Quality]
    QUALITY_GATED: _ClassVar[Quality]
QUALITY_UNSPECIFIED: Quality
QUALITY_LOSSLESS: Quality
QUALITY_GATED: Quality

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "max_new_tokens", "sampling", "forced_action", "stop_at_eos", "forced_schedule", "quality")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FORCED_ACTION_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_EOS_FIELD_NUMBER: _ClassVar[int]
    FORCED_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: TokenIds
    text: str
    max_new_tokens: int
    sampling: SamplingParams
    forced_action: Action
    stop_at_eos: bool
    forced_schedule: Schedule
    quality: Quality
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., forced_action: _Optional[_Union[Action, _Mapping]] = ..., stop_at_eos: _Optional[bool] = ..., forced_schedule: _Optional[_Union[Schedule, _Mapping]] = ..., quality: _Optional[_Union[Quality, str]] = ...) -> None: ...

class Schedule(_message.Message):
    __slots__ = ("streamed", "boundary_chunk_tokens", "pipelined")
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    streamed: bool
    boundary_chunk_tokens: int
    pipelined: bool
    def __init__(self, streamed: _Optional[bool] = ..., boundary_chunk_tokens: _Optional[int] = ..., pipelined: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class Action(_message.Message):
    __slots__ = ("codec", "cut", "boundary", "split_tokens", "progressive", "layer_split_tokens")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    SPLIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROGRESSIVE_FIELD_NUMBER: _ClassVar[int]
    LAYER_SPLIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    codec: str
    cut: int
    boundary: str
    split_tokens: int
    progressive: bool
    layer_split_tokens: int
    def __init__(self, codec: _Optional[str] = ..., cut: _Optional[int] = ..., boundary: _Optional[str] = ..., split_tokens: _Optional[int] = ..., progressive: _Optional[bool] = ..., layer_split_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "summary")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    summary: Summary
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., summary: _Optional[_Union[Summary, _Mapping]] = ...) -> None: ...

class Summary(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "generated_tokens", "finish_reason", "action", "action_kind", "bytes", "predicted_handoff_ms", "measured_handoff_ms", "ttft_ms", "fallback", "fallback_reason", "timings", "request_ms", "schedule", "quality", "fallback_scope", "recomputed_layers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ACTION_KIND_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_MS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_SCOPE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str
    action: Action
    action_kind: str
    bytes: WireBytes
    predicted_handoff_ms: float
    measured_handoff_ms: float
    ttft_ms: float
    fallback: bool
    fallback_reason: str
    timings: HandoffTimings
    request_ms: float
    schedule: Schedule
    quality: Quality
    fallback_scope: str
    recomputed_layers: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., action: _Optional[_Union[Action, _Mapping]] = ..., action_kind: _Optional[str] = ..., bytes: _Optional[_Union[WireBytes, _Mapping]] = ..., predicted_handoff_ms: _Optional[float] = ..., measured_handoff_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., fallback: _Optional[bool] = ..., fallback_reason: _Optional[str] = ..., timings: _Optional[_Union[HandoffTimings, _Mapping]] = ..., request_ms: _Optional[float] = ..., schedule: _Optional[_Union[Schedule, _Mapping]] = ..., quality: _Optional[_Union[Quality, str]] = ..., fallback_scope: _Optional[str] = ..., recomputed_layers: _Optional[int] = ...) -> None: ...

class HandoffTimings(_message.Message):
    __slots__ = ("prefill_ms", "q_ms", "h_ms", "x_ms", "r_ms", "j_ms")
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    Q_MS_FIELD_NUMBER: _ClassVar[int]
    H_MS_FIELD_NUMBER: _ClassVar[int]
    X_MS_FIELD_NUMBER: _ClassVar[int]
    R_MS_FIELD_NUMBER: _ClassVar[int]
    J_MS_FIELD_NUMBER: _ClassVar[int]
    prefill_ms: float
    q_ms: float
    h_ms: float
    x_ms: float
    r_ms: float
    j_ms: float
    def __init__(self, prefill_ms: _Optional[float] = ..., q_ms: _Optional[float] = ..., h_ms: _Optional[float] = ..., x_ms: _Optional[float] = ..., r_ms: _Optional[float] = ..., j_ms: _Optional[float] = ...) -> None: ...

class WireBytes(_message.Message):
    __slots__ = ("boundary", "prefix", "scales", "tokens", "head")
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    boundary: int
    prefix: int
    scales: int
    tokens: int
    head: int
    def __init__(self, boundary: _Optional[int] = ..., prefix: _Optional[int] = ..., scales: _Optional[int] = ..., tokens: _Optional[int] = ..., head: _Optional[int] = ...) -> None: ...

class HandoffRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "token_ids", "offer", "forced_action", "handoff_key", "encrypt_data_plane", "forced_schedule", "quality")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFER_FIELD_NUMBER: _ClassVar[int]
    FORCED_ACTION_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_KEY_FIELD_NUMBER: _ClassVar[int]
    ENCRYPT_DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    FORCED_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    offer: DecodeOffer
    forced_action: Action
    handoff_key: bytes
    encrypt_data_plane: bool
    forced_schedule: Schedule
    quality: Quality
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., offer: _Optional[_Union[DecodeOffer, _Mapping]] = ..., forced_action: _Optional[_Union[Action, _Mapping]] = ..., handoff_key: _Optional[bytes] = ..., encrypt_data_plane: _Optional[bool] = ..., forced_schedule: _Optional[_Union[Schedule, _Mapping]] = ..., quality: _Optional[_Union[Quality, str]] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("ucx_address", "probe_id", "probe_key")
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROBE_ID_FIELD_NUMBER: _ClassVar[int]
    PROBE_KEY_FIELD_NUMBER: _ClassVar[int]
    ucx_address: str
    probe_id: str
    probe_key: bytes
    def __init__(self, ucx_address: _Optional[str] = ..., probe_id: _Optional[str] = ..., probe_key: _Optional[bytes] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("connected_now", "connect_ms", "probe_bytes", "probe_ms")
    CONNECTED_NOW_FIELD_NUMBER: _ClassVar[int]
    CONNECT_MS_FIELD_NUMBER: _ClassVar[int]
    PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROBE_MS_FIELD_NUMBER: _ClassVar[int]
    connected_now: bool
    connect_ms: float
    probe_bytes: int
    probe_ms: float
    def __init__(self, connected_now: _Optional[bool] = ..., connect_ms: _Optional[float] = ..., probe_bytes: _Optional[int] = ..., probe_ms: _Optional[float] = ...) -> None: ...

class DecodeOffer(_message.Message):
    __slots__ = ("ucx_address", "codecs", "suffix_ms_per_layer", "restore_ms_per_mib", "join_ms", "queue_depth", "handoffs_in_flight", "model", "num_layers", "measured_over_model", "link_gbps", "message_ms", "measured", "accepts_streamed", "boundary_chunk_tokens", "computing", "backlog_ms", "planned_transfers", "suffix_scale", "accepts_pipelined", "model_fingerprint", "running_batch", "itl_budget_ms", "decode_step_ms", "accepts_token_split", "accepts_progressive", "accepts_layer_split")
    class RestoreMsPerMibEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MeasuredOverModelEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_MS_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    RESTORE_MS_PER_MIB_FIELD_NUMBER: _ClassVar[int]
    JOIN_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_OVER_MODEL_FIELD_NUMBER: _ClassVar[int]
    LINK_GBPS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_MS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_STREAMED_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTING_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_MS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_SCALE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_PIPELINED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_BATCH_FIELD_NUMBER: _ClassVar[int]
    ITL_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_TOKEN_SPLIT_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_PROGRESSIVE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_LAYER_SPLIT_FIELD_NUMBER: _ClassVar[int]
    ucx_address: str
    codecs: _containers.RepeatedScalarFieldContainer[str]
    suffix_ms_per_layer: float
    restore_ms_per_mib: _containers.ScalarMap[str, float]
    join_ms: float
    queue_depth: int
    handoffs_in_flight: int
    model: str
    num_layers: int
    measured_over_model: _containers.ScalarMap[str, float]
    link_gbps: float
    message_ms: float
    measured: _containers.RepeatedCompositeFieldContainer[MeasuredHandoffs]
    accepts_streamed: bool
    boundary_chunk_tokens: int
    computing: int
    backlog_ms: float
    planned_transfers: _containers.RepeatedScalarFieldContainer[str]
    suffix_scale: float
    accepts_pipelined: bool
    model_fingerprint: str
    running_batch: int
    itl_budget_ms: float
    decode_step_ms: float
    accepts_token_split: bool
    accepts_progressive: bool
    accepts_layer_split: bool
    def __init__(self, ucx_address: _Optional[str] = ..., codecs: _Optional[_Iterable[str]] = ..., suffix_ms_per_layer: _Optional[float] = ..., restore_ms_per_mib: _Optional[_Mapping[str, float]] = ..., join_ms: _Optional[float] = ..., queue_depth: _Optional[int] = ..., handoffs_in_flight: _Optional[int] = ..., model: _Optional[str] = ..., num_layers: _Optional[int] = ..., measured_over_model: _Optional[_Mapping[str, float]] = ..., link_gbps: _Optional[float] = ..., message_ms: _Optional[float] = ..., measured: _Optional[_Iterable[_Union[MeasuredHandoffs, _Mapping]]] = ..., accepts_streamed: _Optional[bool] = ..., boundary_chunk_tokens: _Optional[int] = ..., computing: _Optional[int] = ..., backlog_ms: _Optional[float] = ..., planned_transfers: _Optional[_Iterable[str]] = ..., suffix_scale: _Optional[float] = ..., accepts_pipelined: _Optional[bool] = ..., model_fingerprint: _Optional[str] = ..., running_batch: _Optional[int] = ..., itl_budget_ms: _Optional[float] = ..., decode_step_ms: _Optional[float] = ..., accepts_token_split: _Optional[bool] = ..., accepts_progressive: _Optional[bool] = ..., accepts_layer_split: _Optional[bool] = ...) -> None: ...

class MeasuredHandoffs(_message.Message):
    __slots__ = ("median_ms", "median_prompt_len", "count", "action", "pipelined")
    MEDIAN_MS_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    median_ms: float
    median_prompt_len: int
    count: int
    action: Action
    pipelined: bool
    def __init__(self, median_ms: _Optional[float] = ..., median_prompt_len: _Optional[int] = ..., count: _Optional[int] = ..., action: _Optional[_Union[Action, _Mapping]] = ..., pipelined: _Optional[bool] = ...) -> None: ...

class HandoffResponse(_message.Message):
    __slots__ = ("action", "action_kind", "predicted_ms", "candidates", "prefill_ms", "q_ms", "send_ms", "bytes", "link_gbps_estimate", "model_ms", "queue_depth", "schedule")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ACTION_KIND_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    Q_MS_FIELD_NUMBER: _ClassVar[int]
    SEND_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LINK_GBPS_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    action: Action
    action_kind: str
    predicted_ms: float
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    prefill_ms: float
    q_ms: float
    send_ms: float
    bytes: WireBytes
    link_gbps_estimate: float
    model_ms: float
    queue_depth: int
    schedule: Schedule
    def __init__(self, action: _Optional[_Union[Action, _Mapping]] = ..., action_kind: _Optional[str] = ..., predicted_ms: _Optional[float] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., prefill_ms: _Optional[float] = ..., q_ms: _Optional[float] = ..., send_ms: _Optional[float] = ..., bytes: _Optional[_Union[WireBytes, _Mapping]] = ..., link_gbps_estimate: _Optional[float] = ..., model_ms: _Optional[float] = ..., queue_depth: _Optional[int] = ..., schedule: _Optional[_Union[Schedule, _Mapping]] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("action", "action_kind", "predicted_ms", "bytes")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ACTION_KIND_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    action: Action
    action_kind: str
    predicted_ms: float
    bytes: int
    def __init__(self, action: _Optional[_Union[Action, _Mapping]] = ..., action_kind: _Optional[str] = ..., predicted_ms: _Optional[float] = ..., bytes: _Optional[int] = ...) -> None: ...
