from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrepareState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IDLE: _ClassVar[PrepareState]
    PREPARING: _ClassVar[PrepareState]
    PREPARED: _ClassVar[PrepareState]
    PREPARE_FAILED: _ClassVar[PrepareState]

class WireDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    F32: _ClassVar[WireDType]
    F16: _ClassVar[WireDType]
    BF16: _ClassVar[WireDType]

class StageState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STARTING: _ClassVar[StageState]
    READY: _ClassVar[StageState]
    STOPPING: _ClassVar[StageState]
    STOPPED: _ClassVar[StageState]
    FAILED: _ClassVar[StageState]

class FrameKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRAME_UNSPECIFIED: _ClassVar[FrameKind]
    PREFILL: _ClassVar[FrameKind]
    DECODE: _ClassVar[FrameKind]
    VERIFY: _ClassVar[FrameKind]
    END: _ClassVar[FrameKind]
    REPLY: _ClassVar[FrameKind]
    ERROR: _ClassVar[FrameKind]
IDLE: PrepareState
PREPARING: PrepareState
PREPARED: PrepareState
PREPARE_FAILED: PrepareState
F32: WireDType
F16: WireDType
BF16: WireDType
STARTING: StageState
READY: StageState
STOPPING: StageState
STOPPED: StageState
FAILED: StageState
FRAME_UNSPECIFIED: FrameKind
PREFILL: FrameKind
DECODE: FrameKind
VERIFY: FrameKind
END: FrameKind
REPLY: FrameKind
ERROR: FrameKind

