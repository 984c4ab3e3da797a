"""Structured output on the router: the grammars built from `grammar`, `response_format` and forced tool calls,
checked with llguidance against the test tokenizer, refused with 4xx naming the field, and sent to the workers.

A grammar is judged by an `LLMatcher` fed the tokens of a text: a valid instance is consumed to an accepting
state, an invalid one is refused (`consume_tokens` False, or not accepting at the end).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import llguidance
import pytest
import tokenizers
from fake_worker import FakeClient

from specula_router import grammar as g
from specula_router import grammar_check as gc
from specula_router import tool_call_grammar as tg
from specula_router.adapters import AdapterManager
from specula_router.block_allocator import BlockAllocator
from specula_router.chat_template import ChatTemplate
from specula_router.metrics import Metrics
from specula_router.openai_models import OpenAISettings
from specula_router.scheduler import Scheduler, SchedulerConfig
from specula_router.schemas import GenerateParameters
from specula_router.server import RouterState, create_app
from specula_router.tool_calls import parse_tool_calls
from specula_router.validation import Validator
from specula_router.validation_limits import ValidationError, ValidationLimits
from specula_testing.chat_templates import (
    CHATML,
    MISTRAL,
    QWEN_TOOLS,
    WEATHER_TOOL,
)
from specula_testing.tokenizer import EOS_ID, build_tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def lltok(tokenizer):
    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=tokenizer.get_vocab_size(with_added_tokens=True),
                                  eos_token=EOS_ID)


def accepts(lltok, tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` (as the test tokenizer encodes it) whole and is then satisfied."""
    assert llguidance.LLMatcher.validate_grammar(grammar, lltok) == ""
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False).ids)
    return ok and matcher.is_accepting() and not matcher.is_error()


def make_state(tokenizer, template=CHATML, max_grammar_bytes=65536, checker=None):
    metrics = Metrics()
    client = FakeClient(0.0)
    manager = AdapterManager(client, metrics, 8)
    scheduler = Scheduler(client, BlockAllocator(1024, 16), SchedulerConfig(max_batch_prefill_tokens=2048), metrics,
                          manager)
    validator = Validator(tokenizer, ValidationLimits(max_input_tokens=1500, max_total_tokens=1600,
                                                      max_grammar_bytes=max_grammar_bytes), rng=random.Random(0))
    settings = OpenAISettings(ChatTemplate.from_text(template, {"bos_token": "<s>", "eos_token": "</s>"}))
    return RouterState(scheduler, validator, client, metrics, {"model_id": "m", "version": "0.1.0"}, 16, "cpu",
                       openai=settings, grammar_checker=checker)


def call(state, fn):
    async def body():
        app = create_app(state)
        loop = asyncio.create_task(state.scheduler.run())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
                return await fn(client)
        finally:
            loop.cancel()

    return asyncio.run(body())


# -- building -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grammar", [
    {"type": "json", "value": PERSON},
    {"type": "json", "value": json.dumps(PERSON)},  # a string holding the schema, as some TGI clients send
    {"type": "json_object", "value": PERSON},
])
def test_tgi_json_grammar_takes_compact_instances_only(tokenizer, lltok, grammar):
    built = g.from_generate_parameters(grammar, None)
    assert built.field == "grammar.value"
    assert accepts(lltok, tokenizer, built.text, '{"name":"Ada","age":36}')
    assert not accepts(lltok, tokenizer, built.text, '{"name":"Ada","age":"36"}')  # wrong type
    assert not accepts(lltok, tokenizer, built.text, '{"name":"Ada"}')  # a required key missing
    assert not accepts(lltok, tokenizer, built.text, '{"name": "Ada", "age": 36}')  # free whitespace


def test_regex_grammar_matches_the_whole_output(tokenizer, lltok):
    built = g.from_generate_parameters({"type": "regex", "value": "[0-9]{3}-[0-9]{4}"}, None)
    assert accepts(lltok, tokenizer, built.text, "555-1234")
    assert not accepts(lltok, tokenizer, built.text, "555-12345")
    assert not accepts(lltok, tokenizer, built.text, "5551234")


