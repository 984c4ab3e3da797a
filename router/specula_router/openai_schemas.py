"""The OpenAI-compatible API's JSON bodies: what `/v1/chat/completions` and `/v1/completions` accept.

Request models only: they sit at the HTTP edge, and `openai_api.py` turns each into the router's one
`GenerateParameters` (so every range is checked by `validation.Validator`, with the limits of `/generate`).
Parsing is that of the TGI routes (`schemas._RequestModel`): strict types, unknown fields ignored, `null` read as
absent, so the bodies of the official `openai` client, huggingface_hub's `InferenceClient.chat_completion` and
text-generation's `Client.chat` (which sends every field, mostly `null`) all parse.

Specula's extras, sent by the official client as `extra_body`: `adapter_id`, `adapter_source`, `api_token`,
`merged_adapters` (LoRAX's adapter fields) and `speculative_tokens`, `top_k`, `repetition_penalty`,
`ignore_eos_token` (as in `parameters` of `/generate`). Responses are built as plain dicts in `openai_responses.py`,
in OpenAI's exact shape; the response models at the end only describe them in the OpenAPI document.

The JSON schema states what each route accepts, field by field: the bounds of a field `/generate` also has are
read from `GenerateParameters` (`_as_generate`), and `openapi.document` narrows the configured ones (`n`,
`max_tokens`, `top_logprobs`, ...) to this deployment's limits. Rules between fields (prompt tokens plus
`max_tokens` within `max_total_tokens`, `n` times the prompts within `--max-concurrent-requests`) are 422s.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specula_router.openapi import COUNT, POSITIVE_COUNT, POSITIVE_FLOAT32, only_null, stop_schema
from specula_router.schemas import GenerateParameters, MergedAdapters, _RequestModel, object_schema

# Roles a chat message may have. `developer` is OpenAI's newer name for `system`; templates get `system`.
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")


def _as_generate(name: str) -> Any:
    """The JSON schema bounds of `/generate`'s parameter `name`: the same field, checked by the same Validator."""
    return GenerateParameters.model_fields[name].json_schema_extra


def _response_format() -> Any:
    """`response_format` of both routes (a new Field each: pydantic fields are not shared between models)."""
    return Field(
        None, description="text (no constraint), json_object (any JSON object) or json_schema (`json_schema: "
        "{name, schema, strict}`, `name` required): the answer is compact JSON following the schema. See "
        "docs/api.md, Structured output.", examples=[{"type": "json_object"}],
        json_schema_extra=object_schema({
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"anyOf": [{"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "minLength": 1}, "schema": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}}, {"type": "null"}]},
        }, ["type"]))


def _temperature_schema(schema: dict[str, Any]) -> None:
    """`temperature`: 0 (greedy, never sent to the workers), or a temperature `/generate` accepts."""
    schema["anyOf"] = [{"type": "number", "const": 0},
                       {"type": "number", **POSITIVE_FLOAT32}, {"type": "null"}]


def _prompt_schema(schema: dict[str, Any]) -> None:
    """`prompt`: a non-empty string, or a non-empty list of them (`openapi.document` bounds the list's length)."""
    text = {"type": "string", "minLength": 1}
    schema["anyOf"] = [text, {"type": "array", "items": text, "minItems": 1}]


def _text_part_schema(schema: dict[str, Any]) -> None:
    """`ContentPart`: `text` is required and a string (a part without text is refused like an image part)."""
    schema["required"] = ["type", "text"]
    schema["properties"]["text"] = {"type": "string", "examples": ["Hello"]}


class ContentPart(_RequestModel):
    """One part of a message's list-of-parts content; only `text` parts are supported (no image or audio)."""

    # Parsed loosely so that another part's type is a 400 naming it (`unsupported`), not a parse error; the
    # schema states what is served: a text part with its text.
    model_config = ConfigDict(json_schema_extra=_text_part_schema)

    type: str = Field(..., examples=["text"], json_schema_extra={"const": "text"})
    text: str | None = Field(None, examples=["Hello"])


class FunctionCall(_RequestModel):
    name: str = Field(..., examples=["get_weather"])
    arguments: str = Field("{}", description="The arguments as a JSON string (OpenAI's form).",
                           examples=['{"city": "Paris"}'])


class ToolCall(_RequestModel):
    """A tool call an earlier assistant message made, sent back with the conversation."""

    id: str = Field("", examples=["call_abc123"])
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_RequestModel):
    role: str = Field(..., description=f"OpenAI's roles are {', '.join(ROLES)}; others reach the chat template "
                      "as they are (it may know them, or refuse them).", examples=["user"])
    content: str | list[ContentPart] | None = Field(
        None, description="A string, or a list of `{type: text, text}` parts (joined with newlines).",
        examples=["What is speculative decoding?"])
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="The calls an assistant message made.")
    tool_call_id: str | None = Field(None, description="For a `tool` message: the call it answers.")


