"""The OpenAI-compatible API's JSON bodies: what `/v1/chat/completions` and `/v1/completions` accept.

Request models only: they sit at the HTTP edge, and `openai_api.py` turns each into the router's one
`GenerateParameters` (so every range is checked by `validation.Validator`, with the limits of `/generate`).
Parsing is that of the TGI routes (`schemas._RequestModel`): strict types, unknown fields ignored, `null` read as
absent, so the bodies of the official `openai` client, huggingface_hub's `InferenceClient.chat_completion` and
text-generation's `Client.chat` (which sends every field, mostly `null`) all parse.

Specula's extras, sent by the official client as `extra_body`: `adapter_id`, `adapter_source`, `api_token`
(LoRAX's adapter fields) and `speculative_tokens`, `top_k`, `repetition_penalty`, `ignore_eos_token` (as in
`parameters` of `/generate`). Responses are built as plain dicts in `openai_responses.py`, in OpenAI's exact shape.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from specula_router.openapi import stop_schema
from specula_router.schemas import _RequestModel

# Roles a chat message may have. `developer` is OpenAI's newer name for `system`; templates get `system`.
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")


class ContentPart(_RequestModel):
    """One part of a message's list-of-parts content; only `text` parts are supported (no image or audio)."""

    type: str = Field(..., examples=["text"])
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
    frequency_penalty: float | None = Field(None, json_schema_extra={"minimum": -2.0, "maximum": 2.0})
    presence_penalty: float | None = Field(None, json_schema_extra={"minimum": -2.0, "maximum": 2.0})
    logit_bias: dict[str, float] | None = Field(None, description="Not supported yet: only empty or absent.")
    max_tokens: int | None = Field(None, description="Most tokens to generate.", examples=[32])
    n: int = Field(1, description="Choices to generate for each prompt.", json_schema_extra={"minimum": 1})
    seed: int | None = Field(None, description="Choice i samples with seed + i.")
    stop: list[str] = Field(default_factory=list, description="Up to `max_stop_sequences` strings; the text stops "
                            "before the first one and does not contain it.", json_schema_extra=stop_schema)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, description="0 is greedy; absent is 1 (sampling), as in OpenAI.")
    top_p: float | None = None
    user: str | None = Field(None, description="Accepted and ignored.")
    # Specula and LoRAX extras (`extra_body` in the official client).
    adapter_id: str | None = Field(None, description="An adapter, as `parameters.adapter_id` of `/generate`.")
    adapter_source: str | None = Field(None, description="hub or local.")
    api_token: str | None = Field(None, description="Hub token for a private adapter; never echoed.")
    speculative_tokens: int | None = Field(None, description="Per-request cap on speculation.")
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos_token: bool | None = Field(None, description="Keep generating past end-of-sequence (TGI's name).")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class ChatCompletionRequest(SamplingFields):
    """Body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(..., json_schema_extra={"minItems": 1})
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name of `max_tokens`; wins "
                                                                "when both are given.")
    logprobs: bool = Field(False, description="Return each generated token's log-probability.")
    top_logprobs: int | None = Field(None, description="With `logprobs`: this many alternatives per token, at "
                                                       "most `max_top_n_tokens`.")
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = Field(
        None, description="none, auto, required, or {type: function, function: {name}}. Default: auto with "
                          "tools. required and a named function are not enforced yet (see docs/api.md).")
    parallel_tool_calls: bool | None = Field(None, description="Accepted; several calls are parsed when the "
                                                               "model writes several.")
    response_format: dict[str, Any] | None = Field(
        None, description="Only {type: text} for now; JSON modes await structured output.")


class CompletionRequest(SamplingFields):
    """Body of `POST /v1/completions` (OpenAI's legacy completions)."""

    prompt: str | list[str] = Field(..., description="A prompt, or a list of prompts (n choices each).")
    max_tokens: int | None = Field(16, description="Most tokens to generate (OpenAI's default: 16).")
    echo: bool = Field(False, description="Prepend the prompt to each choice's text.")
    logprobs: int | None = Field(None, description="Return this many alternatives per token (0: only the "
                                                   "chosen token's log-probability).")
    suffix: str | None = Field(None, description="Not supported (refused with 400).")
    best_of: int | None = Field(None, description="Only 1 (or absent) for now.")
