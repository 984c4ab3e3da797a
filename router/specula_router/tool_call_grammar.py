"""Structured output, router side: the grammar of a forced tool call, OpenAI's `tools` with `tool_choice`
"required" or a named function, in the chat template's own tool-call format. The other grammars, and the
helpers this one is built with, are in `grammar.py`.

Tool calls follow the template's format (`tool_calls.py` parses them back):

    Hermes / Qwen2.5 / ChatML   <tool_call>\\n{"name":"f","arguments":{...}}\\n</tool_call>   (blocks joined by \\n)
    Mistral                     [TOOL_CALLS] [{"name":"f","arguments":{...}},...]
    Llama 3.1 / 3.2 (JSON)      {"name":"f","parameters":{...}}   (one call)

The format is read from the template text: `<tool_call>` means Hermes, `[TOOL_CALLS]` Mistral, anything else
the Llama JSON form. A marker that is a special token of the tokenizer (`[TOOL_CALLS]` in Mistral's v3
tokenizers) is left out: the grammar matches text, and a special token is not text (nor is it in the decoded
answer), so the call is written bare: Mistral's JSON list, or one Hermes call object, which the parser reads too.
Each call object is `{"name": {"const": f}, "arguments": <f's parameters schema>}`, `anyOf` the allowed
functions: `required` allows one or more calls of any tool (one for Llama, and for bare Hermes objects), a named
function exactly one call of it. Llama's optional `<|python_tag|>` is not written.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import llguidance
import tokenizers

from specula_router.grammar import (
    DEFAULT_MAX_GRAMMAR_BYTES,
    JSON_OPTIONS,
    Grammar,
    GrammarError,
    check_size,
    dumps,
    shown,
)

__all__ = ["HERMES", "LLAMA", "MISTRAL", "special_token_texts", "tool_call_format", "tool_call_grammar"]

# A tool declared without `parameters` takes none: `{}` (an open object would let the answer repeat a key).
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
HERMES, MISTRAL, LLAMA = "hermes", "mistral", "llama"


def tool_call_format(template_text: str) -> str:
    """The tool-call format a chat template teaches: HERMES, MISTRAL or LLAMA (the default)."""
    if "<tool_call>" in template_text:
        return HERMES
    if "[TOOL_CALLS]" in template_text:
        return MISTRAL
    return LLAMA


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], tool_choice: str | Mapping[str, Any], call_format: str,
                      special_tokens: Collection[str] = (), parallel: bool = True,
                      max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES) -> Grammar:
    """The grammar of a forced tool call: `tool_choice` "required" (one or more calls of any of `tools`; one for
    LLAMA, and one when `parallel` is false: OpenAI's `parallel_tool_calls: false`) or
    {"type": "function", "function": {"name": f}} (exactly one call of f).

    `tools` are OpenAI's: {"type": "function", "function": {"name", "parameters"}}. `special_tokens`: the
    tokenizer's special tokens' texts; a marker among them is left out (see the module docstring).

    Example (HERMES, tool_choice "required", one tool `add` without parameters), as Lark:
        start: call_block ("\\n" call_block)*
        call_block: "<tool_call>\\n" call "\\n</tool_call>"
        call: %json{"anyOf": [{"type": "object", "properties": {"name": {"const": "add"}, "arguments": ...
    """
    functions = {}
    for tool in tools:
        function = tool.get("function") or {}
        functions[function.get("name")] = function.get("parameters")
    if tool_choice == "required":
        names, several = list(functions), parallel
    else:
        name = ((tool_choice or {}).get("function") or {}).get("name") if isinstance(tool_choice, Mapping) else None
        if name not in functions:
            raise GrammarError(f"`tool_choice` names a function that is not in `tools`: {shown(name)}",
                               "tool_choice")
        names, several = [name], False
    if not names:
        raise GrammarError("`tool_choice` required needs at least one tool in `tools`", "tool_choice")
    key = "parameters" if call_format == LLAMA else "arguments"
    calls = []
    for name in names:
        parameters = functions[name]
        if parameters is None:  # OpenAI: "omitting parameters defines a function with an empty parameter list"
            parameters = NO_ARGUMENTS
        if not isinstance(parameters, dict):
            raise GrammarError(f"`tools`: the parameters of {name!r} must be a JSON schema object", "tools")
        calls.append({"type": "object", "properties": {"name": {"const": name}, key: parameters},
                      "required": ["name", key], "additionalProperties": False})
    call_schema = {"anyOf": calls, "x-guidance": dict(JSON_OPTIONS)}
    lines = []
    if call_format == HERMES:
        opener = "" if "<tool_call>" in special_tokens else "<tool_call>\\n"
        closer = "" if "</tool_call>" in special_tokens else "\\n</tool_call>"
        several = several and bool(opener and closer)  # bare objects joined by newlines would not parse back
        lines.append('start: call_block ("\\n" call_block)*' if several else "start: call_block")
        lines.append(f'call_block: "{opener}" call "{closer}"' if opener or closer else "call_block: call")
    elif call_format == MISTRAL:
        marker = "" if "[TOOL_CALLS]" in special_tokens else '"[TOOL_CALLS] " '
        lines.append(f'start: {marker}"[" call ("," call)* "]"' if several else f'start: {marker}"[" call "]"')
    else:
        lines.append("start: call")
    lines.append("call: %json" + dumps(call_schema))
    lark = "\n".join(lines) + "\n"
    check_size(lark, "tools", max_bytes)
    return Grammar(llguidance.LLMatcher.grammar_from_lark(lark), "tools")


def special_token_texts(tokenizer: tokenizers.Tokenizer) -> frozenset[str]:
    """The texts of the tokenizer's special added tokens (`<s>`, `[TOOL_CALLS]`, ...)."""
    return frozenset(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special)
