"""The OpenAPI document: what the router accepts and answers, stated exactly enough for a fuzzer to find the edges.

Two layers. The request models (`schemas.py`) state what holds for every deployment: the wire types' bounds
(`wire.py`), `null` for every optional field (the router reads it as absent, `declare_nulls`), and `null` only
for parameters that are not supported (`only_null`). `document` then narrows the numbers to this deployment's
limits (`max_best_of`, the vocabulary, `max_input_tokens`, ...) and fixes what FastAPI gets wrong: integer
bounds it rounds through floats, and a 422 declared as FastAPI's `HTTPValidationError` where the router answers
`ErrorResponse` (`OpenAIErrorResponse` under `/v1/`). Server-sent events are described per event
(`sse_event_schema`), as OpenAPI 3.1 tools expect.
The document is checked with openapi-spec-validator and fuzzed with schemathesis (`router/tests/test_openapi.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from specula_router.wire import FLOAT32_MAX, FLOAT32_MIN_NORMAL, UINT32_MAX

COUNT = {"minimum": 0, "maximum": UINT32_MAX}  # a uint32 on the wire, until `document` narrows it to the limit
POSITIVE_COUNT = {"minimum": 1, "maximum": UINT32_MAX}
POSITIVE_FLOAT32 = {"minimum": FLOAT32_MIN_NORMAL, "maximum": FLOAT32_MAX}  # stays > 0 and finite as a float32

_ANNOTATIONS = ("title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly")
_NULL = {"type": "null"}


def declare_nulls(schema: dict[str, Any]) -> None:
    """Every optional property of an object schema also accepts `null`; constraints move to the non-null branch.

    Example: {"type": "boolean", "default": false} -> {"default": false, "anyOf": [{"type": "boolean"},
    {"type": "null"}]}; {"anyOf": [{"type": "string"}, {"type": "null"}], "enum": ["hub", "local"]} ->
    {"anyOf": [{"type": "string", "enum": ["hub", "local"]}, {"type": "null"}]} (the enum no longer refuses null).
    """
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name not in required:
            schema["properties"][name] = _nullable(prop)


def _nullable(prop: dict[str, Any]) -> dict[str, Any]:
    annotations = {key: prop.pop(key) for key in _ANNOTATIONS if key in prop}
    branches = prop.pop("anyOf", None)
    if branches is None:
        branches = [prop]
    else:
        for branch in branches:
            if branch != _NULL:
                branch.update(prop)  # constraints stated beside `anyOf` are meant for the value, not for null
    if _NULL not in branches:
        branches = [*branches, _NULL]
    return {**annotations, "anyOf": branches}


def only_null(schema: dict[str, Any]) -> None:
    """A parameter the router parses (to refuse it with a clear 422) but does not support: absent or null only."""
    for key in list(schema):
        if key not in _ANNOTATIONS:
            del schema[key]
    schema["type"] = "null"


def stop_schema(schema: dict[str, Any]) -> None:
    """`stop`: a list of non-empty strings, or one string (read as a list of one)."""
    text = {"type": "string", "minLength": 1}
    schema.pop("type", None)
    schema.pop("items", None)
    schema["anyOf"] = [{"type": "array", "items": text}, text]


@dataclass(frozen=True)
class DeploymentLimits:
    """The configured limits the document states (from `ValidationLimits` and the tokenizer)."""

    max_best_of: int
    max_top_n_tokens: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    max_speculative_tokens: int
    max_top_k: int
    max_concurrent_requests: int | None = None  # bounds the OpenAI routes' `n` and number of prompts


def sse_event_schema(*event_models: str, last: str | None = None) -> dict[str, Any]:
    """One server-sent event as OpenAPI 3.1 tools read a `text/event-stream` schema: the event's fields, with
    `data` a JSON text that is one of `event_models` (components), or exactly `last` (OpenAI's `[DONE]`)."""
    content = {"anyOf": [{"$ref": f"#/components/schemas/{name}"} for name in event_models]}
    data: dict[str, Any] = {"contentMediaType": "application/json", "contentSchema": content}
    if last is not None:  # if/else: the JSON check must not run on the one event that is not JSON
        data = {"if": {"const": last}, "else": data}
    return {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", **data},
        "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer", "minimum": 0},
    }}


