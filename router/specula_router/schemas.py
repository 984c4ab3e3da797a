"""The HTTP API's request bodies: what clients send to the TGI and LoRAX routes (TGI + LoRAX compatible).

These pydantic models sit at the HTTP edge only. A `GenerateParameters` is checked and resolved by
`validation.Validator` into a `requests.ValidGenerateRequest`; the handlers answer with the models of
`response_schemas.py`. Field descriptions and examples feed FastAPI's OpenAPI page (`/docs`).

Parsing follows TGI where TGI is lenient and serde where it is strict:
- unknown fields are ignored and `null` means "not given" for every parameter, so the published
  `text-generation` and `lorax-client` bodies (which send every field, mostly as `null`) parse;
- types are strict: `"0.5"` is not a number, `5.0` is not an integer, `"true"` is not a boolean;
- strings must be valid Unicode: a lone surrogate (`"\ud800"`) can be neither tokenised nor sent to a worker.
Value ranges are *not* enforced here but in `Validator`, so every range error carries TGI's wording
and the limit configured at launch (`max_best_of`, `max_top_n_tokens`, ...). The JSON schema states them all
(`wire.py` for what the workers' types can hold; `openapi.py` adds the configured limits and declares `null`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specula_proto.choices import AdapterSource, values
from specula_router.openapi import COUNT, POSITIVE_COUNT, POSITIVE_FLOAT32, declare_nulls, stop_schema
from specula_router.wire import FLOAT32_BELOW_ONE, FLOAT32_MIN_NORMAL, UINT64_MAX

ADAPTER_SOURCES = values(AdapterSource)  # hub, local; LoRAX also has s3 and pbase, refused with a 422 naming these
MAX_ADAPTER_ID_LENGTH = 256
# OpenAI's limits on `logit_bias`: at most 300 tokens, each biased by a value in [-100, 100].
MAX_LOGIT_BIAS_TOKENS = 300
MAX_LOGIT_BIAS = 100.0
# A token id as a JSON object key: a decimal uint32 without sign nor leading zeros, so one id has one spelling.
LOGIT_BIAS_KEY_PATTERN = r"^(0|[1-9][0-9]{0,9})$"
# What `Validator._adapter` accepts: "" or an id without control characters nor surrounding whitespace.
_ADAPTER_ID_PATTERN = r"^$|^[^\s\x00-\x1f\x7f-\x9f]([^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f])?$"


def object_schema(properties: dict[str, Any], required: list[str]) -> Any:
    """A `dict[str, Any] | None` field's schema, with the object's known `properties` and `required` stated."""

    def extra(schema: dict[str, Any]) -> None:
        for option in schema.get("anyOf", [schema]):
            if option.get("type") == "object":
                option.update(properties=properties, required=required)

    return extra


# A JSON schema: an object, or a string holding one (as TGI's and LoRAX's clients may send it).
_SCHEMA_VALUE = {"type": "object", "description": "A JSON schema."}
_SCHEMA_TEXT = {"type": "string", "description": "A JSON schema as text (grammar `regex`: the regex)."}
GRAMMAR_SCHEMA = object_schema({
    "type": {"type": "string", "enum": ["json", "json_object", "regex"]},
    "value": {"anyOf": [_SCHEMA_VALUE, _SCHEMA_TEXT, {"type": "null"}],
              "description": "json: a JSON schema (object or text); json_object: optional schema; regex: a regex."},
}, ["type"])
RESPONSE_FORMAT_SCHEMA = object_schema({
    "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
    "schema": {"anyOf": [_SCHEMA_VALUE, _SCHEMA_TEXT, {"type": "null"}],
               "description": "json_object: the schema the answer follows (absent: any JSON object)."},
    "json_schema": {"anyOf": [{"type": "object", "properties": {
        "name": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "schema": {"anyOf": [_SCHEMA_VALUE, {"type": "null"}]},
        "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}}, {"type": "null"}],
        "description": "json_schema: {name, schema, strict}, as OpenAI's."},
}, ["type"])


class _RequestModel(BaseModel):
    """Base of request bodies: strict types, unknown fields ignored, `null` treated as absent."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        for text in value if isinstance(value, list) else (value,):
            if isinstance(text, str) and not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"must be valid Unicode: lone surrogate {text[e.start]!r} at character "
                                     f"{e.start}") from None
        return value

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        json_schema = handler(core_schema)
        declare_nulls(handler.resolve_ref_schema(json_schema))  # `_drop_nulls`: every optional field takes null
        return json_schema


