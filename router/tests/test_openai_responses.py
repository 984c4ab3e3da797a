"""The pieces of OpenAI answers that need no server: stop-sequence trimming in streams and tool-call parsing."""

from __future__ import annotations

import json
import random

import pytest

from specula_router.openai_responses import StopTrimmer, trim_at_stop
from specula_router.tool_calls import could_be_tool_call, parse_tool_calls

NAMES = {"get_weather", "add"}


@pytest.mark.parametrize("text,stops,expected", [
    ("a\n\nb", ["\n\n"], "a"), ("abc", ["x"], "abc"), ("abcabc", ["ca", "b"], "a"), ("abc", [], "abc"),
])
def test_trim_at_stop_cuts_before_the_first_stop(text, stops, expected):
    assert trim_at_stop(text, stops) == expected


def test_streamed_text_joins_to_the_trimmed_text_however_it_is_split():
    rng = random.Random(0)
    alphabet = "ab\n "
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 2))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        trimmer = StopTrimmer(stops)
        streamed = "".join(trimmer.push(p) for p in pieces) + trimmer.flush()
        assert streamed == trim_at_stop(text, stops), (text, stops, pieces)


def test_a_worker_text_cut_inside_a_token_loses_just_its_stop_sequence():
    # The worker ends the text where the stop ends, even inside a token: "I" "ter" "viron" comes as "I" "ter" "v".
    trimmer = StopTrimmer(["never", "terv"])
    streamed = "".join(trimmer.push(p) for p in ["I", "ter", "v"]) + trimmer.flush()
    assert streamed == trim_at_stop("Iterv", ["never", "terv"]) == "I"


def test_a_possible_stop_is_held_back_until_it_is_known():
    trimmer = StopTrimmer(["\n\n"])
    assert trimmer.push("a\n") == "a"
    assert trimmer.push("b") == "\nb"
    assert trimmer.push("\n") == "" and trimmer.push("\nc") == "" and trimmer.flush() == ""


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
])
def test_tool_call_formats_of_the_common_templates(text):
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29


def test_several_calls_and_text_before_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "add"]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("text", [
    "The weather is fine.", '{"name": "rm_rf", "arguments": {}}', '<tool_call>\n{not json}\n</tool_call>',
    '{"name": "add", "arguments": [1, 2]}', "[1, 2, 3]",
])
def test_answers_that_are_not_calls_of_the_given_functions_stay_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_could_be_tool_call_holds_only_what_starts_like_a_call():
    assert could_be_tool_call("") and could_be_tool_call("  <tool") and could_be_tool_call("[TOOL")
    assert could_be_tool_call('{"na') and could_be_tool_call("<|python")
    assert not could_be_tool_call("The") and not could_be_tool_call("<b>")