def document(base: dict[str, Any], limits: DeploymentLimits | None,
             models: Sequence[type[BaseModel]] = ()) -> dict[str, Any]:
    """FastAPI's generated document (`base`, modified in place) made exact; see the module docstring.

    `models` (the request bodies, and what `sse_event_schema` names) are written as pydantic states them:
    FastAPI's own OpenAPI models store `minimum` and `maximum` as floats, which turns the seed's 2**64 - 1 into
    2**64, a value the server refuses.
    """
    schemas = base.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        exact = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(exact.pop("$defs", {}))
        schemas[model.__name__] = exact
    _errors_are_error_responses(base, schemas)
    if limits is not None:
        _narrow(schemas, limits)
    return base


def _errors_are_error_responses(base: dict[str, Any], schemas: dict[str, Any]) -> None:
    for name, path in base.get("paths", {}).items():
        error = "OpenAIErrorResponse" if name.startswith("/v1/") else "ErrorResponse"  # `openai_errors.install`
        for operation in path.values():
            for response in operation.get("responses", {}).values():
                for media in response.get("content", {}).values():
                    if media.get("schema") == {"$ref": "#/components/schemas/HTTPValidationError"}:
                        media["schema"] = {"$ref": f"#/components/schemas/{error}"}
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)


def _narrow(schemas: dict[str, Any], limits: DeploymentLimits) -> None:
    generate = schemas.get("GenerateParameters", {}).get("properties", {})
    _narrow_fields(generate, {
        "best_of": limits.max_best_of, "top_n_tokens": limits.max_top_n_tokens,
        "return_k_alternatives": limits.max_top_n_tokens, "truncate": limits.max_input_tokens,
        "speculative_tokens": limits.max_speculative_tokens, "top_k": limits.max_top_k,
        "max_new_tokens": limits.max_total_tokens - 1,  # the prompt has at least one token
    })
    _stop_items(generate, limits.max_stop_sequences)
    tokenize = schemas.get("TokenizeParameters", {}).get("properties", {})
    if "truncate" in tokenize:
        _value(tokenize["truncate"])["maximum"] = limits.max_input_tokens
    # The OpenAI routes' fields become the same parameters, checked by the same Validator: the same limits.
    for model, top_n in (("ChatCompletionRequest", "top_logprobs"), ("CompletionRequest", "logprobs")):
        fields = schemas.get(model, {}).get("properties", {})
        _narrow_fields(fields, {
            "max_tokens": limits.max_total_tokens - 1, "max_completion_tokens": limits.max_total_tokens - 1,
            top_n: limits.max_top_n_tokens, "speculative_tokens": limits.max_speculative_tokens,
            "top_k": limits.max_top_k, "n": limits.max_concurrent_requests})
        _stop_items(fields, limits.max_stop_sequences)
        if "prompt" in fields and limits.max_concurrent_requests is not None:  # each prompt is a request
            for branch in fields["prompt"]["anyOf"]:
                if branch.get("type") == "array":
                    branch["maxItems"] = limits.max_concurrent_requests


def _narrow_fields(fields: dict[str, Any], maxima: dict[str, int | None]) -> None:
    for name, maximum in maxima.items():
        if name in fields and maximum is not None:
            _value(fields[name])["maximum"] = maximum


def _stop_items(fields: dict[str, Any], max_stop_sequences: int) -> None:
    if "stop" in fields:
        for branch in fields["stop"]["anyOf"]:
            if branch.get("type") == "array":
                branch["maxItems"] = max_stop_sequences


def _value(prop: dict[str, Any]) -> dict[str, Any]:
    """The non-null branch of a nullable property (`declare_nulls`)."""
    return next(branch for branch in prop.get("anyOf", [prop]) if branch != _NULL)