class MergedAdapters(_RequestModel):
    """LoRAX adapter merging: these LoRA adapters merged into one for the request, as PEFT's
    `add_weighted_adapter` merges them (see docs/adapters.md, Merged adapters)."""

    ids: list[str] = Field(default_factory=list, description="Adapters to merge (1 to 16), read from "
                           "`adapter_source`.", examples=[["a/b", "c/d"]], json_schema_extra={"maxItems": 16})
    weights: list[float] = Field(default_factory=list, description="One weight per adapter (may be negative).",
                                 examples=[[0.5, 0.5]])
    merge_strategy: str | None = Field(None, description="linear (default), ties, dare_linear or dare_ties.",
                                       json_schema_extra={"enum": ["linear", "ties", "dare_linear", "dare_ties"]})
    density: float = Field(0.0, description="Fraction of each tensor's entries kept by ties and dare merges, in "
                           "(0, 1]; ignored by linear.", json_schema_extra={"minimum": 0.0, "maximum": 1.0})
    majority_sign_method: str | None = Field(None, description="total (default) or frequency: how ties and "
                                             "dare_ties elect each entry's sign.",
                                             json_schema_extra={"enum": ["total", "frequency"]})
    seed: int | None = Field(None, description="Seeds DARE's random drops (a Specula extension). Absent: derived "
                             "from the rest of the merge, so the same merge always gives the same weights.",
                             json_schema_extra={"minimum": 0, "maximum": UINT64_MAX})