class FunctionDefinition(_RequestModel):
    name: str = Field(..., examples=["get_weather"])
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="The arguments' JSON schema.")
    strict: bool | None = None


class Tool(_RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(_RequestModel):
    class Function(_RequestModel):
        name: str

    type: Literal["function"] = "function"
    function: Function


class StreamOptions(_RequestModel):
    include_usage: bool = Field(False, description="Send a last chunk with `usage` and no choices.")


class SamplingFields(_RequestModel):
    """What both routes share: the model, sampling, stopping and Specula's extras."""

    model: str = Field("", description="The base model's id (also `tgi` or empty) or an adapter's id (see "
                                       "`GET /v1/models`).", examples=["tgi"])
    frequency_penalty: float | None = Field(None, json_schema_extra=_as_generate("frequency_penalty"))
    presence_penalty: float | None = Field(None, json_schema_extra=_as_generate("presence_penalty"))
    logit_bias: dict[str, float] | None = Field(None, description="Token id -> a bias in [-100, 100] added to its "
                                                "logit, as `/generate`'s; at most 300 ids below the vocabulary size.",
                                                json_schema_extra=_as_generate("logit_bias"))
    max_tokens: int | None = Field(None, description="Most tokens to generate.", json_schema_extra=POSITIVE_COUNT,
                                   examples=[32])
    n: int = Field(1, description="Choices to generate for each prompt; `n` times the number of prompts is at "
                   "most `--max-concurrent-requests`.", json_schema_extra=POSITIVE_COUNT)
    seed: int | None = Field(None, description="Choice i samples with seed + i.",
                             json_schema_extra=_as_generate("seed"))
    stop: list[str] = Field(default_factory=list, description="Up to `max_stop_sequences` strings; the text stops "
                            "before the first one and does not contain it.", json_schema_extra=stop_schema)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, description="0 is greedy; absent is 1 (sampling), as in OpenAI.",
                                      json_schema_extra=_temperature_schema)
    top_p: float | None = Field(None, description="As `/generate`'s; checked even when `temperature` is 0.",
                                json_schema_extra=_as_generate("top_p"))
    user: str | None = Field(None, description="Accepted and ignored.")
    # Specula and LoRAX extras (`extra_body` in the official client).
    adapter_id: str | None = Field(None, description="An adapter, as `parameters.adapter_id` of `/generate`.",
                                   json_schema_extra=_as_generate("adapter_id"))
    adapter_source: str | None = Field(None, description="hub or local.",
                                       json_schema_extra=_as_generate("adapter_source"))
    api_token: str | None = Field(None, description="Hub token for a private adapter; never echoed.")
    merged_adapters: MergedAdapters | None = Field(None, description="LoRA adapters merged into one for this "
                                                   "request, as `parameters.merged_adapters` of `/generate`; "
                                                   "`model` then names the base model.")
    speculative_tokens: int | None = Field(None, description="Per-request cap on speculation.",
                                           json_schema_extra=_as_generate("speculative_tokens"))
    top_k: int | None = Field(None, description="As `/generate`'s; checked even when `temperature` is 0.",
                              json_schema_extra=_as_generate("top_k"))
    repetition_penalty: float | None = Field(None, json_schema_extra=_as_generate("repetition_penalty"))
    ignore_eos_token: bool | None = Field(None, description="Keep generating past end-of-sequence (TGI's name).")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class ChatCompletionRequest(SamplingFields):
    """Body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(..., json_schema_extra={"minItems": 1})
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name of `max_tokens`; wins "
                                                                "when both are given.",
                                              json_schema_extra=POSITIVE_COUNT)
    logprobs: bool = Field(False, description="Return each generated token's log-probability.")
    top_logprobs: int | None = Field(None, description="With `logprobs`: this many alternatives per token, at "
                                                       "most `max_top_n_tokens` (checked without `logprobs` too).",
                                     json_schema_extra=COUNT)
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = Field(
        None, description="none, auto, required, or {type: function, function: {name}}. Default: auto with "
                          "tools. required and a named function constrain the answer to a call in the chat "
                          "template's format (see docs/api.md, Structured output).")
    parallel_tool_calls: bool | None = Field(None, description="false: `tool_choice` required allows one call "
                                                               "only; otherwise several calls are allowed and parsed.")
    response_format: dict[str, Any] | None = _response_format()


class CompletionRequest(SamplingFields):
    """Body of `POST /v1/completions` (OpenAI's legacy completions)."""

    prompt: str | list[str] = Field(..., description="A prompt, or a list of prompts (n choices each).",
                                    json_schema_extra=_prompt_schema)
    max_tokens: int | None = Field(16, description="Most tokens to generate (OpenAI's default: 16).",
                                   json_schema_extra=POSITIVE_COUNT)
    echo: bool = Field(False, description="Prepend the prompt to each choice's text.")
    logprobs: int | None = Field(None, description="Return this many alternatives per token (0: only the "
                                                   "chosen token's log-probability), at most `max_top_n_tokens`.",
                                 json_schema_extra=COUNT)
    suffix: str | None = Field(None, description="Not supported: only absent or null (else a 400).",
                               json_schema_extra=only_null)
    best_of: int | None = Field(None, description="Only 1 (or absent) for now (else a 400).",
                                json_schema_extra={"minimum": 1, "maximum": 1})
    response_format: dict[str, Any] | None = _response_format()


# -- what the routes answer, for the OpenAPI document only ---------------------------------------------------


class OpenAIErrorDetail(BaseModel):
    message: str = Field(..., examples=["`temperature` must be strictly positive"])
    type: str = Field(..., description="invalid_request_error, server_error, or requests (429).",
                      examples=["invalid_request_error"])
    param: str | None = Field(..., description="The offending field, when there is one.", examples=["temperature"])
    code: str | None = Field(..., description="model_not_found, rate_limit_exceeded, or the TGI routes' "
                                              "error_type (validation, unsupported, chat_template, ...).",
                             examples=["validation"])


class OpenAIErrorResponse(BaseModel):
    """Body of every error answered under `/v1/`, and of the error event that ends a failed stream."""

    error: OpenAIErrorDetail


class OpenAICompletion(BaseModel):
    """Answer of `/v1/chat/completions` (`chat.completion`) and `/v1/completions` (`text_completion`)."""

    id: str = Field(..., examples=["chatcmpl-0123456789abcdef"])
    object: str = Field(..., examples=["chat.completion"])
    created: int
    model: str = Field(..., examples=["tgi"])
    system_fingerprint: str
    choices: list[dict[str, Any]] = Field(..., description="OpenAI's choices: `message` (chat) or `text`, "
                                          "`index`, `logprobs`, `finish_reason`.")
    usage: dict[str, int] = Field(..., description="prompt_tokens, completion_tokens, total_tokens.")


class OpenAIChunk(BaseModel):
    """One streamed chunk (`chat.completion.chunk` or `text_completion`); with `stream_options.include_usage`,
    every chunk has `usage` null and a last one no choices and the `usage`."""

    id: str
    object: str = Field(..., examples=["chat.completion.chunk"])
    created: int
    model: str
    system_fingerprint: str
    choices: list[dict[str, Any]]
    usage: dict[str, int] | None = Field(None, description="Present with `stream_options.include_usage`.")
