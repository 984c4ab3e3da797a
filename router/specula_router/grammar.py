"""Structured output, router side: a request's grammar, JSON schema, regex or forced tool call turned into ONE
llguidance grammar string, checked against the model's tokenizer before the request is queued.

The workers compile that string (`Request.grammar`) with `llguidance.LLMatcher` and mask every position they
sample, so the router's part is to accept the request fields of TGI, LoRAX and OpenAI, build the grammar, and
refuse (422 on the TGI routes, 400 on `/v1/*`) any grammar that llguidance would not compile, never a crash:

    TGI      parameters.grammar          {"type": "json", "value": <schema, or a string holding one>}
                                         {"type": "json_object", "value": <schema or absent: any object>}
                                         {"type": "regex", "value": "<regex>"}
    LoRAX    parameters.response_format  {"type": "json_object", "schema": <schema or absent: any object>}
                                         {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                         {"type": "text"}  (no constraint)
    OpenAI   response_format             text (none), json_object (any object), json_schema (`name` required)
             tools + tool_choice         "required" or {"type": "function", "function": {"name": f}}: a call in
                                         the chat template's own tool-call format

JSON schemas compile with `whitespace_flexible: False`: the output is compact JSON (`{"a":1}`), with no free
whitespace, so keys, quotes, colons and commas are forced tokens, which the workers draft for free when
speculating, and the model cannot pad the answer with blank lines up to `max_new_tokens`. A schema may still
ask for other separators through llguidance's own `x-guidance` key.

This module builds these grammars; a forced tool call's is built by `tool_call_grammar.py` with the helpers
here, and `grammar_check.py` checks every grammar against the tokenizer at admission.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import llguidance

__all__ = [
    "DEFAULT_MAX_GRAMMAR_BYTES",
    "JSON_OPTIONS",
    "Grammar",
    "GrammarError",
    "check_size",
    "dumps",
    "first_lines",
    "from_generate_parameters",
    "from_openai_response_format",
    "generate_parameters_field",
    "json_schema_grammar",
    "regex_grammar",
    "shown",
]

DEFAULT_MAX_GRAMMAR_BYTES = 65536
# Compact JSON: no whitespace between tokens, so structure is forced (see the module docstring).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
_ERROR_LINES, _ERROR_CHARS = 4, 400
_LISTING = re.compile(r"^\d+ \|")  # a numbered grammar line in llguidance's messages


class GrammarError(ValueError):
    """A structured-output field the router refuses; `field` names it (`grammar.value`, `response_format`...)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


@dataclass(frozen=True)
class Grammar:
    """An llguidance grammar (JSON text, as `LLMatcher` takes it) and the request field it was built from."""

    text: str
    field: str


# -- building -----------------------------------------------------------------------------------------------


def json_schema_grammar(schema: object, field: str, max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES) -> Grammar:
    """The grammar of a JSON schema given as an object or as a string holding one (compact JSON output).

    Example: json_schema_grammar({"type": "integer"}, "grammar.value").text
             -> '{"grammars":[{"name":"json_schema","json_schema":{"type":"integer","x-guidance":...'
    """
    if isinstance(schema, str):
        check_size(schema, field, max_bytes)
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as e:
            raise GrammarError(f"`{field}` is a string that does not hold JSON: {e}", field) from None
    elif isinstance(schema, dict):
        check_size(dumps(schema), field, max_bytes)
    if isinstance(schema, bool):  # JSON Schema's `true` (anything) and `false` (nothing: never compiles)
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError(f"`{field}` must be a JSON schema: an object. Given: {type(schema).__name__}", field)
    try:
        schema = without_ref_cycles(schema)
        return Grammar(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS), field)
    except Exception as e:  # ValueError; RecursionError for a schema nested past Python's limit
        raise GrammarError(f"`{field}` is not a valid JSON schema: {first_lines(str(e))}", field) from None


# Keys that do not constrain a value: a schema of these and `$ref` alone is its reference's constraint.
_ANNOTATIONS = frozenset({"$ref", "$defs", "definitions", "$schema", "$id", "$anchor", "$comment", "title",
                          "description", "default", "examples", "deprecated", "readOnly", "writeOnly"})