class GenerateParameters(_RequestModel):
    """Generation parameters: the union of TGI's and LoRAX's, plus Specula's `speculative_tokens`."""

    adapter_id: str | None = Field(
        None, description="Adapter to apply (LoRAX): a Hub repository id, or a directory under the server's "
        "`--adapter-dir` for source `local`; at most 256 characters. Absent or empty: the base model. The first "
        "request for an adapter loads it; its requests wait for the load while others keep running.",
        json_schema_extra={"maxLength": MAX_ADAPTER_ID_LENGTH, "pattern": _ADAPTER_ID_PATTERN},
        examples=["predibase/conllpp"],
    )
    adapter_source: str | None = Field(
        None, description="Where `adapter_id` lives. Default: the server's `--adapter-source`.",
        json_schema_extra={"enum": list(ADAPTER_SOURCES)}, examples=["hub"],
    )
    merged_adapters: MergedAdapters | None = Field(
        None, description="LoRAX adapter merging: several LoRA adapters merged into one for this request (linear, "
        "ties, dare_linear, dare_ties). Not with `adapter_id`. A merge is loaded and cached as an adapter of its own.")
    api_token: str | None = Field(
        None, description="Hub token used to download a private adapter (default: the server's HF_TOKEN). "
        "Never logged nor echoed.")
    best_of: int | None = Field(
        None, description="Sample this many sequences and return the one with the highest log-probability. "
        "> 1 needs sampling, no `seed`, and no streaming; at most `max_best_of`.",
        json_schema_extra=POSITIVE_COUNT, examples=[1],
    )
    decoder_input_details: bool = Field(
        False, description="Return the prompt tokens with their log-probabilities in `details.prefill`."
    )
    details: bool = Field(
        False, description="Return generation details (tokens, log-probabilities, finish reason). "
        "The published clients always send true.",
    )
    do_sample: bool = Field(
        False, description="Sample instead of greedy decoding. Setting any of temperature != 1, top_k, "
        "top_p < 1 or typical_p also samples.",
    )
    frequency_penalty: float | None = Field(
        None, description="Subtracted from a token's logit once per occurrence so far, in [-2, 2].",
        json_schema_extra={"minimum": -2.0, "maximum": 2.0}, examples=[0.1],
    )
    presence_penalty: float | None = Field(
        None, description="Subtracted from a token's logit once if it occurred so far, in [-2, 2].",
        json_schema_extra={"minimum": -2.0, "maximum": 2.0}, examples=[0.1],
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="OpenAI's logit bias (a Specula extension here): token id (a decimal string, below the "
        "vocabulary size) -> a value in [-100, 100] added to that token's logit before penalties, warpers and the "
        "greedy choice; -100 all but bans a token, 100 all but forces it. At most 300 tokens. Log-probabilities "
        "are reported under the biased distribution.",
        json_schema_extra={"maxProperties": MAX_LOGIT_BIAS_TOKENS,
                           "propertyNames": {"pattern": LOGIT_BIAS_KEY_PATTERN},
                           "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                    "maximum": MAX_LOGIT_BIAS}},
        examples=[{"1734": -100, "29871": 5.5}],
    )
    ignore_eos_token: bool = Field(False, description="Keep generating past end-of-sequence tokens.")
    max_new_tokens: int | None = Field(
        None, description="Most tokens to generate. Default: as many as `max_total_tokens` (and the "
        "model's position limit) leave after the prompt; prompt + `max_new_tokens` <= `max_total_tokens`.",
        json_schema_extra=POSITIVE_COUNT, examples=[20],
    )
    repetition_penalty: float | None = Field(
        None, description="Repetition penalty, > 0 (a normal float32); 1.0 means none.",
        json_schema_extra=POSITIVE_FLOAT32, examples=[1.03],
    )
    return_full_text: bool | None = Field(None, description="Prepend the prompt to `generated_text`.")
    seed: int | None = Field(
        None, description="Random seed (unsigned 64-bit). Chosen by the server when absent.",
        json_schema_extra={"minimum": 0, "maximum": UINT64_MAX}, examples=[42],
    )
    stop: list[str] = Field(
        default_factory=list, description="Stop when the generated text contains one of these "
        "(at most `max_stop_sequences`, none empty). A single string is read as a list of one.",
        json_schema_extra=stop_schema, examples=[["photographer"]],
    )
    temperature: float | None = Field(
        None, description="Softmax temperature, > 0 (a normal float32).", json_schema_extra=POSITIVE_FLOAT32,
        examples=[0.5],
    )
    top_k: int | None = Field(
        None, description="Sample among the k most likely tokens; at most the vocabulary size.",
        json_schema_extra=POSITIVE_COUNT, examples=[10],
    )
    top_p: float | None = Field(
        None, description="Nucleus sampling mass in (0, 1]; 1.0 means off.",
        json_schema_extra={"minimum": FLOAT32_MIN_NORMAL, "maximum": 1}, examples=[0.95],
    )
    truncate: int | None = Field(
        None, description="Keep only the last `truncate` prompt tokens (at most `max_input_tokens`).",
        json_schema_extra=POSITIVE_COUNT,
    )
    typical_p: float | None = Field(
        None, description="Typical sampling mass in (0, 1), as a float32 (so at most 1 - 2**-24).",
        json_schema_extra={"minimum": FLOAT32_MIN_NORMAL, "maximum": FLOAT32_BELOW_ONE}, examples=[0.95],
    )
    watermark: bool = Field(False, description="Watermarking (Kirchenbauer et al.); not supported: false only.",
                            json_schema_extra={"const": False})
    top_n_tokens: int | None = Field(
        None, description="Return this many most likely alternatives per generated token (TGI name; "
        "alias of `return_k_alternatives`), at most `max_top_n_tokens`.", json_schema_extra=COUNT,
        examples=[5],
    )
    return_k_alternatives: int | None = Field(
        None, description="LoRAX name of `top_n_tokens`; given both, they must agree.",
        json_schema_extra=COUNT,
    )
    response_format: dict[str, Any] | None = Field(
        None, description="LoRAX structured output: `{type: json_object, schema}` (no schema: any JSON object), "
        "OpenAI's `{type: json_schema, json_schema: {name, schema}}`, or `{type: text}` (none). Not with `grammar`. "
        "See docs/api.md, Structured output.", json_schema_extra=RESPONSE_FORMAT_SCHEMA,
        examples=[{"type": "json_object", "schema": {"type": "object", "properties": {"answer": {"type": "string"}},
                                                     "required": ["answer"]}}],
    )
    grammar: dict[str, Any] | None = Field(
        None, description="TGI structured output: `{type: json, value: <JSON schema>}`, `{type: json_object}` "
        "(any JSON object) or `{type: regex, value: <regex>}`; the answer is compact JSON, or matches the regex. "
        "At most `--max-grammar-bytes`. See docs/api.md, Structured output.", json_schema_extra=GRAMMAR_SCHEMA,
        examples=[{"type": "regex", "value": "[0-9]{3}-[0-9]{4}"}],
    )
    speculative_tokens: int | None = Field(
        None, description="Specula: cap this request's draft length per step, in [0, the server's "
        "`max_speculative_tokens`]; 0 turns speculation off for it.", json_schema_extra=COUNT,
        examples=[3],
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class GenerateRequest(_RequestModel):
    """Body of `POST /generate` and `POST /generate_stream`."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"inputs": "My name is Olivier and I", "parameters": {"max_new_tokens": 20}}]}
    )

    inputs: str = Field(..., description="The prompt, at most `max_input_tokens` tokens (after `truncate`).",
                        json_schema_extra={"minLength": 1}, examples=["My name is Olivier and I"])
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


class CompatGenerateRequest(GenerateRequest):
    """Body of `POST /`, where the published clients post: a JSON array answer, or SSE when `stream`."""

    stream: bool = Field(False, description="Stream tokens as server-sent events.")


class TokenizeParameters(_RequestModel):
    """`parameters` of `POST /tokenize`: TGI sends the generate parameters; only `truncate` applies."""

    truncate: int | None = Field(
        None, description="Keep only the last `truncate` tokens (at most `max_input_tokens`).",
        json_schema_extra=POSITIVE_COUNT,
    )


class TokenizeRequest(_RequestModel):
    """Body of `POST /tokenize`: the limits of `/generate` apply (at most `max_input_tokens` after `truncate`)."""

    inputs: str = Field(..., description="Text to tokenize.", examples=["My name is Olivier and I"])
    parameters: TokenizeParameters = Field(default_factory=TokenizeParameters,
                                           description="Only `truncate` is read; other fields are ignored.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS).")
