from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpeculationInfo(_message.Message):
    __slots__ = ("max_speculative_tokens", "method", "mode")
    MAX_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    max_speculative_tokens: int
    method: str
    mode: str
    def __init__(self, max_speculative_tokens: _Optional[int] = ..., method: _Optional[str] = ..., mode: _Optional[str] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "model_sha", "dtype", "device_type", "block_size", "max_position_embeddings", "vocab_size", "world_size", "eos_token_ids", "speculation", "instance_id", "quantize", "kv_cache_dtype")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_sha: str
    dtype: str
    device_type: str
    block_size: int
    max_position_embeddings: int
    vocab_size: int
    world_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    speculation: SpeculationInfo
    instance_id: str
    quantize: str
    kv_cache_dtype: str
    def __init__(self, model_id: _Optional[str] = ..., model_sha: _Optional[str] = ..., dtype: _Optional[str] = ..., device_type: _Optional[str] = ..., block_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., vocab_size: _Optional[int] = ..., world_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., speculation: _Optional[_Union[SpeculationInfo, _Mapping]] = ..., instance_id: _Optional[str] = ..., quantize: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceDiscoveryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceDiscoveryResponse(_message.Message):
    __slots__ = ("urls",)
    URLS_FIELD_NUMBER: _ClassVar[int]
    urls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, urls: _Optional[_Iterable[str]] = ...) -> None: ...

