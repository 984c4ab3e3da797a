"""The HTTP API's answers: the bodies the TGI and LoRAX routes send back (TGI + LoRAX compatible).

The handlers build these pydantic models from the worker's generations (`/generate`, `/generate_stream`, `/`,
`/tokenize`), every error answer is an `ErrorResponse`, and `GET /info` reports the server's settings as `Info`.
Field descriptions and examples feed FastAPI's OpenAPI page (`/docs`); the request bodies are in `schemas.py`.

Responses omit `details`, `top_tokens`, `best_of_sequences` and `alternative_tokens` when absent, as
TGI and LoRAX do; both published clients parse them unchanged (`router/tests/test_schemas.py`).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field


def _is_none(value: Any) -> bool:
    return value is None


def _omitted_if_none(**kwargs: Any) -> Any:
    """A field that defaults to None and is left out of the JSON when None (serde `skip_serializing_if`)."""
    return Field(None, exclude_if=_is_none, **kwargs)


class FinishReason(str, Enum):
    """Why generation stopped."""

    LENGTH = "length"  # generated max_new_tokens
    EOS_TOKEN = "eos_token"  # the model emitted an end-of-sequence token
    STOP_SEQUENCE = "stop_sequence"  # the text contains one of `stop`


class AlternativeToken(BaseModel):
    """One of the most likely tokens at a position (LoRAX `alternative_tokens`)."""

    id: int = Field(..., examples=[0])
    text: str = Field(..., examples=["test"])
    logprob: float | None = Field(..., description="null when not finite (JSON has no NaN nor infinity).",
                                  examples=[-0.34])


class Token(BaseModel):
    """A generated token."""

    id: int = Field(..., examples=[0])
    text: str = Field(..., examples=["test"])
    logprob: float | None = Field(..., description="Log-probability under the (warped) sampling distribution; "
                                  "null when not finite (JSON has no NaN nor infinity).", examples=[-0.34])
    special: bool = Field(..., description="A special token (e.g. EOS): skip it when concatenating text.")
    alternative_tokens: list[AlternativeToken] | None = _omitted_if_none(
        description="The `top_n_tokens` most likely tokens at this position (LoRAX)."
    )
    skipped: bool = Field(False, description="Produced by the same decode step as the previous token "
                                             "(an accepted speculative draft).")


class PrefillToken(BaseModel):
    """A prompt token; the first has no log-probability."""

    id: int = Field(..., examples=[0])
    text: str = Field(..., examples=["test"])
    logprob: float | None = Field(..., examples=[-0.34])


class BestOfSequence(BaseModel):
    """One of the other sequences sampled for `best_of`."""

    generated_text: str = Field(..., examples=["test"])
    finish_reason: FinishReason
    generated_tokens: int = Field(..., examples=[1])
    seed: int | None = Field(None, examples=[42])
    prefill: list[PrefillToken] = Field(default_factory=list)
    tokens: list[Token] = Field(default_factory=list)
    top_tokens: list[list[Token]] | None = _omitted_if_none()


class Details(BaseModel):
    """Generation details, returned when `details` is true."""

    finish_reason: FinishReason
    prompt_tokens: int = Field(..., description="Prompt length in tokens, after truncation.", examples=[5])
    generated_tokens: int = Field(..., examples=[1])
    seed: int | None = Field(None, examples=[42])
    prefill: list[PrefillToken] = Field(default_factory=list, description="Empty unless "
                                        "`decoder_input_details`.")
    tokens: list[Token] = Field(default_factory=list)
    top_tokens: list[list[Token]] | None = _omitted_if_none(description="Per generated token, its "
                                                             "`top_n_tokens` alternatives (TGI).")
    best_of_sequences: list[BestOfSequence] | None = _omitted_if_none()
    skipped_tokens: int = Field(0, description="Tokens marked `skipped`: accepted speculative drafts.")
    cached_tokens: int = Field(0, description="Prompt tokens whose KV was reused from the prefix cache "
                                              "instead of prefilled.", examples=[0])


class GenerateResponse(BaseModel):
    """Answer of `POST /generate` (and each item of `POST /`'s array)."""

    generated_text: str = Field(..., examples=["test"])
    details: Details | None = _omitted_if_none()


class StreamDetails(BaseModel):
    """Details of the last server-sent event."""

    finish_reason: FinishReason
    prompt_tokens: int = Field(..., examples=[5])
    generated_tokens: int = Field(..., examples=[1])
    seed: int | None = Field(None, examples=[42])
    input_length: int = Field(..., description="TGI's name of `prompt_tokens` (the same value).", examples=[5])
    cached_tokens: int = Field(0, description="Prompt tokens reused from the prefix cache.", examples=[0])


class StreamResponse(BaseModel):
    """One server-sent event: a token; the last one also carries the text and details."""

    index: int = Field(..., ge=1, description="The token's position in the generation, from 1 (TGI).",
                       examples=[1])
    token: Token
    top_tokens: list[Token] | None = _omitted_if_none(description="This token's `top_n_tokens` "
                                                      "alternatives (TGI).")
    generated_text: str | None = Field(None, description="Only on the last event.")
    details: StreamDetails | None = Field(None, description="Only on the last event, when `details`.")


class ErrorResponse(BaseModel):
    """Body of every error answer, and of the error event that ends a failed stream."""

    error: str = Field(..., examples=["`temperature` must be strictly positive"])
    error_type: str = Field(..., description="validation, overloaded, generation, incomplete_generation "
                                             "or healthcheck.", examples=["validation"])


class SimpleToken(BaseModel):
    """A prompt token from `POST /tokenize`. `start`/`stop` are UTF-8 byte offsets into `inputs` (TGI)."""

    id: int = Field(..., examples=[0])
    text: str = Field(..., description="`inputs[start:stop]`, or the token itself for special tokens.",
                      examples=["test"])
    start: int = Field(..., examples=[0])
    stop: int = Field(..., examples=[2])
    special: bool = Field(False, description="Added by the tokenizer (e.g. BOS); covers no input text.")


class SpeculationInfo(BaseModel):
    """How the server drafts and verifies tokens (Specula; neither TGI nor LoRAX reports this)."""

    method: str = Field(..., description="none, ngram, medusa, mlp_speculator or draft_model.",
                        examples=["ngram"])
    max_speculative_tokens: int = Field(..., description="Most draft tokens verified per request per step "
                                                         "(0: off).", examples=[4])
    mode: str = Field(..., description="off, fixed, or adaptive (draft length follows load and "
                                       "acceptance).", examples=["adaptive"])
    reserved_lookahead_tokens: int = Field(0, description="KV positions the router gives a request per step "
                                                          "for drafts (the workers' `max_speculative_tokens`).",
                                           examples=[4])
    speculator: str | None = Field(None, description="Speculator served for every request, if any.")


class AdapterInfo(BaseModel):
    """How the server serves adapters (Specula; LoRAX takes these as launcher flags but does not report them)."""

    max_active_adapters: int = Field(..., description="Adapters loaded at once; past it the least recently used "
                                                      "idle one is offloaded (`--max-active-adapters`).",
                                      examples=[8])
    adapter_source: str = Field(..., description="Source of a request's `adapter_id` when it names none "
                                                 "(`--adapter-source`).", examples=["hub"])
    preloaded_adapter_ids: list[str] = Field(default_factory=list, description="Adapters loaded at startup "
                                             "(`--preloaded-adapter-ids`).", examples=[["org/code-lora"]])


class Info(BaseModel):
    """Answer of `GET /info`: TGI's fields plus Specula's speculation, adapter and KV-cache settings."""

    model_config = ConfigDict(protected_namespaces=())

    model_id: str = Field(..., examples=["meta-llama/Llama-3.1-8B-Instruct"])
    model_sha: str | None = Field(None, examples=["e985a63cdc139290c5f700ff1929f0b5942cced2"])
    model_dtype: str = Field(..., examples=["bfloat16"])
    model_device_type: str = Field(..., examples=["cuda"])
    quantize: str | None = Field(None, description="Quantization of the linear layers (`--quantize`): int8 or "
                                 "int4 (weight-only), w8a8 (int8 weights and activations) or gguf (a GGUF file's "
                                 "own blocks); null for float weights.",
                          examples=["int8"])
    kv_cache_dtype: str | None = Field(None, description="What the KV cache stores keys and values in "
                                       "(`--kv-cache-dtype`); null when the workers did not say.",
                                       examples=["float8_e4m3fn"])
    model_pipeline_tag: str | None = Field("text-generation", examples=["text-generation"])
    max_concurrent_requests: int = Field(..., examples=[128])
    max_best_of: int = Field(..., examples=[2])
    max_stop_sequences: int = Field(..., examples=[4])
    max_top_n_tokens: int = Field(..., examples=[5])
    max_input_tokens: int = Field(..., examples=[1024])
    max_total_tokens: int = Field(..., examples=[2048])
    max_position_embeddings: int | None = Field(None, examples=[131072])
    waiting_served_ratio: float = Field(..., examples=[1.2])
    max_batch_total_tokens: int = Field(..., examples=[32000])
    max_batch_prefill_tokens: int | None = Field(None, examples=[4096])
    max_waiting_tokens: int = Field(..., examples=[20])
    max_batch_size: int | None = Field(None, examples=[None])
    validation_workers: int = Field(..., examples=[2])
    num_shard: int = Field(1, description="Tensor-parallel shards.", examples=[1])
    block_size: int = Field(..., description="Tokens per KV cache block.", examples=[16])
    prefix_caching: bool = Field(True, description="Whether prompts reuse cached KV blocks of shared prefixes.")
    speculation: SpeculationInfo
    adapters: AdapterInfo
    version: str = Field(..., examples=["0.1.0"])
    sha: str | None = Field(None, examples=[None])
    docker_label: str | None = Field(None, examples=[None])

    @computed_field(description="Older TGI name of `max_input_tokens`.")  # type: ignore[prop-decorator]
    @property
    def max_input_length(self) -> int:
        return self.max_input_tokens
