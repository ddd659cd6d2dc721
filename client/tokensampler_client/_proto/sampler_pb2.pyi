from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]

class LogprobsMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROBS_MODE_UNSPECIFIED: _ClassVar[LogprobsMode]
    LOGPROBS_MODE_RAW: _ClassVar[LogprobsMode]
    LOGPROBS_MODE_PROCESSED: _ClassVar[LogprobsMode]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_UINT8: DType
LOGPROBS_MODE_UNSPECIFIED: LogprobsMode
LOGPROBS_MODE_RAW: LogprobsMode
LOGPROBS_MODE_PROCESSED: LogprobsMode

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TokenLists(_message.Message):
    __slots__ = ("ids", "lengths")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("tokens", "values")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenLists
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Union[TokenLists, _Mapping]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "has_seed", "position", "iteration", "repetition_penalty", "presence_penalty", "frequency_penalty", "allowed_token_ids", "banned_token_ids", "logit_bias", "output_token_ids", "prompt_token_ids", "min_tokens", "num_generated", "stop_token_ids", "no_repeat_ngram_size", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "typical_p", "top_n_sigma", "xtc_threshold", "xtc_probability", "token_bitmask")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BANNED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NO_REPEAT_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRY_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    DRY_BASE_FIELD_NUMBER: _ClassVar[int]
    DRY_ALLOWED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRY_PENALTY_LAST_N_FIELD_NUMBER: _ClassVar[int]
    DRY_SEQUENCE_BREAKERS_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    TOP_N_SIGMA_FIELD_NUMBER: _ClassVar[int]
    XTC_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    XTC_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    temperature: _containers.RepeatedScalarFieldContainer[float]
    top_k: _containers.RepeatedScalarFieldContainer[int]
    top_p: _containers.RepeatedScalarFieldContainer[float]
    min_p: _containers.RepeatedScalarFieldContainer[float]
    seed: _containers.RepeatedScalarFieldContainer[int]
    has_seed: _containers.RepeatedScalarFieldContainer[bool]
    position: _containers.RepeatedScalarFieldContainer[int]
    iteration: _containers.RepeatedScalarFieldContainer[int]
    repetition_penalty: _containers.RepeatedScalarFieldContainer[float]
    presence_penalty: _containers.RepeatedScalarFieldContainer[float]
    frequency_penalty: _containers.RepeatedScalarFieldContainer[float]
    allowed_token_ids: TokenLists
    banned_token_ids: TokenLists
    logit_bias: LogitBias
    output_token_ids: TokenLists
    prompt_token_ids: TokenLists
    min_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_generated: _containers.RepeatedScalarFieldContainer[int]
    stop_token_ids: TokenLists
    no_repeat_ngram_size: _containers.RepeatedScalarFieldContainer[int]
    dry_multiplier: _containers.RepeatedScalarFieldContainer[float]
    dry_base: _containers.RepeatedScalarFieldContainer[float]
    dry_allowed_length: _containers.RepeatedScalarFieldContainer[int]
    dry_penalty_last_n: _containers.RepeatedScalarFieldContainer[int]
    dry_sequence_breakers: TokenSequences
    typical_p: _containers.RepeatedScalarFieldContainer[float]
    top_n_sigma: _containers.RepeatedScalarFieldContainer[float]
    xtc_threshold: _containers.RepeatedScalarFieldContainer[float]
    xtc_probability: _containers.RepeatedScalarFieldContainer[float]
    token_bitmask: Tensor
    def __init__(self, temperature: _Optional[_Iterable[float]] = ..., top_k: _Optional[_Iterable[int]] = ..., top_p: _Optional[_Iterable[float]] = ..., min_p: _Optional[_Iterable[float]] = ..., seed: _Optional[_Iterable[int]] = ..., has_seed: _Optional[_Iterable[bool]] = ..., position: _Optional[_Iterable[int]] = ..., iteration: _Optional[_Iterable[int]] = ..., repetition_penalty: _Optional[_Iterable[float]] = ..., presence_penalty: _Optional[_Iterable[float]] = ..., frequency_penalty: _Optional[_Iterable[float]] = ..., allowed_token_ids: _Optional[_Union[TokenLists, _Mapping]] = ..., banned_token_ids: _Optional[_Union[TokenLists, _Mapping]] = ..., logit_bias: _Optional[_Union[LogitBias, _Mapping]] = ..., output_token_ids: _Optional[_Union[TokenLists, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenLists, _Mapping]] = ..., min_tokens: _Optional[_Iterable[int]] = ..., num_generated: _Optional[_Iterable[int]] = ..., stop_token_ids: _Optional[_Union[TokenLists, _Mapping]] = ..., no_repeat_ngram_size: _Optional[_Iterable[int]] = ..., dry_multiplier: _Optional[_Iterable[float]] = ..., dry_base: _Optional[_Iterable[float]] = ..., dry_allowed_length: _Optional[_Iterable[int]] = ..., dry_penalty_last_n: _Optional[_Iterable[int]] = ..., dry_sequence_breakers: _Optional[_Union[TokenSequences, _Mapping]] = ..., typical_p: _Optional[_Iterable[float]] = ..., top_n_sigma: _Optional[_Iterable[float]] = ..., xtc_threshold: _Optional[_Iterable[float]] = ..., xtc_probability: _Optional[_Iterable[float]] = ..., token_bitmask: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class TokenSequences(_message.Message):
    __slots__ = ("ids", "lengths", "counts")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ...) -> None: ...