@pytest.mark.parametrize(("grammar", "response_format"), [
    ({"type": "json_object"}, None),
    (None, {"type": "json_object"}),
    (None, {"type": "json_object", "schema": None}),
])
def test_json_object_without_a_schema_is_any_object(tokenizer, lltok, grammar, response_format):
    built = g.from_generate_parameters(grammar, response_format)
    assert accepts(lltok, tokenizer, built.text, '{"x":[1,true,null],"y":{"z":"w"}}')
    assert not accepts(lltok, tokenizer, built.text, "[1,2]")
    assert not accepts(lltok, tokenizer, built.text, '"text"')


@pytest.mark.parametrize("response_format", [
    {"type": "json_object", "schema": PERSON},
    {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    {"type": "json_schema", "json_schema": {"schema": PERSON}},  # LoRAX does not require a name
])
def test_lorax_response_format(tokenizer, lltok, response_format):
    built = g.from_generate_parameters(None, response_format)
    assert built.field.startswith("response_format")
    assert accepts(lltok, tokenizer, built.text, '{"name":"Bo","age":7}')
    assert not accepts(lltok, tokenizer, built.text, '{"name":"Bo","age":7,"x":1}')  # additionalProperties


def test_text_formats_are_unconstrained():
    assert g.from_generate_parameters(None, {"type": "text"}) is None
    assert g.from_generate_parameters(None, None) is None
    assert g.from_openai_response_format({"type": "text"}) is None
    assert g.from_openai_response_format(None) is None


def test_openai_response_format(tokenizer, lltok):
    built = g.from_openai_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert built.field == "response_format.json_schema.schema"
    assert accepts(lltok, tokenizer, built.text, '{"name":"Cy","age":1}')
    assert not accepts(lltok, tokenizer, built.text, '{"age":1,"name":"Cy","x":2}')
    any_json = g.from_openai_response_format({"type": "json_schema", "json_schema": {"name": "anything"}})
    assert accepts(lltok, tokenizer, any_json.text, "[1,2]") and accepts(lltok, tokenizer, any_json.text, "3")
    for response_format in ({"type": "json_schema", "json_schema": {"schema": PERSON}},
                            {"type": "json_object", "json_schema": {}}):  # OpenAI requires it wherever it is given
        with pytest.raises(g.GrammarError) as info:
            g.from_openai_response_format(response_format)
        assert info.value.field == "response_format.json_schema.name"


@pytest.mark.parametrize(("grammar", "response_format", "field", "words"), [
    ({"type": "xml", "value": "<a/>"}, None, "grammar.type", "json, json_object, regex"),
    ({"type": "json"}, None, "grammar.value", "required"),
    ({"type": "regex", "value": 5}, None, "grammar.value", "or a regex (a string)"),
    ({"type": "regex", "value": {"a": 1}}, None, "grammar.value", "must be a string (a regex)"),
    ({"type": "json_object", "value": [1]}, None, "grammar.value", "must be a JSON schema"),
    ({"type": "json", "value": "{not json"}, None, "grammar.value", "does not hold JSON"),
    ({"type": "json", "value": [1, 2]}, None, "grammar.value", "must be a JSON schema"),
    ({"type": "json", "value": "3"}, None, "grammar.value", "must be a JSON schema"),
    (None, {"type": "json"}, "response_format.type", "text, json_object, json_schema"),
    (None, {"type": "json_schema", "json_schema": "x"}, "response_format.json_schema", "must be an object"),
    (None, {"type": "json_schema"}, "response_format.json_schema", "is required"),
    # A documented key of the wrong type is refused even where the type does not read it.
    (None, {"type": "json_object", "json_schema": 5}, "response_format.json_schema", "must be an object"),
    (None, {"type": "text", "schema": 5}, "response_format.schema", "must be a JSON schema"),
    (None, {"type": "json_schema", "json_schema": {"name": "p", "strict": "yes"}},
     "response_format.json_schema.strict", "must be a boolean"),
    ({"type": "regex", "value": "a"}, {"type": "text"}, "grammar", "cannot both be set"),
])
def test_malformed_fields_are_refused_naming_them(grammar, response_format, field, words):
    with pytest.raises(g.GrammarError) as info:
        g.from_generate_parameters(grammar, response_format)
    assert info.value.field == field and words in info.value.message and f"`{field}`" in info.value.message


def test_size_limit_counts_the_text_as_received():
    regex = "a" * 100
    assert g.regex_grammar(regex, "grammar.value", max_bytes=100) is not None
    with pytest.raises(g.GrammarError, match=r"`grammar.value` must be at most 99 bytes \(--max-grammar-bytes\)"):
        g.regex_grammar(regex, "grammar.value", max_bytes=99)
    schema = {"type": "object", "description": "é" * 60}  # 120 bytes of UTF-8 in the description
    with pytest.raises(g.GrammarError, match="at most 100 bytes"):
        g.json_schema_grammar(schema, "response_format.schema", max_bytes=100)


# -- tool calls -------------------------------------------------------------------------------------------------


def test_the_format_is_read_from_the_template():
    assert tg.tool_call_format(QWEN_TOOLS) == tg.HERMES
    assert tg.tool_call_format("{{ '[TOOL_CALLS]' }}") == tg.MISTRAL
    assert tg.tool_call_format(CHATML) == tg.tool_call_format(MISTRAL) == tg.LLAMA


@pytest.mark.parametrize(("call_format", "special", "text"), [
    (tg.HERMES, (), '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'),
    (tg.MISTRAL, (), '[TOOL_CALLS] [{"name":"get_weather","arguments":{"city":"Paris"}}]'),
    (tg.MISTRAL, ("[TOOL_CALLS]",), '[{"name":"get_weather","arguments":{"city":"Paris"}}]'),
    (tg.HERMES, ("<tool_call>", "</tool_call>"), '{"name":"get_weather","arguments":{"city":"Paris"}}'),
    (tg.LLAMA, (), '{"name":"get_weather","parameters":{"city":"Paris"}}'),
])
def test_a_required_call_is_accepted_and_parsed(tokenizer, lltok, call_format, special, text):
    tools = [WEATHER_TOOL, ADD_TOOL]
    built = tg.tool_call_grammar(tools, "required", call_format, special)
    assert built.field == "tools"
    assert accepts(lltok, tokenizer, built.text, text)
    content, calls = parse_tool_calls(text, {"get_weather", "add"})
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    wrong_args = text.replace('"Paris"', "12")
    assert not accepts(lltok, tokenizer, built.text, wrong_args)
    unknown = text.replace("get_weather", "get_time")
    assert not accepts(lltok, tokenizer, built.text, unknown)
    assert not accepts(lltok, tokenizer, built.text, "It is sunny in Paris.")


def test_required_allows_several_calls_where_the_format_does(tokenizer, lltok):
    hermes = tg.tool_call_grammar([WEATHER_TOOL, ADD_TOOL], "required", tg.HERMES)
    text = ('<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>\n'
            '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>')
    assert accepts(lltok, tokenizer, hermes.text, text)
    _, calls = parse_tool_calls(text, {"add", "get_weather"})
    assert [c.name for c in calls] == ["add", "get_weather"] and json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    mistral = tg.tool_call_grammar([WEATHER_TOOL, ADD_TOOL], "required", tg.MISTRAL)
    text = '[TOOL_CALLS] [{"name":"add","arguments":{"a":1,"b":2}},{"name":"add","arguments":{"a":3,"b":4}}]'
    assert accepts(lltok, tokenizer, mistral.text, text)
    assert [json.loads(c.arguments) for c in parse_tool_calls(text, {"add"})[1]] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]


