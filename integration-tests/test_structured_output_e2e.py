"""Structured output through the real stack: TGI's `grammar`, LoRAX's and OpenAI's `response_format`, tool calls
with `tool_choice`, with speculation on, spoken to by the published clients (text-generation, lorax-client,
openai). Every output is checked with `jsonschema` or `re.fullmatch`; bad grammars get a 4xx naming the field.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from stack import MAX_POSITIONS
from wire import REQUEST_TIMEOUT_S, metric, sse_events

from specula_testing.chat_templates import TEMPLATES, add_chat_template
from specula_testing.models import build_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "count": {"type": "integer", "minimum": 1, "maximum": 50},
        "kind": {"enum": ["alpha", "beta"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False},
    },
    "required": ["name", "count", "kind", "tags", "inner"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
PROMPT = "def fibonacci(n):"
# Bounded arguments, so a random model's call ends well within max_tokens.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("grammar-model") / "llama", "llama",
                            max_position_embeddings=MAX_POSITIONS, vocab_size=600)
    add_chat_template(path, "qwen_tools")  # Hermes-style <tool_call> blocks
    assert "qwen_tools" in TEMPLATES
    return path


@pytest.fixture(scope="module")
def grammar_server(chat_model, tmp_path_factory):
    from conftest import _start, _stop

    launcher = _start(chat_model, tmp_path_factory.mktemp("grammar-run"),
                      ["--speculative-tokens", "3", "--speculation-mode", "fixed"], "grammar")
    yield launcher
    _stop(launcher)
    launcher.close()


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=REQUEST_TIMEOUT_S)


def test_generate_follows_a_json_schema_and_a_regex(grammar_server):
    url = grammar_server.url
    for seed in range(12):
        r = post(url, "/generate", inputs=PROMPT, parameters={
            "grammar": {"type": "json", "value": SCHEMA}, "max_new_tokens": 150, "do_sample": True,
            "temperature": 1.0, "seed": seed, "details": True})
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["generated_text"]), SCHEMA)
        assert r.json()["details"]["finish_reason"] == "eos_token"
        r = post(url, "/generate", inputs=PROMPT, parameters={
            "grammar": {"type": "regex", "value": REGEX}, "max_new_tokens": 30, "do_sample": True, "seed": seed})
        assert r.status_code == 200, r.text
        assert re.fullmatch(REGEX, r.json()["generated_text"]), r.json()
    # Streamed, greedy: the same text as unstreamed, and the forced keys were drafted and accepted.
    body = {"inputs": PROMPT, "parameters": {"grammar": {"type": "json", "value": SCHEMA}, "max_new_tokens": 150}}
    whole = post(url, "/generate", **body).json()["generated_text"]
    stream = httpx.post(f"{url}/generate_stream", json=body, timeout=REQUEST_TIMEOUT_S)
    events = sse_events(stream.text)
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == whole
    assert events[-1]["generated_text"] == whole
    assert metric(url, "specula_spec_decode_num_accepted_tokens_total", method="grammar") > 0


def test_bad_grammars_get_a_4xx_naming_the_field(grammar_server):
    url = grammar_server.url
    cases = [
        ("/generate", {"inputs": PROMPT, "parameters": {"grammar": {"type": "regex", "value": "(abc"}}}, "grammar"),
        ("/generate", {"inputs": PROMPT, "parameters": {"grammar": {"type": "json", "value": {"type": "foo"}}}},
         "grammar"),
        ("/generate", {"inputs": PROMPT, "parameters": {"grammar": {"type": "yaml", "value": "x"}}}, "grammar"),
        ("/generate", {"inputs": PROMPT, "parameters": {"response_format": {"type": "json_object",
                                                                            "schema": {"type": "foo"}}}},
         "response_format"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "response_format"),
    ]
    for path, body, field in cases:
        r = httpx.post(f"{url}{path}", json=body, timeout=REQUEST_TIMEOUT_S)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        assert field in r.text, r.text
    # The server still answers.
    assert post(url, "/generate", inputs=PROMPT, parameters={"max_new_tokens": 2}).status_code == 200


def test_grammars_that_cannot_be_enforced_are_refused_and_ref_loops_mean_any_json(grammar_server):
    """The grammar bombs that compiled and then, by the model's first token, failed with llguidance's parser
    state, failed after the first streamed token, or answered an empty 200."""
    url = grammar_server.url
    bombs = [
        ("/generate", {"grammar": {"type": "regex", "value": "a{1000000}"}}, "grammar.value"),
        ("/generate_stream", {"grammar": {"type": "regex", "value": "(a{1000}){1000}"}}, "grammar.value"),
        ("/generate", {"grammar": {"type": "json", "value": {"$defs": {"n": {
            "type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}}, "$ref": "#/$defs/n"}}},
         "grammar.value"),
    ]
    for path, parameters, field in bombs:
        r = post(url, path, inputs=PROMPT, parameters={"max_new_tokens": 4, **parameters})
        assert r.status_code == 422, (parameters, r.status_code, r.text)
        assert r.json()["error"].startswith(f"`{field}` cannot be enforced") and "<state>" not in r.text, r.text
    r = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^a{1000000}$"}}})
    assert r.status_code == 400 and "cannot be enforced" in r.json()["error"]["message"], r.text
    for schema in ({"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                   "$ref": "#/$defs/a"}):
        for seed in range(3):
            r = post(url, "/generate", inputs=PROMPT, parameters={
                "grammar": {"type": "json", "value": schema}, "max_new_tokens": 60, "do_sample": True, "seed": seed,
                "details": True})
            assert r.status_code == 200, r.text
            text = r.json()["generated_text"]
            assert text, "an empty answer is not JSON"
            if r.json()["details"]["finish_reason"] == "eos_token":  # else cut by max_new_tokens: a JSON prefix
                json.loads(text)
    date = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"
    for seed in range(6):
        r = post(url, "/generate", inputs=PROMPT, parameters={
            "grammar": {"type": "regex", "value": date}, "max_new_tokens": 20, "do_sample": True, "seed": seed})
        assert r.status_code == 200 and re.fullmatch(r"(19|20)[0-9]{2}-[0-9]{2}-[0-9]{2}", r.json()["generated_text"])


CLIENTS_SCRIPT = """
import openai
from openai import OpenAI
import lorax
from text_generation import Client
from text_generation.types import Grammar, GrammarType