class NextTokenChooserParameters(_message.Message):
    __slots__ = ("do_sample", "temperature", "top_k", "top_p", "typical_p", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, do_sample: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class StoppingCriteriaParameters(_message.Message):
    __slots__ = ("max_new_tokens", "stop_sequences", "ignore_eos_token")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_sequences: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos_token: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_sequences: _Optional[_Iterable[str]] = ..., ignore_eos_token: _Optional[bool] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("id", "inputs", "input_ids", "truncate", "parameters", "stopping_parameters", "prefill_logprobs", "top_n_tokens", "blocks", "adapter_id", "speculative_tokens", "cached_tokens", "prefill_until", "generated_ids", "grammar")
    ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STOPPING_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_UNTIL_FIELD_NUMBER: _ClassVar[int]
    GENERATED_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    id: int
    inputs: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    truncate: int
    parameters: NextTokenChooserParameters
    stopping_parameters: StoppingCriteriaParameters
    prefill_logprobs: bool
    top_n_tokens: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    adapter_id: str
    speculative_tokens: int
    cached_tokens: int
    prefill_until: int
    generated_ids: _containers.RepeatedScalarFieldContainer[int]
    grammar: str
    def __init__(self, id: _Optional[int] = ..., inputs: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., truncate: _Optional[int] = ..., parameters: _Optional[_Union[NextTokenChooserParameters, _Mapping]] = ..., stopping_parameters: _Optional[_Union[StoppingCriteriaParameters, _Mapping]] = ..., prefill_logprobs: _Optional[bool] = ..., top_n_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., adapter_id: _Optional[str] = ..., speculative_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., prefill_until: _Optional[int] = ..., generated_ids: _Optional[_Iterable[int]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("ids", "logprobs", "texts", "special")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    texts: _containers.RepeatedScalarFieldContainer[str]
    special: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., texts: _Optional[_Iterable[str]] = ..., special: _Optional[_Iterable[bool]] = ...) -> None: ...

class GeneratedText(_message.Message):
    __slots__ = ("text", "generated_tokens", "finish_reason", "seed")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int
    def __init__(self, text: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., seed: _Optional[int] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("request_id", "prefill_tokens", "tokens", "generated_text", "top_tokens", "drafted_tokens", "accepted_tokens", "draft_method", "error", "step_tokens", "step_drafted", "step_accepted")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_METHOD_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    STEP_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    prefill_tokens: Tokens
    tokens: Tokens
    generated_text: GeneratedText
    top_tokens: _containers.RepeatedCompositeFieldContainer[Tokens]
    drafted_tokens: int
    accepted_tokens: int
    draft_method: str
    error: str
    step_tokens: _containers.RepeatedScalarFieldContainer[int]
    step_drafted: _containers.RepeatedScalarFieldContainer[int]
    step_accepted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[int] = ..., prefill_tokens: _Optional[_Union[Tokens, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., generated_text: _Optional[_Union[GeneratedText, _Mapping]] = ..., top_tokens: _Optional[_Iterable[_Union[Tokens, _Mapping]]] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., draft_method: _Optional[str] = ..., error: _Optional[str] = ..., step_tokens: _Optional[_Iterable[int]] = ..., step_drafted: _Optional[_Iterable[int]] = ..., step_accepted: _Optional[_Iterable[int]] = ...) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ("max_input_tokens", "max_prefill_tokens", "max_total_tokens")
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_input_tokens: int
    max_prefill_tokens: int
    max_total_tokens: int
    def __init__(self, max_input_tokens: _Optional[int] = ..., max_prefill_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ...) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("max_supported_total_tokens", "num_blocks")
    MAX_SUPPORTED_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    max_supported_total_tokens: int
    num_blocks: int
    def __init__(self, max_supported_total_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("forward_ns", "decode_ns", "total_ns")
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    forward_ns: int
    decode_ns: int
    total_ns: int
    def __init__(self, forward_ns: _Optional[int] = ..., decode_ns: _Optional[int] = ..., total_ns: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapter_id", "adapter_source", "api_token", "merge")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    API_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MERGE_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    adapter_source: str
    api_token: str
    merge: AdapterMerge
    def __init__(self, adapter_id: _Optional[str] = ..., adapter_source: _Optional[str] = ..., api_token: _Optional[str] = ..., merge: _Optional[_Union[AdapterMerge, _Mapping]] = ...) -> None: ...

class AdapterMerge(_message.Message):
    __slots__ = ("adapter_ids", "weights", "strategy", "density", "majority_sign_method", "seed")
    ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    DENSITY_FIELD_NUMBER: _ClassVar[int]
    MAJORITY_SIGN_METHOD_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    adapter_ids: _containers.RepeatedScalarFieldContainer[str]
    weights: _containers.RepeatedScalarFieldContainer[float]
    strategy: str
    density: float
    majority_sign_method: str
    seed: int
    def __init__(self, adapter_ids: _Optional[_Iterable[str]] = ..., weights: _Optional[_Iterable[float]] = ..., strategy: _Optional[str] = ..., density: _Optional[float] = ..., majority_sign_method: _Optional[str] = ..., seed: _Optional[int] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("loaded", "error", "error_status", "kind", "load_seconds")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_STATUS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    loaded: bool
    error: str
    error_status: int
    kind: str
    load_seconds: float
    def __init__(self, loaded: _Optional[bool] = ..., error: _Optional[str] = ..., error_status: _Optional[int] = ..., kind: _Optional[str] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class OffloadAdapterRequest(_message.Message):
    __slots__ = ("adapter_id",)
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    def __init__(self, adapter_id: _Optional[str] = ...) -> None: ...

class OffloadAdapterResponse(_message.Message):
    __slots__ = ("offloaded",)
    OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    offloaded: bool
    def __init__(self, offloaded: _Optional[bool] = ...) -> None: ...

class RequestUpdate(_message.Message):
    __slots__ = ("id", "new_blocks", "prefill_until")
    ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_UNTIL_FIELD_NUMBER: _ClassVar[int]
    id: int
    new_blocks: _containers.RepeatedScalarFieldContainer[int]
    prefill_until: int
    def __init__(self, id: _Optional[int] = ..., new_blocks: _Optional[_Iterable[int]] = ..., prefill_until: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("sequence", "finished", "updates", "new_requests", "decode_steps")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    finished: _containers.RepeatedScalarFieldContainer[int]
    updates: _containers.RepeatedCompositeFieldContainer[RequestUpdate]
    new_requests: _containers.RepeatedCompositeFieldContainer[Request]
    decode_steps: int
    def __init__(self, sequence: _Optional[int] = ..., finished: _Optional[_Iterable[int]] = ..., updates: _Optional[_Iterable[_Union[RequestUpdate, _Mapping]]] = ..., new_requests: _Optional[_Iterable[_Union[Request, _Mapping]]] = ..., decode_steps: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("generations", "timings", "num_requests", "suffix_cache_tokens", "suffix_cache_nodes", "decode_steps")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_CACHE_NODES_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    timings: Timings
    num_requests: int
    suffix_cache_tokens: int
    suffix_cache_nodes: int
    decode_steps: int
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., num_requests: _Optional[int] = ..., suffix_cache_tokens: _Optional[int] = ..., suffix_cache_nodes: _Optional[int] = ..., decode_steps: _Optional[int] = ...) -> None: ...