def test_a_named_function_allows_exactly_one_call_of_it(tokenizer, lltok):
    choice = {"type": "function", "function": {"name": "add"}}
    built = tg.tool_call_grammar([WEATHER_TOOL, ADD_TOOL], choice, tg.HERMES)
    one = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'
    assert accepts(lltok, tokenizer, built.text, one)
    assert not accepts(lltok, tokenizer, built.text, one + "\n" + one)
    other = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    assert not accepts(lltok, tokenizer, built.text, other)
    with pytest.raises(g.GrammarError) as info:
        tg.tool_call_grammar([WEATHER_TOOL], choice, tg.HERMES)
    assert info.value.field == "tool_choice" and "'add'" in info.value.message


def test_a_tool_without_parameters_takes_no_arguments(tokenizer, lltok):
    """OpenAI: omitted `parameters` is an empty parameter list. Before, any object was allowed, and a forced answer
    repeated a key (`{"description":"a","description":"b"}`), which no JSON reader keeps."""
    tool = {"type": "function", "function": {"name": "now"}}
    built = tg.tool_call_grammar([tool], "required", tg.LLAMA)
    assert accepts(lltok, tokenizer, built.text, '{"name":"now","parameters":{}}')
    assert not accepts(lltok, tokenizer, built.text, '{"name":"now","parameters":[]}')
    assert not accepts(lltok, tokenizer, built.text, '{"name":"now","parameters":{"a":1}}')
    assert not accepts(lltok, tokenizer, built.text, '{"name":"now","parameters":{"a":1,"a":2}}')