class Ack(_message.Message):
    __slots__ = ("ok", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("protocol_version", "coordinator_id", "term", "topology_id", "run_id", "lease_until_ms")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_UNTIL_MS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    coordinator_id: str
    term: int
    topology_id: str
    run_id: str
    lease_until_ms: int
    def __init__(self, protocol_version: _Optional[int] = ..., coordinator_id: _Optional[str] = ..., term: _Optional[int] = ..., topology_id: _Optional[str] = ..., run_id: _Optional[str] = ..., lease_until_ms: _Optional[int] = ...) -> None: ...

class ClaimReply(_message.Message):
    __slots__ = ("ok", "message", "current_term")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_TERM_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    current_term: int
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ..., current_term: _Optional[int] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("protocol_version", "term", "package_ref", "manifest_sha256", "layer_start", "layer_end", "artifact_source", "coordinator_id", "mtp")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_REF_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    MTP_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    term: int
    package_ref: str
    manifest_sha256: str
    layer_start: int
    layer_end: int
    artifact_source: str
    coordinator_id: str
    mtp: bool
    def __init__(self, protocol_version: _Optional[int] = ..., term: _Optional[int] = ..., package_ref: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., artifact_source: _Optional[str] = ..., coordinator_id: _Optional[str] = ..., mtp: _Optional[bool] = ...) -> None: ...

class PrepareReply(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class InventoryRequest(_message.Message):
    __slots__ = ("protocol_version", "coordinator_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    coordinator_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., coordinator_id: _Optional[str] = ...) -> None: ...

class InventoryReply(_message.Message):
    __slots__ = ("state", "message", "bytes_done", "bytes_total", "layer_start", "layer_end", "manifest_sha256", "engine")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    state: PrepareState
    message: str
    bytes_done: int
    bytes_total: int
    layer_start: int
    layer_end: int
    manifest_sha256: str
    engine: str
    def __init__(self, state: _Optional[_Union[PrepareState, str]] = ..., message: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., manifest_sha256: _Optional[str] = ..., engine: _Optional[str] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("protocol_version", "term", "layer_start", "layer_end", "ctx_size", "lanes", "wire_dtype", "final", "threads", "batch", "upstream", "downstream", "stage_index", "wire_delay_ms", "wire_jitter_ms", "work_layers", "coordinator_id", "mtp", "kv_owner")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    CTX_SIZE_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    WIRE_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    WIRE_JITTER_MS_FIELD_NUMBER: _ClassVar[int]
    WORK_LAYERS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    MTP_FIELD_NUMBER: _ClassVar[int]
    KV_OWNER_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    term: int
    layer_start: int
    layer_end: int
    ctx_size: int
    lanes: int
    wire_dtype: WireDType
    final: bool
    threads: int
    batch: int
    upstream: str
    downstream: str
    stage_index: int
    wire_delay_ms: float
    wire_jitter_ms: float
    work_layers: float
    coordinator_id: str
    mtp: bool
    kv_owner: str
    def __init__(self, protocol_version: _Optional[int] = ..., term: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., ctx_size: _Optional[int] = ..., lanes: _Optional[int] = ..., wire_dtype: _Optional[_Union[WireDType, str]] = ..., final: _Optional[bool] = ..., threads: _Optional[int] = ..., batch: _Optional[int] = ..., upstream: _Optional[str] = ..., downstream: _Optional[str] = ..., stage_index: _Optional[int] = ..., wire_delay_ms: _Optional[float] = ..., wire_jitter_ms: _Optional[float] = ..., work_layers: _Optional[float] = ..., coordinator_id: _Optional[str] = ..., mtp: _Optional[bool] = ..., kv_owner: _Optional[str] = ...) -> None: ...

class Calibration(_message.Message):
    __slots__ = ("single_us", "batch_us", "batch_rows", "fixed_us", "per_layer_us")
    SINGLE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    FIXED_US_FIELD_NUMBER: _ClassVar[int]
    PER_LAYER_US_FIELD_NUMBER: _ClassVar[int]
    single_us: float
    batch_us: float
    batch_rows: int
    fixed_us: float
    per_layer_us: float
    def __init__(self, single_us: _Optional[float] = ..., batch_us: _Optional[float] = ..., batch_rows: _Optional[int] = ..., fixed_us: _Optional[float] = ..., per_layer_us: _Optional[float] = ...) -> None: ...

class LoadReply(_message.Message):
    __slots__ = ("ready", "endpoint", "message", "calibration", "mtp_layers", "kv_tier")
    READY_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    MTP_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    endpoint: str
    message: str
    calibration: Calibration
    mtp_layers: int
    kv_tier: bool
    def __init__(self, ready: _Optional[bool] = ..., endpoint: _Optional[str] = ..., message: _Optional[str] = ..., calibration: _Optional[_Union[Calibration, _Mapping]] = ..., mtp_layers: _Optional[int] = ..., kv_tier: _Optional[bool] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("protocol_version", "term", "coordinator_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    term: int
    coordinator_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., term: _Optional[int] = ..., coordinator_id: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("protocol_version", "coordinator_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    coordinator_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., coordinator_id: _Optional[str] = ...) -> None: ...

class ClaimInfo(_message.Message):
    __slots__ = ("coordinator_id", "term", "lease_until_ms", "layer_start", "layer_end", "manifest_sha256", "lanes", "lanes_in_use", "state")
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    LEASE_UNTIL_MS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    LANES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    coordinator_id: str
    term: int
    lease_until_ms: int
    layer_start: int
    layer_end: int
    manifest_sha256: str
    lanes: int
    lanes_in_use: int
    state: StageState
    def __init__(self, coordinator_id: _Optional[str] = ..., term: _Optional[int] = ..., lease_until_ms: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., manifest_sha256: _Optional[str] = ..., lanes: _Optional[int] = ..., lanes_in_use: _Optional[int] = ..., state: _Optional[_Union[StageState, str]] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("state", "message", "term", "layer_start", "layer_end", "mem_total_bytes", "mem_available_bytes", "rss_bytes", "stage_id", "protocol_version", "busy_seconds", "engine", "claims", "ranges_loaded", "kv_tier")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    MEM_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEM_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    RANGES_LOADED_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_FIELD_NUMBER: _ClassVar[int]
    state: StageState
    message: str
    term: int
    layer_start: int
    layer_end: int
    mem_total_bytes: int
    mem_available_bytes: int
    rss_bytes: int
    stage_id: str
    protocol_version: int
    busy_seconds: float
    engine: str
    claims: _containers.RepeatedCompositeFieldContainer[ClaimInfo]
    ranges_loaded: int
    kv_tier: KvTierStats
    def __init__(self, state: _Optional[_Union[StageState, str]] = ..., message: _Optional[str] = ..., term: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., mem_total_bytes: _Optional[int] = ..., mem_available_bytes: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., stage_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., engine: _Optional[str] = ..., claims: _Optional[_Iterable[_Union[ClaimInfo, _Mapping]]] = ..., ranges_loaded: _Optional[int] = ..., kv_tier: _Optional[_Union[KvTierStats, _Mapping]] = ...) -> None: ...

class KvTierStats(_message.Message):
    __slots__ = ("hits", "hits_disk", "misses", "saved", "ram_bytes", "disk_bytes", "restore_seconds", "save_seconds", "restored_positions", "ram_limit", "disk_limit")
    HITS_FIELD_NUMBER: _ClassVar[int]
    HITS_DISK_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    SAVED_FIELD_NUMBER: _ClassVar[int]
    RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    RAM_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DISK_LIMIT_FIELD_NUMBER: _ClassVar[int]
    hits: int
    hits_disk: int
    misses: int
    saved: int
    ram_bytes: int
    disk_bytes: int
    restore_seconds: float
    save_seconds: float
    restored_positions: int
    ram_limit: int
    disk_limit: int
    def __init__(self, hits: _Optional[int] = ..., hits_disk: _Optional[int] = ..., misses: _Optional[int] = ..., saved: _Optional[int] = ..., ram_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., restore_seconds: _Optional[float] = ..., save_seconds: _Optional[float] = ..., restored_positions: _Optional[int] = ..., ram_limit: _Optional[int] = ..., disk_limit: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("protocol_version", "manifest_sha256", "path", "offset")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    manifest_sha256: str
    path: str
    offset: int
    def __init__(self, protocol_version: _Optional[int] = ..., manifest_sha256: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("data", "offset")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class Handshake(_message.Message):
    __slots__ = ("protocol_version", "token", "role")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    token: str
    role: str
    def __init__(self, protocol_version: _Optional[int] = ..., token: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("ok", "message", "protocol_version")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    protocol_version: int
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token", "bias")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token: int
    bias: float
    def __init__(self, token: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "history", "drafts", "masks", "rejection", "proposed", "checks_first", "targets")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    REJECTION_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIRST_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    logprobs: int
    history: _containers.RepeatedScalarFieldContainer[int]
    drafts: _containers.RepeatedScalarFieldContainer[int]
    masks: _containers.RepeatedScalarFieldContainer[bytes]
    rejection: bool
    proposed: _containers.RepeatedCompositeFieldContainer[Proposed]
    checks_first: bool
    targets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., logprobs: _Optional[int] = ..., history: _Optional[_Iterable[int]] = ..., drafts: _Optional[_Iterable[int]] = ..., masks: _Optional[_Iterable[bytes]] = ..., rejection: _Optional[bool] = ..., proposed: _Optional[_Iterable[_Union[Proposed, _Mapping]]] = ..., checks_first: _Optional[bool] = ..., targets: _Optional[_Iterable[int]] = ...) -> None: ...

class Proposed(_message.Message):
    __slots__ = ("token", "ids", "weights")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    token: int
    ids: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., ids: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("tokens", "logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Hop(_message.Message):
    __slots__ = ("stage_index", "compute_us", "queue_us", "codec_us", "sample_us", "batch_rows")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    CODEC_US_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    compute_us: int
    queue_us: int
    codec_us: int
    sample_us: int
    batch_rows: int
    def __init__(self, stage_index: _Optional[int] = ..., compute_us: _Optional[int] = ..., queue_us: _Optional[int] = ..., codec_us: _Optional[int] = ..., sample_us: _Optional[int] = ..., batch_rows: _Optional[int] = ...) -> None: ...

class HopTimings(_message.Message):
    __slots__ = ("hops",)
    HOPS_FIELD_NUMBER: _ClassVar[int]
    hops: _containers.RepeatedCompositeFieldContainer[Hop]
    def __init__(self, hops: _Optional[_Iterable[_Union[Hop, _Mapping]]] = ...) -> None: ...

class FrameHeader(_message.Message):
    __slots__ = ("session_id", "frame_id", "kind", "start_pos", "dtype", "shape", "payload_bytes", "tokens", "want_reply", "all_logits", "sampling", "message", "timings", "logprobs", "top", "epoch", "lane", "keep", "fed", "propose", "proposals", "proposed_at", "propose_us", "stash", "evict", "restore", "restore_positions", "restore_keep")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FRAME_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WANT_REPLY_FIELD_NUMBER: _ClassVar[int]
    ALL_LOGITS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    FED_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_AT_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_US_FIELD_NUMBER: _ClassVar[int]
    STASH_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    RESTORE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_KEEP_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    frame_id: int
    kind: FrameKind
    start_pos: int
    dtype: WireDType
    shape: _containers.RepeatedScalarFieldContainer[int]
    payload_bytes: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    want_reply: bool
    all_logits: bool
    sampling: Sampling
    message: str
    timings: HopTimings
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    epoch: int
    lane: int
    keep: int
    fed: _containers.RepeatedScalarFieldContainer[int]
    propose: int
    proposals: _containers.RepeatedCompositeFieldContainer[Proposed]
    proposed_at: int
    propose_us: int
    stash: str
    evict: bool
    restore: str
    restore_positions: int
    restore_keep: bool
    def __init__(self, session_id: _Optional[int] = ..., frame_id: _Optional[int] = ..., kind: _Optional[_Union[FrameKind, str]] = ..., start_pos: _Optional[int] = ..., dtype: _Optional[_Union[WireDType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., payload_bytes: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., want_reply: _Optional[bool] = ..., all_logits: _Optional[bool] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., message: _Optional[str] = ..., timings: _Optional[_Union[HopTimings, _Mapping]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., epoch: _Optional[int] = ..., lane: _Optional[int] = ..., keep: _Optional[int] = ..., fed: _Optional[_Iterable[int]] = ..., propose: _Optional[int] = ..., proposals: _Optional[_Iterable[_Union[Proposed, _Mapping]]] = ..., proposed_at: _Optional[int] = ..., propose_us: _Optional[int] = ..., stash: _Optional[str] = ..., evict: _Optional[bool] = ..., restore: _Optional[str] = ..., restore_positions: _Optional[int] = ..., restore_keep: _Optional[bool] = ...) -> None: ...