class HiddenStates(_message.Message):
    __slots__ = ("states", "weights", "states_ref")
    STATES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    STATES_REF_FIELD_NUMBER: _ClassVar[int]
    states: Tensor
    weights: str
    states_ref: TensorRef
    def __init__(self, states: _Optional[_Union[Tensor, _Mapping]] = ..., weights: _Optional[str] = ..., states_ref: _Optional[_Union[TensorRef, _Mapping]] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("region", "offset", "dtype", "shape")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class RowsRef(_message.Message):
    __slots__ = ("region", "dtype", "row_size", "row_offsets")
    REGION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROW_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    region: str
    dtype: DType
    row_size: int
    row_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, region: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., row_size: _Optional[int] = ..., row_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class OutputRefs(_message.Message):
    __slots__ = ("tokens", "logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: TensorRef
    logprobs: TensorRef
    def __init__(self, tokens: _Optional[_Union[TensorRef, _Mapping]] = ..., logprobs: _Optional[_Union[TensorRef, _Mapping]] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("logits", "hidden", "logits_ref", "logits_rows", "params", "num_samples", "return_logprobs", "logprobs_mode", "top_logprobs", "output")
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    LOGITS_REF_FIELD_NUMBER: _ClassVar[int]
    LOGITS_ROWS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    logits: Tensor
    hidden: HiddenStates
    logits_ref: TensorRef
    logits_rows: RowsRef
    params: SamplingParams
    num_samples: int
    return_logprobs: bool
    logprobs_mode: LogprobsMode
    top_logprobs: int
    output: OutputRefs
    def __init__(self, logits: _Optional[_Union[Tensor, _Mapping]] = ..., hidden: _Optional[_Union[HiddenStates, _Mapping]] = ..., logits_ref: _Optional[_Union[TensorRef, _Mapping]] = ..., logits_rows: _Optional[_Union[RowsRef, _Mapping]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_samples: _Optional[int] = ..., return_logprobs: bool = ..., logprobs_mode: _Optional[_Union[LogprobsMode, str]] = ..., top_logprobs: _Optional[int] = ..., output: _Optional[_Union[OutputRefs, _Mapping]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ns", "compute_ns", "total_ns")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    compute_ns: int
    total_ns: int
    def __init__(self, queue_ns: _Optional[int] = ..., compute_ns: _Optional[int] = ..., total_ns: _Optional[int] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("tokens", "seeds", "logprobs", "top_logprob_ids", "top_logprobs", "valid", "nan_detected", "timings", "request_id")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROB_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    NAN_DETECTED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    tokens: Tensor
    seeds: _containers.RepeatedScalarFieldContainer[int]
    logprobs: Tensor
    top_logprob_ids: Tensor
    top_logprobs: Tensor
    valid: _containers.RepeatedScalarFieldContainer[bool]
    nan_detected: _containers.RepeatedScalarFieldContainer[bool]
    timings: Timings
    request_id: str
    def __init__(self, tokens: _Optional[_Union[Tensor, _Mapping]] = ..., seeds: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., top_logprob_ids: _Optional[_Union[Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., valid: _Optional[_Iterable[bool]] = ..., nan_detected: _Optional[_Iterable[bool]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class SampleStreamResponse(_message.Message):
    __slots__ = ("response", "error")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    response: SampleResponse
    error: StreamError
    def __init__(self, response: _Optional[_Union[SampleResponse, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message", "request_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    request_id: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_batch_rows", "max_message_bytes", "max_num_samples", "max_top_logprobs", "max_weight_bytes", "max_batch_elements")
    MAX_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    max_batch_rows: int
    max_message_bytes: int
    max_num_samples: int
    max_top_logprobs: int
    max_weight_bytes: int
    max_batch_elements: int
    def __init__(self, max_batch_rows: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_num_samples: _Optional[int] = ..., max_top_logprobs: _Optional[int] = ..., max_weight_bytes: _Optional[int] = ..., max_batch_elements: _Optional[int] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "backend", "device", "limits", "logits_dtypes", "features", "kernels", "api_version", "registered_weights", "registered_weights_bytes", "device_memory_allocated_bytes", "device_memory_reserved_bytes", "routes", "mps")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_DTYPES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    MPS_FIELD_NUMBER: _ClassVar[int]
    version: str
    backend: str
    device: str
    limits: Limits
    logits_dtypes: _containers.RepeatedScalarFieldContainer[DType]
    features: _containers.RepeatedScalarFieldContainer[str]
    kernels: _containers.RepeatedScalarFieldContainer[str]
    api_version: str
    registered_weights: int
    registered_weights_bytes: int
    device_memory_allocated_bytes: int
    device_memory_reserved_bytes: int
    routes: _containers.RepeatedCompositeFieldContainer[Route]
    mps: str
    def __init__(self, version: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., logits_dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., features: _Optional[_Iterable[str]] = ..., kernels: _Optional[_Iterable[str]] = ..., api_version: _Optional[str] = ..., registered_weights: _Optional[int] = ..., registered_weights_bytes: _Optional[int] = ..., device_memory_allocated_bytes: _Optional[int] = ..., device_memory_reserved_bytes: _Optional[int] = ..., routes: _Optional[_Iterable[_Union[Route, _Mapping]]] = ..., mps: _Optional[str] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("rows", "kernels", "cost")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    rows: str
    kernels: _containers.RepeatedScalarFieldContainer[str]
    cost: str
    def __init__(self, rows: _Optional[str] = ..., kernels: _Optional[_Iterable[str]] = ..., cost: _Optional[str] = ...) -> None: ...

class WeightOptions(_message.Message):
    __slots__ = ("bias", "vocab_size", "soft_cap", "logit_scale")
    BIAS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SOFT_CAP_FIELD_NUMBER: _ClassVar[int]
    LOGIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    bias: Tensor
    vocab_size: int
    soft_cap: float
    logit_scale: float
    def __init__(self, bias: _Optional[_Union[Tensor, _Mapping]] = ..., vocab_size: _Optional[int] = ..., soft_cap: _Optional[float] = ..., logit_scale: _Optional[float] = ...) -> None: ...

class RegisterWeightsChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "options", "sha256", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    options: WeightOptions
    sha256: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., options: _Optional[_Union[WeightOptions, _Mapping]] = ..., sha256: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class RegisterWeightsFromFileRequest(_message.Message):
    __slots__ = ("name", "path", "tensor", "options")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    tensor: str
    options: WeightOptions
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., tensor: _Optional[str] = ..., options: _Optional[_Union[WeightOptions, _Mapping]] = ...) -> None: ...

class RegisterWeightsFromRegionRequest(_message.Message):
    __slots__ = ("name", "weight", "options")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: TensorRef
    options: WeightOptions
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[_Union[TensorRef, _Mapping]] = ..., options: _Optional[_Union[WeightOptions, _Mapping]] = ...) -> None: ...

class WeightsInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "padded_vocab_size", "hidden_size", "dtype", "bytes", "sha256", "in_flight", "region")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PADDED_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    padded_vocab_size: int
    hidden_size: int
    dtype: DType
    bytes: int
    sha256: str
    in_flight: int
    region: str
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., padded_vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., in_flight: _Optional[int] = ..., region: _Optional[str] = ...) -> None: ...

class ListWeightsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWeightsResponse(_message.Message):
    __slots__ = ("weights",)
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    weights: _containers.RepeatedCompositeFieldContainer[WeightsInfo]
    def __init__(self, weights: _Optional[_Iterable[_Union[WeightsInfo, _Mapping]]] = ...) -> None: ...

class UnregisterWeightsRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterWeightsResponse(_message.Message):
    __slots__ = ("weights",)
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    weights: WeightsInfo
    def __init__(self, weights: _Optional[_Union[WeightsInfo, _Mapping]] = ...) -> None: ...

class SharedMemorySource(_message.Message):
    __slots__ = ("key", "byte_size")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    key: str
    byte_size: int
    def __init__(self, key: _Optional[str] = ..., byte_size: _Optional[int] = ...) -> None: ...

class CudaIpcSource(_message.Message):
    __slots__ = ("device_uuid", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "producer_pid", "ready_event_handle")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_PID_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    producer_pid: int
    ready_event_handle: bytes
    def __init__(self, device_uuid: _Optional[str] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: bool = ..., producer_pid: _Optional[int] = ..., ready_event_handle: _Optional[bytes] = ...) -> None: ...

class RegisterRegionRequest(_message.Message):
    __slots__ = ("name", "shm", "cuda_ipc")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    name: str
    shm: SharedMemorySource
    cuda_ipc: CudaIpcSource
    def __init__(self, name: _Optional[str] = ..., shm: _Optional[_Union[SharedMemorySource, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcSource, _Mapping]] = ...) -> None: ...

class RegionInfo(_message.Message):
    __slots__ = ("name", "kind", "byte_size", "device", "in_flight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    byte_size: int
    device: str
    in_flight: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., byte_size: _Optional[int] = ..., device: _Optional[str] = ..., in_flight: _Optional[int] = ...) -> None: ...

class ListRegionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRegionsResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[RegionInfo]
    def __init__(self, regions: _Optional[_Iterable[_Union[RegionInfo, _Mapping]]] = ...) -> None: ...

class UnregisterRegionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterRegionResponse(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: RegionInfo
    def __init__(self, region: _Optional[_Union[RegionInfo, _Mapping]] = ...) -> None: ...

class DiffusionStepRequest(_message.Message):
    __slots__ = ("logits", "hidden", "mask", "params", "confidence_threshold", "commit_count")
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    COMMIT_COUNT_FIELD_NUMBER: _ClassVar[int]
    logits: Tensor
    hidden: HiddenStates
    mask: Tensor
    params: SamplingParams
    confidence_threshold: _containers.RepeatedScalarFieldContainer[float]
    commit_count: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, logits: _Optional[_Union[Tensor, _Mapping]] = ..., hidden: _Optional[_Union[HiddenStates, _Mapping]] = ..., mask: _Optional[_Union[Tensor, _Mapping]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., confidence_threshold: _Optional[_Iterable[float]] = ..., commit_count: _Optional[_Iterable[int]] = ...) -> None: ...

class DiffusionStepResponse(_message.Message):
    __slots__ = ("tokens", "confidences", "mask", "seeds", "timings", "request_id")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    tokens: Tensor
    confidences: Tensor
    mask: Tensor
    seeds: _containers.RepeatedScalarFieldContainer[int]
    timings: Timings
    request_id: str
    def __init__(self, tokens: _Optional[_Union[Tensor, _Mapping]] = ..., confidences: _Optional[_Union[Tensor, _Mapping]] = ..., mask: _Optional[_Union[Tensor, _Mapping]] = ..., seeds: _Optional[_Iterable[int]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class TopKProbsRequest(_message.Message):
    __slots__ = ("logits", "hidden", "k", "temperature")
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    logits: Tensor
    hidden: HiddenStates
    k: int
    temperature: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logits: _Optional[_Union[Tensor, _Mapping]] = ..., hidden: _Optional[_Union[HiddenStates, _Mapping]] = ..., k: _Optional[int] = ..., temperature: _Optional[_Iterable[float]] = ...) -> None: ...

class TopKProbsResponse(_message.Message):
    __slots__ = ("probs", "ids", "timings", "request_id")
    PROBS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    probs: Tensor
    ids: Tensor
    timings: Timings
    request_id: str
    def __init__(self, probs: _Optional[_Union[Tensor, _Mapping]] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class VerifyDraftRequest(_message.Message):
    __slots__ = ("draft_ids", "draft_probs", "draft_logits", "target_logits", "params")
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    TARGET_LOGITS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    draft_ids: Tensor
    draft_probs: Tensor
    draft_logits: Tensor
    target_logits: Tensor
    params: SamplingParams
    def __init__(self, draft_ids: _Optional[_Union[Tensor, _Mapping]] = ..., draft_probs: _Optional[_Union[Tensor, _Mapping]] = ..., draft_logits: _Optional[_Union[Tensor, _Mapping]] = ..., target_logits: _Optional[_Union[Tensor, _Mapping]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class VerifyDraftResponse(_message.Message):
    __slots__ = ("accepted", "tokens", "seeds", "timings", "request_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: Tensor
    tokens: Tensor
    seeds: _containers.RepeatedScalarFieldContainer[int]
    timings: Timings
    request_id: str
    def __init__(self, accepted: _Optional[_Union[Tensor, _Mapping]] = ..., tokens: _Optional[_Union[Tensor, _Mapping]] = ..., seeds: _Optional[_Iterable[int]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class ScoreTokensRequest(_message.Message):
    __slots__ = ("logits", "hidden", "token_ids", "mode", "temperature", "top_k", "top_p", "min_p", "top_logprobs", "return_entropy")
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    logits: Tensor
    hidden: HiddenStates
    token_ids: Tensor
    mode: LogprobsMode
    temperature: _containers.RepeatedScalarFieldContainer[float]
    top_k: _containers.RepeatedScalarFieldContainer[int]
    top_p: _containers.RepeatedScalarFieldContainer[float]
    min_p: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: int
    return_entropy: bool
    def __init__(self, logits: _Optional[_Union[Tensor, _Mapping]] = ..., hidden: _Optional[_Union[HiddenStates, _Mapping]] = ..., token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., mode: _Optional[_Union[LogprobsMode, str]] = ..., temperature: _Optional[_Iterable[float]] = ..., top_k: _Optional[_Iterable[int]] = ..., top_p: _Optional[_Iterable[float]] = ..., min_p: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[int] = ..., return_entropy: bool = ...) -> None: ...

class ScoreTokensResponse(_message.Message):
    __slots__ = ("logprobs", "top_logprob_ids", "top_logprobs", "entropy", "timings", "request_id")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROB_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    logprobs: Tensor
    top_logprob_ids: Tensor
    top_logprobs: Tensor
    entropy: Tensor
    timings: Timings
    request_id: str
    def __init__(self, logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., top_logprob_ids: _Optional[_Union[Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., entropy: _Optional[_Union[Tensor, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class ColocateOpen(_message.Message):
    __slots__ = ("logits", "hidden", "tokens", "logprobs", "logprobs_mode", "flags", "params", "num_samples", "wait_timeout_ms")
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    logits: TensorRef
    hidden: HiddenStates
    tokens: TensorRef
    logprobs: TensorRef
    logprobs_mode: LogprobsMode
    flags: str
    params: SamplingParams
    num_samples: int
    wait_timeout_ms: int
    def __init__(self, logits: _Optional[_Union[TensorRef, _Mapping]] = ..., hidden: _Optional[_Union[HiddenStates, _Mapping]] = ..., tokens: _Optional[_Union[TensorRef, _Mapping]] = ..., logprobs: _Optional[_Union[TensorRef, _Mapping]] = ..., logprobs_mode: _Optional[_Union[LogprobsMode, str]] = ..., flags: _Optional[str] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_samples: _Optional[int] = ..., wait_timeout_ms: _Optional[int] = ...) -> None: ...

class ColocateStep(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class ColocateRequest(_message.Message):
    __slots__ = ("open", "step")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    open: ColocateOpen
    step: ColocateStep
    def __init__(self, open: _Optional[_Union[ColocateOpen, _Mapping]] = ..., step: _Optional[_Union[ColocateStep, _Mapping]] = ...) -> None: ...

class ColocateResponse(_message.Message):
    __slots__ = ("step", "seeds", "timings", "request_id")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    step: int
    seeds: _containers.RepeatedScalarFieldContainer[int]
    timings: Timings
    request_id: str
    def __init__(self, step: _Optional[int] = ..., seeds: _Optional[_Iterable[int]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...