# -- checking ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("built", "words"), [
    (lambda: g.json_schema_grammar({"type": "foo"}, "grammar.value"), "foo"),
    (lambda: g.regex_grammar("(abc", "grammar.value"), "unclosed group"),
    (lambda: g.json_schema_grammar({"type": "string", "pattern": "[a-"}, "grammar.value"), "regex"),
    (lambda: g.json_schema_grammar({"$ref": "#/nowhere"}, "grammar.value"), "nowhere"),
])
def test_the_checker_refuses_what_llguidance_cannot_compile(tokenizer, built, words):
    checker = gc.GrammarChecker(tokenizer)
    message = asyncio.run(checker.check(built().text))
    assert message and words in message and "\n" not in message


def test_the_checker_caches_results_errors_included(tokenizer):
    checker = gc.GrammarChecker(tokenizer)
    good = g.regex_grammar("[a-z]+", "grammar.value").text
    bad = g.regex_grammar("(abc", "grammar.value").text

    async def run():
        first = [await checker.check(good), await checker.check(bad)]
        assert checker.validations == 2
        again = await asyncio.gather(*(checker.check(text) for text in (good, bad, good, bad)))
        return first, again

    first, again = asyncio.run(run())
    assert first[0] == "" and first[1] and again == [first[0], first[1]] * 2
    assert checker.validations == 2  # answered from the cache


def test_the_cache_keeps_the_most_recent_grammars(tokenizer):
    checker = gc.GrammarChecker(tokenizer, cache_size=2)
    texts = [g.regex_grammar(f"x{i}", "grammar.value").text for i in range(3)]

    async def run():
        for text in texts:
            await checker.check(text)
        await checker.check(texts[2])  # cached
        await checker.check(texts[0])  # evicted: validated again
    asyncio.run(run())
    assert checker.validations == 4


def test_a_grammar_past_the_time_limit_is_refused(tokenizer, monkeypatch):
    checker = gc.GrammarChecker(tokenizer, timeout_s=0.05)
    release = threading.Event()
    real = gc.GrammarChecker._validate

    def slow(self, grammar):
        release.wait(5)
        return real(self, grammar)

    monkeypatch.setattr(gc.GrammarChecker, "_validate", slow)
    text = g.regex_grammar("[0-9]+", "grammar.value").text

    async def run():
        late = await checker.check(text)
        release.set()
        await asyncio.sleep(0.2)
        return late, await checker.check(text)

    late, later = asyncio.run(run())
    assert late == "did not compile within 0.05 s (--grammar-compile-timeout)"
    assert later == "" and checker.validations == 1  # the finished check was kept


def test_a_slow_grammar_is_a_422_over_http(tokenizer, monkeypatch):
    checker = gc.GrammarChecker(tokenizer, timeout_s=0.05)
    release = threading.Event()
    monkeypatch.setattr(gc.GrammarChecker, "_validate", lambda self, grammar: release.wait(5) and "")
    state = make_state(tokenizer, checker=checker)

    async def fn(client):
        try:
            r = await client.post("/generate", json={"inputs": "x", "parameters": {
                "grammar": {"type": "regex", "value": "[0-9]+"}}})
            r2 = await client.post("/v1/completions", json={"prompt": "x", "response_format": {"type": "json_object"}})
        finally:
            release.set()
        return r, r2

    r, r2 = call(state, fn)
    assert r.status_code == 422 and r.json()["error"] == (
        "`grammar.value` did not compile within 0.05 s (--grammar-compile-timeout)")
    assert r2.status_code == 400 and r2.json()["error"]["param"] == "response_format.schema"
    assert "did not compile within 0.05 s" in r2.json()["error"]["message"]
    assert state.in_flight == 0


