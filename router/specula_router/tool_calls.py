"""Tool calls in a model's answer: the text a chat template taught the model to write, parsed into OpenAI's
`tool_calls` (`openai_chat.py` calls this on a chat answer when the request has tools).

The formats of the common templates:

    Hermes / Qwen2.5 / ChatML   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (one block per call)
    Mistral                     [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]
    Llama 3.1 / 3.2 (JSON)      {"name": "f", "parameters": {...}}   (optionally after <|python_tag|>)

With `tool_choice` "required" or a named function the answer is constrained to these formats, written as
compact JSON (`tool_call_grammar.tool_call_grammar`); a marker that is a special token of the tokenizer is left out, so
such an answer may be the bare JSON list or object, which parses the same way.

Each parsed call must name one of the request's functions; an answer that does not parse as calls is plain
content (the model chose to answer in words). Arguments become a JSON string, as OpenAI sends them.

`could_be_tool_call` tells a stream whether text so far may still turn into a call, so it holds that text back
rather than sending it as content (see `openai_api.py`).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Collection
from dataclasses import dataclass

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
_MARKERS = (HERMES_OPEN, MISTRAL_MARKER, PYTHON_TAG, "{", "[")
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)
_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as a string
    id: str

    def body(self, index: int | None = None) -> dict:
        """OpenAI's `tool_calls[]` entry; stream deltas also carry the call's `index`."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def parse_tool_calls(text: str, function_names: Collection[str]) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls): the calls written in `text`, and the text outside them (None when there is none).

    Example: parse_tool_calls('<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>', {"add"})
             -> (None, [ParsedToolCall(name="add", arguments='{"a": 1}', id="call_...")])
    No calls: (text, []).
    """
    stripped = text.strip()
    if HERMES_OPEN in stripped:
        before = stripped[:stripped.index(HERMES_OPEN)].strip()
        objects = [_json(block.strip()) for block in _HERMES_BLOCK.findall(stripped)]
    elif stripped.startswith(MISTRAL_MARKER):
        before, objects = "", _as_list(_json(stripped[len(MISTRAL_MARKER):].strip()))
    elif stripped.startswith((PYTHON_TAG, "{", "[")):
        before, objects = "", _as_list(_json(stripped.removeprefix(PYTHON_TAG).strip()))
    else:
        return text, []
    calls = [_call(obj, function_names) for obj in objects]
    if not calls or any(call is None for call in calls):
        return text, []
    return before or None, [call for call in calls if call is not None]


def could_be_tool_call(text: str) -> bool:
    """Whether an answer starting with `text` may still be a tool call (a prefix of a marker, or starts with one)."""
    stripped = text.lstrip()
    if not stripped:
        return True
    return any(stripped.startswith(m) or m.startswith(stripped) for m in _MARKERS)


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _as_list(value: object) -> list:
    return value if isinstance(value, list) else [value]


def _call(obj: object, function_names: Collection[str]) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in function_names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the JSON string OpenAI sends
        if not isinstance(_json(arguments), dict):
            return None
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return ParsedToolCall(obj["name"], arguments, new_call_id())
