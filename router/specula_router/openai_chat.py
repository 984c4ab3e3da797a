"""The chat route's translations (`POST /v1/chat/completions`, for `openai_api.py`): a request's messages and tools
as the chat template reads them, and a generation back as OpenAI's chat choice, tool calls parsed from its text.
"""

from __future__ import annotations

import json

from specula_router.openai_errors import OpenAIError
from specula_router.openai_responses import chat_logprobs, finish_reason, trim_at_stop
from specula_router.openai_schemas import ChatCompletionRequest
from specula_router.responses import Generation
from specula_router.tool_calls import parse_tool_calls


def parses_tools(body: ChatCompletionRequest) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


def template_tools(body: ChatCompletionRequest) -> list[dict] | None:
    if not parses_tools(body):
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools or ()]


def template_messages(body: ChatCompletionRequest) -> list[dict]:
    """The messages as a template reads them (as vLLM passes them): text parts joined with newlines, `developer`
    read as `system`, a tool call's JSON `arguments` as an object."""
    messages = []
    for i, message in enumerate(body.messages):
        # Other roles than OpenAI's go to the template as they are: some templates know more (Llama 3.1's
        # `ipython`), and the others refuse them with their own raise_exception.
        out: dict = {"role": "system" if message.role == "developer" else message.role,
                     "content": _text(message.content, i)}
        if message.name is not None:
            out["name"] = message.name
        if message.tool_calls:
            out["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in message.tool_calls]
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        messages.append(out)
    if not messages:
        raise OpenAIError(422, "`messages` must hold at least one message", "messages", "validation")
    return messages


def _text(content, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise OpenAIError(400, f"`messages[{i}].content[{j}]`: only text parts are supported. Given: "
                                   f"{part.type!r}", f"messages[{i}].content[{j}].type", "unsupported")
    return "\n".join(part.text for part in content)


def _arguments(arguments: str) -> object:
    try:
        value = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        return arguments
    return value if isinstance(value, dict) else arguments


def chat_choice(index: int, g: Generation, stops, logprobs: bool, tool_names: set[str]) -> dict:
    text = trim_at_stop(g.final.generated_text, stops)
    content, calls = parse_tool_calls(text, tool_names) if tool_names else (text, [])
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.body() for call in calls]
    return {"index": index, "message": message,
            "logprobs": chat_logprobs(g.tokens, g.top_tokens) if logprobs else None,
            "finish_reason": "tool_calls" if calls else finish_reason(g.final.finish_reason)}