def test_the_validator_puts_the_grammar_on_the_request(tokenizer):
    validator = Validator(tokenizer, ValidationLimits(max_input_tokens=50, max_total_tokens=100,
                                                      max_grammar_bytes=64))
    params = GenerateParameters.model_validate({"grammar": {"type": "regex", "value": "[0-9]+"}})
    assert validator.validate("x", params).grammar == g.regex_grammar("[0-9]+", "grammar.value").text
    assert validator.validate("x", GenerateParameters()).grammar == ""
    with pytest.raises(ValidationError) as info:
        validator.validate("x", GenerateParameters.model_validate({"grammar": {"type": "regex", "value": "a" * 65}}))
    assert info.value.field == "grammar.value" and "at most 64 bytes" in info.value.message


# -- over HTTP --------------------------------------------------------------------------------------------------


def test_a_valid_grammar_reaches_the_workers_from_every_route(tokenizer):
    state = make_state(tokenizer, template=QWEN_TOOLS)
    regex = g.regex_grammar("[0-9]+", "grammar.value").text
    person = g.json_schema_grammar(PERSON, "x").text
    any_object = g.json_schema_grammar({"type": "object"}, "x").text
    forced = tg.tool_call_grammar([WEATHER_TOOL], "required", tg.HERMES).text

    async def fn(client):
        r = await client.post("/generate", json={"inputs": "x", "parameters": {
            "max_new_tokens": 2, "grammar": {"type": "regex", "value": "[0-9]+"}}})
        assert r.status_code == 200, r.text
        r = await client.post("/generate_stream", json={"inputs": "x", "parameters": {
            "max_new_tokens": 2, "response_format": {"type": "json_object", "schema": PERSON}}})
        assert r.status_code == 200 and "data:" in r.text, r.text
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}})
        assert r.status_code == 200, r.text
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2,
                                                       "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2,
                                                            "tools": [WEATHER_TOOL], "tool_choice": "required"})
        assert r.status_code == 200, r.text
        for choice in ("auto", "none"):
            r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2,
                                                                "tools": [WEATHER_TOOL], "tool_choice": choice})
            assert r.status_code == 200, r.text
        r = await client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text

    call(state, fn)
    sent = [request.grammar for request in state.client.prefilled]
    assert sent == [regex, person, person, any_object, any_object, forced, "", "", ""]


def test_bad_grammars_are_422_on_generate_naming_the_field(tokenizer):
    state = make_state(tokenizer, max_grammar_bytes=1000)
    cases = [
        ({"grammar": {"type": "json", "value": {"type": "foo"}}}, "`grammar.value` does not compile"),
        ({"grammar": {"type": "regex", "value": "(abc"}}, "`grammar.value` does not compile"),
        ({"grammar": {"type": "json", "value": "[1, 2]"}}, "`grammar.value` must be a JSON schema"),
        ({"grammar": {"type": "json", "value": "{oops"}}, "`grammar.value` is a string that does not hold JSON"),
        ({"grammar": {"type": "sql", "value": "x"}}, "`grammar.type` must be one of"),
        ({"grammar": {"type": "regex", "value": "a" * 1001}}, "`grammar.value` must be at most 1000 bytes"),
        ({"response_format": {"type": "json_object", "schema": {"type": "object", "required": 5}}},
         "`response_format.schema` does not compile"),
        ({"response_format": {"type": "json_object"}, "grammar": {"type": "json_object"}}, "cannot both be set"),
    ]

    async def fn(client):
        for parameters, words in cases:
            for route in ("/generate", "/generate_stream"):
                r = await client.post(route, json={"inputs": "x", "parameters": {"max_new_tokens": 2, **parameters}})
                assert r.status_code == 422, (route, parameters, r.text)
                body = r.json()
                assert body["error_type"] == "validation" and words in body["error"], (parameters, body)
        r = await client.post("/generate", json={"inputs": "x", "parameters": {"grammar": "json"}})
        assert r.status_code == 422  # not an object: refused by the body's types

    call(state, fn)
    assert state.in_flight == 0 and state.client.prefilled == []


