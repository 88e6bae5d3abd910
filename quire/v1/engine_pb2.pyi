from quire.v1 import kv_cache_pb2 as _kv_cache_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingOptions(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "prompt_logprobs", "skip_special_tokens", "structured_outputs", "logit_bias", "allowed_token_ids", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    logprobs: int
    prompt_logprobs: int
    skip_special_tokens: bool
    structured_outputs: StructuredOutputs
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
    class Choices(_message.Message):
        __slots__ = ("choices",)
        CHOICES_FIELD_NUMBER: _ClassVar[int]
        choices: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json: str
    regex: str
    choice: StructuredOutputs.Choices
    grammar: str
    json_object: bool
    structural_tag: str
    def __init__(self, json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StructuredOutputs.Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "cache_salt", "priority", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingOptions
    cache_salt: str
    priority: int
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., lora_name: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "chosen_rank")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_RANK_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    chosen_rank: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., chosen_rank: _Optional[int] = ...) -> None: ...

class CompletionDelta(_message.Message):
    __slots__ = ("index", "token_ids", "text", "logprobs", "finish_reason", "stop_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    finish_reason: FinishReason
    stop_reason: str
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "outputs", "prompt_logprobs", "prompt_token_ids", "usage", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    outputs: _containers.RepeatedCompositeFieldContainer[CompletionDelta]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    usage: Usage
    finished: bool
    def __init__(self, request_id: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[CompletionDelta, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., finished: _Optional[bool] = ...) -> None: ...

class GenerateManyRequest(_message.Message):
    __slots__ = ("open", "cancel")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    open: OpenGenerate
    cancel: int
    def __init__(self, open: _Optional[_Union[OpenGenerate, _Mapping]] = ..., cancel: _Optional[int] = ...) -> None: ...

class OpenGenerate(_message.Message):
    __slots__ = ("stream_id", "request", "metadata", "timeout_s")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    request: GenerateRequest
    metadata: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    timeout_s: float
    def __init__(self, stream_id: _Optional[int] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., metadata: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class MetadataEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class GenerateManyResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[GenerateManyEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[GenerateManyEntry, _Mapping]]] = ...) -> None: ...

class GenerateManyEntry(_message.Message):
    __slots__ = ("stream_id", "response", "status")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    response: GenerateResponse
    status: CallStatus
    def __init__(self, stream_id: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., status: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("code", "details", "trailing_metadata")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    trailing_metadata: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., trailing_metadata: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "cache_salt", "priority", "normalize", "truncate_prompt_tokens", "truncation_side")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    cache_salt: str
    priority: int
    normalize: bool
    truncate_prompt_tokens: int
    truncation_side: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., normalize: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., truncation_side: _Optional[str] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("request_id", "embedding", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    embedding: _containers.RepeatedScalarFieldContainer[float]
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., embedding: _Optional[_Iterable[float]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "max_model_len", "block_size", "block_hash_algorithm", "block_hash_seed", "tokenizer_digest", "vocab_size", "enable_prefix_caching", "num_kv_blocks", "backend", "backend_reason", "backend_fallback", "cuda_graphs", "quantization", "incarnation_id", "speculative_config", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "runner", "pooling_type", "pooling_normalize", "hidden_size", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_adapters", "lora_adapter_paths", "tensor_parallel_size", "pipeline_parallel_size", "all_reduce_backend", "distributed_executor_backend", "layer_execution", "generate_many")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_REASON_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    POOLING_NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_LORA_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_PATHS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALL_REDUCE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTED_EXECUTOR_BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAYER_EXECUTION_FIELD_NUMBER: _ClassVar[int]
    GENERATE_MANY_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    block_size: int
    block_hash_algorithm: str
    block_hash_seed: int
    tokenizer_digest: str
    vocab_size: int
    enable_prefix_caching: bool
    num_kv_blocks: int
    backend: str
    backend_reason: str
    backend_fallback: bool
    cuda_graphs: str
    quantization: str
    incarnation_id: str
    speculative_config: str
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    runner: str
    pooling_type: str
    pooling_normalize: bool
    hidden_size: int
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    lora_adapter_paths: _containers.RepeatedScalarFieldContainer[str]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    all_reduce_backend: str
    distributed_executor_backend: str
    layer_execution: str
    generate_many: bool
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., block_hash_algorithm: _Optional[str] = ..., block_hash_seed: _Optional[int] = ..., tokenizer_digest: _Optional[str] = ..., vocab_size: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ..., num_kv_blocks: _Optional[int] = ..., backend: _Optional[str] = ..., backend_reason: _Optional[str] = ..., backend_fallback: _Optional[bool] = ..., cuda_graphs: _Optional[str] = ..., quantization: _Optional[str] = ..., incarnation_id: _Optional[str] = ..., speculative_config: _Optional[str] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., runner: _Optional[str] = ..., pooling_type: _Optional[str] = ..., pooling_normalize: _Optional[bool] = ..., hidden_size: _Optional[int] = ..., enable_lora: _Optional[bool] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., lora_adapter_paths: _Optional[_Iterable[str]] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., all_reduce_backend: _Optional[str] = ..., distributed_executor_backend: _Optional[str] = ..., layer_execution: _Optional[str] = ..., generate_many: _Optional[bool] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadLoRAAdapterResponse(_message.Message):
    __slots__ = ("loaded",)
    LOADED_FIELD_NUMBER: _ClassVar[int]
    loaded: bool
    def __init__(self, loaded: _Optional[bool] = ...) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files", "digest")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    digest: str
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ..., digest: _Optional[str] = ...) -> None: ...

class StreamLoadRequest(_message.Message):
    __slots__ = ("interval_ms", "admits_requests")
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    ADMITS_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    admits_requests: bool
    def __init__(self, interval_ms: _Optional[int] = ..., admits_requests: _Optional[bool] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_queued_tokens", "kv_cache_usage", "timestamp_s", "batch_full", "num_load_readers", "running_lora_adapters", "waiting_lora_adapters", "loaded_lora_adapters", "max_loras", "num_lora_adapter_loads", "lora_adapter_load_s")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_FULL_FIELD_NUMBER: _ClassVar[int]
    NUM_LOAD_READERS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    WAITING_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LOADED_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    NUM_LORA_ADAPTER_LOADS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_LOAD_S_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_queued_tokens: int
    kv_cache_usage: float
    timestamp_s: float
    batch_full: bool
    num_load_readers: int
    running_lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    waiting_lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    loaded_lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    num_lora_adapter_loads: int
    lora_adapter_load_s: float
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_queued_tokens: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., timestamp_s: _Optional[float] = ..., batch_full: _Optional[bool] = ..., num_load_readers: _Optional[int] = ..., running_lora_adapters: _Optional[_Iterable[str]] = ..., waiting_lora_adapters: _Optional[_Iterable[str]] = ..., loaded_lora_adapters: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ..., num_lora_adapter_loads: _Optional[int] = ..., lora_adapter_load_s: _Optional[float] = ...) -> None: ...

class StreamKVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEventsMessage(_message.Message):
    __slots__ = ("snapshot", "batch")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    snapshot: _kv_cache_pb2.KVCacheSnapshot
    batch: _kv_cache_pb2.KVEventBatch
    def __init__(self, snapshot: _Optional[_Union[_kv_cache_pb2.KVCacheSnapshot, _Mapping]] = ..., batch: _Optional[_Union[_kv_cache_pb2.KVEventBatch, _Mapping]] = ...) -> None: ...