def without_ref_cycles(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with every `$ref` that only leads back to itself through other bare `$ref`s removed.

    Such a reference constrains nothing: `{"$ref": "#"}` is the schema "whatever this schema allows", whose
    solution under JSON Schema is any value. llguidance reads it as an empty language instead, and would end the
    answer at once (an empty string is not JSON). A cycle through a schema that does constrain (an object whose
    property refers back to it) is recursion, not a loop, and is kept.

    Example: {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
             -> {"$defs": {"a": {}, "b": {}}}: any JSON value
    """
    def resolve(pointer: str) -> Any:
        if not pointer.startswith("#"):
            return None  # not a reference into this document: llguidance decides
        node: Any = schema
        for part in filter(None, unquote(pointer[1:]).split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def bare(node: Any) -> bool:
        return isinstance(node, dict) and isinstance(node.get("$ref"), str) and node.keys() <= _ANNOTATIONS

    def loops(node: Any) -> bool:
        seen: set[int] = set()
        while bare(node):
            if id(node) in seen:
                return True
            seen.add(id(node))
            node = resolve(node["$ref"])
        return False

    looping: set[int] = set()
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if bare(node) and loops(node):
                looping.add(id(node))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    if not looping:
        return schema

    def copy(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: copy(v) for k, v in node.items() if not (k == "$ref" and id(node) in looping)}
        if isinstance(node, list):
            return [copy(v) for v in node]
        return node

    return copy(schema)


def regex_grammar(regex: object, field: str, max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES) -> Grammar:
    """The grammar of a regex the whole output must match (checked when the grammar is checked)."""
    if not isinstance(regex, str):
        raise GrammarError(f"`{field}` must be a string (a regex). Given: {type(regex).__name__}", field)
    check_size(regex, field, max_bytes)
    return Grammar(llguidance.LLMatcher.grammar_from_regex(ascii_classes(regex)), field)


# TGI's regex grammars (outlines, interegular) read the shorthand classes as ASCII; llguidance's regex syntax (Rust's
# `regex` crate) reads them as Unicode, so `\d` would take "３" and `\w` "é". Written out as bracket classes, which
# llguidance also nests inside brackets (`[^\d.]` -> `[^[0-9].]`).
_ASCII_CLASSES = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]",
                  "s": "[\\t\\n\\x0B\\f\\r ]", "S": "[^\\t\\n\\x0B\\f\\r ]"}


def ascii_classes(regex: str) -> str:
    """`regex` with `\\d \\D \\w \\W \\s \\S` (inside brackets too) replaced by their ASCII classes.

    Example: ascii_classes(r"(19|20)\\d\\d-[\\w.]+") -> r"(19|20)[0-9][0-9]-[[0-9A-Za-z_].]+"
             (an escaped backslash stays: r"\\\\d" is a backslash and a "d")
    """
    out, i = [], 0
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            out.append(_ASCII_CLASSES.get(escaped, char + escaped))
            i += 2
        else:
            out.append(char)
            i += 1
    return "".join(out)


def from_generate_parameters(grammar: Mapping[str, Any] | None, response_format: Mapping[str, Any] | None,
                             max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES) -> Grammar | None:
    """The grammar of `/generate`'s `parameters.grammar` (TGI) or `parameters.response_format` (LoRAX); None
    for neither (or `{"type": "text"}`). Both at once is refused."""
    if grammar is not None and response_format is not None:
        raise GrammarError("`grammar` and `response_format` cannot both be set: give one", "grammar")
    if grammar is not None:
        return _tgi_grammar(grammar, max_bytes)
    if response_format is not None:
        return _response_format(response_format, max_bytes, name_required=False)
    return None


def generate_parameters_field(grammar: Mapping[str, Any] | None, response_format: Mapping[str, Any] | None) -> str:
    """The field a compile error of `from_generate_parameters`'s grammar is about."""
    if grammar is not None:
        return "grammar.value"
    if (response_format or {}).get("type") == "json_schema":
        return "response_format.json_schema.schema"
    return "response_format.schema"


def from_openai_response_format(response_format: Mapping[str, Any] | None,
                                max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES) -> Grammar | None:
    """OpenAI's `response_format`: `text` (None), `json_object`, `json_schema` (its `name` is required)."""
    if response_format is None:
        return None
    return _response_format(response_format, max_bytes, name_required=True)


def _tgi_grammar(grammar: Mapping[str, Any], max_bytes: int) -> Grammar:
    kind = grammar.get("type")
    value = grammar.get("value")
    if value is not None and not isinstance(value, (dict, str)):
        raise GrammarError(f"`grammar.value` must be a JSON schema (an object, or a string holding one) or a regex "
                           f"(a string). Given: {type(value).__name__}", "grammar.value")
    if kind == "regex":
        if "value" not in grammar:
            raise GrammarError("`grammar.value` is required with `grammar.type` regex", "grammar.value")
        return regex_grammar(value, "grammar.value", max_bytes)
    if kind == "json":
        if "value" not in grammar:
            raise GrammarError("`grammar.value` is required with `grammar.type` json: a JSON schema",
                               "grammar.value")
        return json_schema_grammar(value, "grammar.value", max_bytes)
    if kind == "json_object":
        return json_schema_grammar(ANY_OBJECT if value is None else value, "grammar.value", max_bytes)
    raise GrammarError(f"`grammar.type` must be one of json, json_object, regex. Given: {shown(kind)}",
                       "grammar.type")


def _response_format(response_format: Mapping[str, Any], max_bytes: int, name_required: bool) -> Grammar | None:
    kind = response_format.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise GrammarError(f"`response_format.type` must be one of text, json_object, json_schema. Given: "
                           f"{shown(kind)}", "response_format.type")
    # Every key the API documents is checked whatever the type, so a mistyped one is never silently ignored.
    schema = response_format.get("schema")
    if schema is not None and not isinstance(schema, (dict, str)):
        raise GrammarError(f"`response_format.schema` must be a JSON schema: an object. Given: "
                           f"{type(schema).__name__}", "response_format.schema")
    spec = response_format.get("json_schema")
    if spec is not None:
        if not isinstance(spec, dict):
            raise GrammarError("`response_format.json_schema` must be an object with `name` and `schema`",
                               "response_format.json_schema")
        for key, types, what in (("name", str, "a string"), ("strict", bool, "a boolean"),
                                 ("schema", dict, "a JSON schema: an object")):
            if spec.get(key) is not None and not isinstance(spec[key], types):
                raise GrammarError(f"`response_format.json_schema.{key}` must be {what}. Given: "
                                   f"{type(spec[key]).__name__}", f"response_format.json_schema.{key}")
        if name_required and not spec.get("name"):
            raise GrammarError("`response_format.json_schema.name` is required: a non-empty string",
                               "response_format.json_schema.name")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(ANY_OBJECT if schema is None else schema, "response_format.schema", max_bytes)
    if spec is None:
        raise GrammarError("`response_format.json_schema` is required with `response_format.type` json_schema: "
                           "an object with `name` and `schema`", "response_format.json_schema")
    schema = spec.get("schema")
    return json_schema_grammar({} if schema is None else schema, "response_format.json_schema.schema", max_bytes)


def check_size(text: str, field: str, max_bytes: int) -> None:
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        raise GrammarError(f"`{field}` must be at most {max_bytes} bytes (--max-grammar-bytes). Given: {size}",
                           field)


def dumps(value: object) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError) as e:  # NaN survives JSON parsing in Python; nesting past the limit
        raise GrammarError(f"a schema that cannot be written as JSON: {e}", "grammar") from None


def shown(value: object) -> str:
    """`repr(value)`, cut to 60 characters, for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def first_lines(message: str) -> str:
    """The gist of an llguidance message, on one line: its first lines, without the caret lines under a regex
    nor the grammar listing or parser state that may follow.

    Example: the message of the regex "(abc", whose lines are
                 at 1(8): invalid regex "(abc" (in regex): regex parse error: | (abc | ^ | error: unclosed group
                 | 1 | start: /(abc/ | ^
             -> 'at 1(8): invalid regex "(abc" (in regex): regex parse error:; (abc; error: unclosed group'
    """
    lines = []
    for line in message.strip().splitlines():
        line = line.strip()
        if line.startswith("<") or _LISTING.match(line) or len(lines) == _ERROR_LINES:
            break
        if line and line.strip("^ "):
            lines.append(line)
    text = "; ".join(lines) or message.strip()[:_ERROR_CHARS]
    return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS - 3] + "..."