url, schema, regex, tool = ARGS["url"], ARGS["schema"], ARGS["regex"], ARGS["tool"]
out = {}
tgi = Client(url, timeout=60)
out["tgi_json"] = [tgi.generate(ARGS["prompt"], max_new_tokens=150, do_sample=True, seed=s,
                                grammar=Grammar(type=GrammarType.Json, value=schema)).generated_text for s in range(5)]
out["tgi_regex"] = tgi.generate(ARGS["prompt"], max_new_tokens=30,
                                grammar=Grammar(type=GrammarType.Regex, value=regex)).generated_text
lx = lorax.Client(url, timeout=60)
out["lorax"] = lx.generate(ARGS["prompt"], max_new_tokens=150, do_sample=True, seed=1,
                           response_format={"type": "json_object", "schema": schema}).generated_text
client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
messages = [{"role": "user", "content": "Describe the item as JSON."}]
out["chat_schema"] = [client.chat.completions.create(
    model="tgi", messages=messages, max_tokens=150, seed=s, temperature=1.0,
    response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": schema, "strict": True}},
).model_dump(mode="json") for s in range(5)]
out["chat_object"] = client.chat.completions.create(
    model="tgi", messages=messages, max_tokens=150, temperature=0, response_format={"type": "json_object"},
).model_dump(mode="json")
out["completion"] = client.completions.create(
    model="tgi", prompt=ARGS["prompt"], max_tokens=150, temperature=0,
    extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": schema}}},
).model_dump(mode="json")
out["required"] = [client.chat.completions.create(
    model="tgi", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool], tool_choice="required",
    parallel_tool_calls=False, max_tokens=120, seed=s, temperature=1.0).model_dump(mode="json") for s in range(5)]
out["named"] = client.chat.completions.create(
    model="tgi", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
    tool_choice={"type": "function", "function": {"name": tool["function"]["name"]}}, max_tokens=120,
    temperature=0).model_dump(mode="json")
try:
    client.chat.completions.create(model="tgi", messages=messages, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}})
    out["bad"] = None
except openai.BadRequestError as e:
    out["bad"] = [e.status_code, e.message]
print(json.dumps(out))
"""


def test_published_clients_get_outputs_that_follow_their_schema(grammar_server, run_client):
    out = run_client(CLIENTS_SCRIPT, url=grammar_server.url, schema=SCHEMA, regex=REGEX, tool=WEATHER_TOOL,
                     prompt=PROMPT)
    for text in out["tgi_json"] + [out["lorax"]]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(REGEX, out["tgi_regex"])
    for answer in out["chat_schema"]:
        choice = answer["choices"][0]
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        assert choice["finish_reason"] == "stop"
    # Any JSON object: a random model may still be inside a string when max_tokens ends it (`length`).
    choice = out["chat_object"]["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")
    jsonschema.validate(json.loads(out["completion"]["choices"][0]["text"]), SCHEMA)
    parameters = WEATHER_TOOL["function"]["parameters"]
    for answer in out["required"] + [out["named"]]:
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert calls and all(c["function"]["name"] == WEATHER_TOOL["function"]["name"] for c in calls)
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)
    assert out["bad"][0] == 400 and "response_format" in out["bad"][1]