def test_bad_grammars_are_400_on_the_openai_routes_naming_the_param(tokenizer):
    state = make_state(tokenizer, template=QWEN_TOOLS, max_grammar_bytes=2000)
    schema = {"name": "p", "schema": {"type": "foo"}}
    cases = [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": schema}},
         "response_format.json_schema.schema", "does not compile"),
        ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format.json_schema.name", "is required"),
        ("/v1/completions", {"response_format": {"type": "yaml"}}, "response_format.type", "must be one of"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "tools": [WEATHER_TOOL],
                                  "tool_choice": "required"}, "response_format", "cannot be combined"),
        ("/v1/chat/completions", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                                                           "function": {"name": "add"}}},
         "tool_choice", "not in `tools`"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "needs `tools`"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}],
            "tool_choice": "required"}, "tools", "does not compile"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "description": "d" * 2000}}}],
            "tool_choice": "required"}, "tools", "at most 2000 bytes"),
    ]

    async def fn(client):
        for route, extra, param, words in cases:
            body = {"messages": CHAT} if route.endswith("chat/completions") else {"prompt": "x"}
            r = await client.post(route, json={**body, "max_tokens": 2, **extra})
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == param and words in error["message"], error
            assert error["type"] == "invalid_request_error"

    call(state, fn)
    assert state.in_flight == 0 and state.client.prefilled == []


def test_a_repeated_grammar_is_checked_once_across_requests(tokenizer):
    checker = gc.GrammarChecker(tokenizer)
    state = make_state(tokenizer, checker=checker)
    payload = {"inputs": "x", "parameters": {"max_new_tokens": 1, "grammar": {"type": "json", "value": PERSON}}}
    bad = {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(x"}}}

    async def fn(client):
        for _ in range(3):
            assert (await client.post("/generate", json=payload)).status_code == 200
            assert (await client.post("/generate", json=bad)).status_code == 422
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "response_format": {
            "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
        assert r.status_code == 200  # the same schema from another route: the same grammar text

    call(state, fn)
    assert checker.validations == 2


# -- flags ------------------------------------------------------------------------------------------------------


def test_the_limits_are_flags_with_environment_variables(monkeypatch):
    from test_cli import parse

    for name in ("MAX_GRAMMAR_BYTES", "GRAMMAR_COMPILE_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    params = parse([])
    assert (params["max_grammar_bytes"], params["grammar_compile_timeout"]) == (65536, 10.0)
    params = parse(["--max-grammar-bytes", "1000", "--grammar-compile-timeout", "2.5"])
    assert (params["max_grammar_bytes"], params["grammar_compile_timeout"]) == (1000, 2.5)
    params = parse([], {"MAX_GRAMMAR_BYTES": "2048", "GRAMMAR_COMPILE_TIMEOUT": "0.5"}, monkeypatch)
    assert (params["max_grammar_bytes"], params["grammar_compile_timeout"]) == (2048, 0.5)
    from specula_router.config import RouterConfig

    with pytest.raises(ValueError, match="--max-grammar-bytes must be at least 1; got 0"):
        RouterConfig(model_id="m", master_shard_uds_path="/tmp/s-0", max_grammar_bytes=0)
    with pytest.raises(ValueError, match="--grammar-compile-timeout must be positive; got 0"):
        RouterConfig(model_id="m", master_shard_uds_path="/tmp/s-0", grammar_compile_timeout=0)


def test_the_launcher_passes_the_limits_to_the_router_when_given(monkeypatch):
    from specula_launcher.commands import router_command
    from specula_launcher.defaults import build_config

    for name in ("MAX_GRAMMAR_BYTES", "GRAMMAR_COMPILE_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    common = dict(model_id="org/model", shard_uds_path="/run/s", count_cuda_devices=lambda: 0)
    given = router_command(build_config(**common, max_grammar_bytes=1000, grammar_compile_timeout=2.5))
    assert given[given.index("--max-grammar-bytes") + 1] == "1000"
    assert given[given.index("--grammar-compile-timeout") + 1] == "2.5"
    default = router_command(build_config(**common))
    assert "--max-grammar-bytes" not in default and "--grammar-compile-timeout" not in default  # router's defaults
    with pytest.raises(ValueError, match="--max-grammar-bytes must be at least 1"):
        build_config(**common, max_grammar_bytes=0)


def test_the_router_startup_builds_the_checker_from_the_workers_info(tmp_path, monkeypatch):
    from test_cli import StartupClient

    from specula_proto import generate_pb2 as pb
    from specula_router import startup
    from specula_router.client import ShardedClient
    from specula_router.config import RouterConfig

    build_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 512}')
    client = StartupClient()
    served = []

    async def info():
        return pb.InfoResponse(model_id="m", dtype="float32", device_type="cpu", block_size=16,
                               max_position_embeddings=512, world_size=1, vocab_size=520, eos_token_ids=[2],
                               speculation=pb.SpeculationInfo(method="none", mode="off"))

    async def connect(url, timeout=30.0, instance_id=""):
        return client

    async def serve(self):
        served.append(self.config.app.state.router)

    monkeypatch.setattr(client, "info", info)
    monkeypatch.setattr(ShardedClient, "connect", staticmethod(connect))
    monkeypatch.setattr("uvicorn.Server.serve", serve)
    config = RouterConfig(model_id=str(tmp_path), master_shard_uds_path="/tmp/unused-0", max_grammar_bytes=777,
                          grammar_compile_timeout=3.0)
    assert asyncio.run(startup.run(config)) == 0
    (state,) = served
    checker = state.grammar_checker
    assert state.validator.limits.max_grammar_bytes == 777
    assert (checker.timeout_s, checker.vocab_size, checker.eos_token_ids) == (3.0, 520, [2])
    assert checker.lltokenizer().vocab_size == 520 and checker.lltokenizer().eos_tokens == [2]


def test_parallel_tool_calls_false_allows_one_call_only(lltok, tokenizer):
    """`tool_choice: required` with `parallel_tool_calls: false`: one Hermes block, never a second."""
    call = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'
    for parallel in (True, False):
        grammar = tg.tool_call_grammar([ADD_TOOL], "required", tg.HERMES, parallel=parallel).text
        assert accepts(lltok, tokenizer, grammar, call)
        assert accepts(lltok, tokenizer, grammar, call + "\n" + call) is parallel


# -- grammars that compile but cannot be enforced ---------------------------------------------------------------

# Each compiled, then failed in the worker: a 424 carrying llguidance's parser-state dump, an error event after
# the first token, or a 200 whose answer was empty (the grammar silently not enforced), by the model's first token.
UNENFORCEABLE = [
    ({"grammar": {"type": "regex", "value": "a{1000000}"}}, "grammar.value", "cannot be enforced"),
    ({"grammar": {"type": "regex", "value": "(a{1000}){1000}"}}, "grammar.value", "cannot be enforced"),
    ({"grammar": {"type": "json", "value": {  # an object whose required property is that object: never ends
        "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
        "$ref": "#/$defs/n"}}}, "grammar.value", "Too many items"),
    ({"response_format": {"type": "json_object", "schema": {"type": "string", "pattern": "^a{1000000}$"}}},
     "response_format.schema", "cannot be enforced"),
    ({"grammar": {"type": "regex", "value": ""}}, "grammar.value", "accepts only an empty answer"),
]


@pytest.mark.parametrize(("parameters", "field", "words"), UNENFORCEABLE)
def test_grammars_that_cannot_be_enforced_are_422_at_admission(tokenizer, parameters, field, words):
    state = make_state(tokenizer)

    async def fn(client):
        for route in ("/generate", "/generate_stream"):
            r = await client.post(route, json={"inputs": "x", "parameters": {"max_new_tokens": 4, **parameters}})
            assert r.status_code == 422, (route, r.text)
            message = r.json()["error"]
            assert message.startswith(f"`{field}` ") and words in message, message
            assert "\n" not in message and "<state>" not in message and len(message) < 300, message

    call(state, fn)
    assert state.in_flight == 0 and state.client.prefilled == []


def test_the_walk_stops_at_the_time_limit(tokenizer):
    """A walk past --grammar-compile-timeout stops there, leaving the checking thread free for the next grammar."""
    checker = gc.GrammarChecker(tokenizer, timeout_s=1e-6)
    message = checker._validate(g.regex_grammar("[a-z]+", "grammar.value").text)
    assert message == "did not compile within 1e-06 s (--grammar-compile-timeout)"


def test_a_pattern_that_cannot_be_enforced_is_400_on_the_openai_routes(tokenizer):
    schema = {"name": "s", "schema": {"type": "object", "properties": {"a": {"type": "string",
                                                                               "pattern": "^a{1000000}$"}}}}

    async def fn(client):
        r = await client.post("/v1/chat/completions", json={
            "messages": CHAT, "response_format": {"type": "json_schema", "json_schema": schema}})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "response_format.json_schema.schema" and "cannot be enforced" in error["message"]
        assert error["type"] == "invalid_request_error" and "<state>" not in error["message"]

    call(make_state(tokenizer), fn)


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/loop"}},
     "$defs": {"loop": {"$ref": "#/$defs/loop", "title": "a loop"}}},
])
def test_a_ref_that_only_leads_to_itself_means_any_json_value(tokenizer, lltok, schema):
    """Before, llguidance read such a schema as the empty language: the answer was "" with finish reason EOS."""
    built = g.json_schema_grammar(schema, "grammar.value").text
    assert asyncio.run(gc.GrammarChecker(tokenizer).check(built)) == ""
    values = ['1', '"x"', 'null', '[true,{"a":[]}]'] if "type" not in schema else ['{"x":1}', '{"x":[null]}']
    for value in values:
        assert accepts(lltok, tokenizer, built, value), value
    assert not accepts(lltok, tokenizer, built, "")


def test_recursion_through_a_constraint_is_kept():
    kids = {"type": "array", "items": {"$ref": "#/$defs/t"}}
    tree = {"$defs": {"t": {"type": "object", "properties": {"kids": kids}}}, "$ref": "#/$defs/t"}
    assert g.without_ref_cycles(tree) is tree


# -- regex classes read as TGI reads them ------------------------------------------------------------------------

DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"


@pytest.mark.parametrize(("regex", "taken", "refused"), [
    (DATE, ["2033-12-23", "1999-01-09"], ["20３３-12-2３", "2033-12-2٣"]),  # fullwidth, Arabic-Indic digits
    (r"\w+", ["abc_09"], ["é", "中", "a-b"]),
    (r"a\sb", ["a b", "a\tb"], ["a\u00a0b", "a\u2003b"]),  # NBSP, EM SPACE
    (r"[\d.]+", ["1.5"], ["１.5"]),  # inside brackets
    (r"[^\d]+", ["ab"], ["a1"]),
    (r"\D\W\S", ["a.b", "a.\u00a0"], ["1.b", "a_b", "a. "]),  # NBSP is not ASCII white space
    (r"\\d", ["\\d"], ["1"]),  # an escaped backslash and a "d"
])
def test_regex_classes_are_ascii_as_tgi_reads_them(tokenizer, lltok, regex, taken, refused):
    built = g.regex_grammar(regex, "grammar.value").text
    for text in taken:
        assert accepts(lltok, tokenizer, built, text), text
    for text in refused:
        assert not accepts(lltok, tokenizer, built, text), text


def test_json_schema_patterns_read_digits_and_word_characters_as_ascii(tokenizer, lltok):
    """ECMA-262 (JSON Schema's regex dialect) reads \\d and \\w as ASCII; its \\s is Unicode white space."""
    built = g.json_schema_grammar({"type": "string", "pattern": r"^\d{4}-\w+$"}, "grammar.value").text
    assert accepts(lltok, tokenizer, built, '"2033-ab_1"')
    assert not accepts(lltok, tokenizer, built, '"20３３-ab"')
    assert not accepts(lltok, tokenizer, built, '"2033-é"')
