"""The OpenAI-compatible routes over a fake worker: shapes, streaming, n, logprobs, adapters as models, errors.

The fake's k-th token is "t{k} " (an adapter's: "{adapter}:t{k} "), so every answer is known in advance.
"""

from __future__ import annotations

import asyncio
import json
import random

import fake_worker
import httpx
import pytest
import tokenizers
import transformers
from fake_worker import AdapterBehaviour, FakeClient

from specula_router.adapters import AdapterManager
from specula_router.block_allocator import BlockAllocator
from specula_router.chat_template import ChatTemplate
from specula_router.entries import TokenOut
from specula_router.metrics import Metrics
from specula_router.openai_models import OpenAISettings
from specula_router.scheduler import Scheduler, SchedulerConfig
from specula_router.server import RouterState, create_app
from specula_router.validation import Validator
from specula_router.validation_limits import ValidationLimits
from specula_testing.chat_templates import (
    CHATML,
    MISTRAL,
    QWEN_TOOLS,
    WEATHER_TOOL,
    add_chat_template,
)
from specula_testing.tokenizer import build_tokenizer

MODEL = "org/base-model"
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.fixture
def adapter_dir(tmp_path):
    (tmp_path / "camel").mkdir()
    (tmp_path / "camel" / "adapter_config.json").write_text("{}")
    (tmp_path / "heads").mkdir()
    (tmp_path / "heads" / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    (tmp_path / "draft").mkdir()  # a speculator beside the adapters: not a model to name
    (tmp_path / "draft" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return tmp_path


def make_state(tokenizer, template=CHATML, adapter_dirs=(), max_concurrent=16, step_delay=0.0, adapters=None,
               preloaded=(), limits=None):
    metrics = Metrics()
    client = FakeClient(step_delay)
    client.adapters.update(adapters or {})
    manager = AdapterManager(client, metrics, 8)
    scheduler = Scheduler(client, BlockAllocator(512, 16), SchedulerConfig(max_batch_prefill_tokens=2048), metrics,
                          manager)
    validator = Validator(tokenizer, limits or ValidationLimits(max_input_tokens=100, max_total_tokens=200),
                          rng=random.Random(0))
    info = {"model_id": MODEL, "version": "0.1.0", "adapters": {"preloaded_adapter_ids": list(preloaded)}}
    settings = OpenAISettings(ChatTemplate.from_text(template, {"bos_token": "<s>", "eos_token": "</s>"})
                              if template else None, tuple(adapter_dirs))
    return RouterState(scheduler, validator, client, metrics, info, max_concurrent, "cpu", openai=settings)


def call(state, fn, payload_limit=2_000_000):
    async def body():
        app = create_app(state, payload_limit=payload_limit)
        loop = asyncio.create_task(state.scheduler.run())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
                return await fn(client)
        finally:
            loop.cancel()

    return asyncio.run(body())


def capture(state, monkeypatch) -> list:
    """The validated requests the routes submit to the scheduler, in order."""
    submitted = []
    submit = state.scheduler.submit
    monkeypatch.setattr(state.scheduler, "submit", lambda r: submitted.append(r) or submit(r))
    return submitted


def chunks(response: httpx.Response) -> list:
    """The SSE payloads of an OpenAI stream: `data: {json}` events, the last one `data: [DONE]`."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", response.text[-200:]
    assert all(e.startswith("data: ") for e in events[:-1])
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_chat_completion_has_openai_shape_usage_and_headers(tokenizer):
    async def fn(client):
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
        assert isinstance(body["created"], int) and body["model"] == MODEL and body["system_fingerprint"]
        assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "t0 t1 t2 "},
                                    "logprobs": None, "finish_reason": "length"}]
        prompt = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n" \
                 "<|im_start|>assistant\n"
        prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False).ids)  # no second BOS
        assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                                 "total_tokens": prompt_tokens + 3}
        assert r.headers["x-generated-tokens"] == "3" and r.headers["x-prompt-tokens"] == str(prompt_tokens)
        assert r.headers["x-compute-type"] == "cpu" and "x-queue-time" in r.headers

    call(make_state(tokenizer), fn)


def test_chat_stream_deltas_join_to_the_content_and_usage_comes_last(tokenizer):
    async def fn(client):
        payload = {"messages": CHAT, "max_completion_tokens": 4, "stop": ["t3"]}
        full = (await client.post("/v1/chat/completions", json=payload)).json()
        r = await client.post("/v1/chat/completions", json={**payload, "stream": True,
                                                             "stream_options": {"include_usage": True}})
        events = chunks(r)
        *deltas, last = events
        assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
        assert all(e["usage"] is None and len(e["choices"]) == 1 for e in deltas)
        assert all(e["choices"][0]["delta"]["role"] == "assistant" for e in deltas)
        assert "".join(e["choices"][0]["delta"]["content"] or "" for e in deltas) == \
            full["choices"][0]["message"]["content"] == "t0 t1 t2 "  # the stop sequence is left out
        assert [e["choices"][0]["finish_reason"] for e in deltas][-1] == "length"
        assert last["choices"] == [] and last["usage"] == full["usage"]

    call(make_state(tokenizer), fn)


def test_n_choices_and_logprobs_with_top_logprobs(tokenizer):
    async def fn(client):
        r = await client.post("/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 2, "n": 3, "logprobs": True, "top_logprobs": 2, "seed": 7,
            "temperature": 0.7})
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert body["usage"]["completion_tokens"] == 6
        content = body["choices"][1]["logprobs"]["content"]
        assert [(t["token"], t["logprob"], t["bytes"]) for t in content] == [("t0 ", -0.5, [116, 48, 32]),
                                                                             ("t1 ", -0.5, [116, 49, 32])]
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "n": 2,
                                                            "stream": True})
        events = chunks(r)
        for index in (0, 1):
            mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
            assert "".join(c["delta"]["content"] or "" for c in mine) == "t0 t1 "
            assert mine[-1]["finish_reason"] == "length"

    state = make_state(tokenizer)
    call(state, fn)
    assert state.in_flight == 0


def test_temperature_zero_is_greedy_and_absent_samples(tokenizer, monkeypatch):
    state = make_state(tokenizer)
    submitted = []
    submit = state.scheduler.submit
    monkeypatch.setattr(state.scheduler, "submit", lambda r: submitted.append(r) or submit(r))

    async def fn(client):
        for extra in ({"temperature": 0, "top_p": 0.5, "ignore_eos_token": True}, {}, {"seed": 5, "n": 2}):
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text

    call(state, fn)
    greedy, default, *seeded = submitted
    assert not greedy.sampling.do_sample and greedy.sampling.top_p == 1.0 and greedy.stopping.ignore_eos_token
    assert not default.stopping.ignore_eos_token
    assert default.sampling.do_sample and default.sampling.temperature == 1.0
    assert [r.sampling.seed for r in seeded] == [5, 6]


def test_completions_of_several_prompts_with_echo_and_logprobs(tokenizer):
    async def fn(client):
        r = await client.post("/v1/completions", json={"prompt": ["a", "bb"], "max_tokens": 2, "n": 2,
                                                      "echo": True, "logprobs": 0})
        body = r.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert [(c["index"], c["text"]) for c in body["choices"]] == [
            (0, "at0 t1 "), (1, "at0 t1 "), (2, "bbt0 t1 "), (3, "bbt0 t1 ")]
        logprobs = body["choices"][0]["logprobs"]
        assert logprobs["tokens"][-2:] == ["t0 ", "t1 "] and logprobs["token_logprobs"][-2:] == [-0.5, -0.5]
        assert logprobs["text_offset"][-2:] == [1, 4]
        prompt_tokens = sum(len(tokenizer.encode(p).ids) for p in ("a", "bb"))
        assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 8,
                                 "total_tokens": prompt_tokens + 8}
        default = (await client.post("/v1/completions", json={"prompt": "x"})).json()
        assert default["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True, "echo": True})
        events = chunks(r)
        assert "".join(e["choices"][0]["text"] for e in events) == "xt0 t1 t2 "
        assert events[-1]["choices"][0]["finish_reason"] == "length"

    call(make_state(tokenizer), fn)


def test_models_lists_base_loaded_preloaded_and_local_adapters(tokenizer, adapter_dir):
    async def fn(client):
        await client.post("/generate", json={"inputs": "x", "parameters": {"adapter_id": "org/lora",
                                                                           "max_new_tokens": 1}})
        body = (await client.get("/v1/models")).json()
        assert body["object"] == "list"
        assert [m["id"] for m in body["data"]] == [MODEL, "org/lora", "org/pre", "camel", "heads"]
        base, *adapters = body["data"]
        assert base["owned_by"] and isinstance(base["created"], int) and base["parent"] is None
        assert all(m["parent"] == MODEL and m["root"] == MODEL and m["object"] == "model" for m in adapters)
        assert (await client.get("/v1/models/org/lora")).json()["id"] == "org/lora"
        error = openai_error(await client.get("/v1/models/nope"), 404)
        assert error["code"] == "model_not_found"

    call(make_state(tokenizer, adapter_dirs=[adapter_dir], preloaded=["org/pre"]), fn)


def test_an_adapter_is_chosen_by_model_and_an_unknown_model_is_404(tokenizer, adapter_dir):
    state = make_state(tokenizer, adapter_dirs=[adapter_dir])

    async def fn(client):
        r = await client.post("/v1/completions", json={"model": "camel", "prompt": "x", "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == "camel:t0 camel:t1 " and r.json()["model"] == "camel"
        for base in ("tgi", "", MODEL):
            r = await client.post("/v1/completions", json={"model": base, "prompt": "x", "max_tokens": 1})
            assert r.json()["choices"][0]["text"] == "t0 "
        error = openai_error(await client.post("/v1/chat/completions", json={"model": "org/typo", "messages": CHAT}),
                             404)
        assert error == {"message": error["message"], "type": "invalid_request_error", "param": "model",
                         "code": "model_not_found"} and "org/typo" in error["message"]
        r = await client.post("/v1/completions", json={"model": "org/hub-lora", "adapter_source": "hub",
                                                      "prompt": "x", "max_tokens": 1})
        assert r.json()["choices"][0]["text"] == "org/hub-lora:t0 "
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "adapter_id": "camel",
                                                      "adapter_source": "local"})
        assert r.json()["choices"][0]["text"] == "camel:t0 "

    call(state, fn)
    sources = {r.adapter_id: r.adapter_source for r in state.client.load_requests}
    assert sources == {"camel": "local", "org/hub-lora": "hub"}


def test_validation_errors_name_the_openai_field_and_the_limit(tokenizer):
    async def fn(client):
        error = openai_error(await client.post("/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 500}), 422)
        assert error["param"] == "max_tokens" and "`max_tokens`" in error["message"] and "200" in error["message"]
        assert error["type"] == "invalid_request_error" and error["code"] == "validation"
        error = openai_error(await client.post("/v1/chat/completions", json={
            "messages": CHAT, "max_completion_tokens": 500}), 422)
        assert error["param"] == "max_completion_tokens"
        error = openai_error(await client.post("/v1/completions", json={"prompt": "x", "temperature": -1}), 422)
        assert error["param"] == "temperature"
        error = openai_error(await client.post("/v1/chat/completions", json={
            "messages": CHAT, "logprobs": True, "top_logprobs": 9}), 422)
        assert error["param"] == "top_logprobs" and "5" in error["message"]
        error = openai_error(await client.post("/v1/completions", json={"prompt": "x", "speculative_tokens": 2}), 422)
        assert error["param"] == "speculative_tokens"  # Specula's extra goes through the same validation
        error = openai_error(await client.post("/v1/completions", json={"prompt": ""}), 422)
        assert "`prompt`" in error["message"]
        error = openai_error(await client.post("/v1/completions", json={"prompt": "x", "n": 17}), 422)
        assert error["param"] == "n" and "16" in error["message"]
        error = openai_error(await client.post("/v1/chat/completions", json={"messages": "hi"}), 422)
        assert error["param"] == "messages"
        error = openai_error(await client.post("/v1/chat/completions", content=b"{oops",
                                               headers={"content-type": "application/json"}), 422)
        assert "JSON" in error["message"]

    call(make_state(tokenizer), fn)


def test_a_field_is_checked_even_where_the_request_ignores_it(tokenizer, monkeypatch):
    """The OpenAPI document gives each field one range: a greedy request's `top_p`, `top_logprobs` without
    `logprobs`, the base model's `adapter_source` and a `max_completion_tokens` of 0 are refused as elsewhere."""
    state = make_state(tokenizer)
    submitted = []
    submit = state.scheduler.submit
    monkeypatch.setattr(state.scheduler, "submit", lambda r: submitted.append(r) or submit(r))

    async def fn(client):
        for payload, param in (({"temperature": 0, "top_p": 2.0}, "top_p"), ({"temperature": 0, "top_k": 0}, "top_k"),
                               ({"top_logprobs": 9}, "top_logprobs"), ({"adapter_source": "s3"}, "adapter_source"),
                               ({"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens")):
            error = openai_error(await client.post("/v1/chat/completions", json={"messages": CHAT, **payload}), 422)
            assert error["param"] == param, (payload, error)
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "temperature": 0,
                                                            "top_p": 0.5, "top_k": 3, "top_logprobs": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None

    call(state, fn)
    (greedy,) = submitted  # warpers checked, then dropped: greedy, and no alternatives without `logprobs`
    assert not greedy.sampling.do_sample and (greedy.sampling.top_p, greedy.sampling.top_k) == (1.0, 0)
    assert greedy.top_n_tokens == 0


def test_unsupported_features_are_400_naming_the_field(tokenizer):
    async def fn(client):
        cases = [("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
                 ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
                 ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                     {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content[0].type")]
        for path, payload, param in cases:
            error = openai_error(await client.post(path, json=payload), 400)
            assert error["param"] == param and error["code"] == "unsupported"
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "user": "u1",
                                                            "response_format": {"type": "text"}, "logit_bias": {}})
        assert r.status_code == 200

    call(make_state(tokenizer), fn)


def test_logit_bias_reaches_the_workers_from_both_routes_and_generate(tokenizer):
    state = make_state(tokenizer)

    async def fn(client):
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "temperature": 0,
                                                            "logit_bias": {"5": -100, "7": 2.5, "9": 0}})
        assert r.status_code == 200, r.text
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 2,
                                                       "logit_bias": {"11": 100}})
        assert r.status_code == 200, r.text
        r = await client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1,
                                                                               "logit_bias": {"3": -1}}})
        assert r.status_code == 200, r.text

    call(state, fn)
    sent = state.client.prefilled
    assert [dict(r.sampling.logit_bias) for r in sent] == [{5: -100.0, 7: 2.5}, {11: 100.0}, {11: 100.0}, {3: -1.0}]
    assert not sent[0].sampling.do_sample  # a bias alone keeps a greedy request greedy


def test_invalid_logit_bias_is_a_422_naming_it(tokenizer):
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    state = make_state(tokenizer)

    async def fn(client):
        cases = (({str(vocab): 1}, f"[0, {vocab - 1}]"), ({"-1": 1}, "token ids"), ({"abc": 1}, "token ids"),
                 ({"5": 101}, "<= 100"), ({"5": -100.5}, ">= -100"), ({str(i): 1 for i in range(301)}, "at most 300"))
        for bias, words in cases:
            for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "x"})):
                error = openai_error(await client.post(path, json={**body, "logit_bias": bias}), 422)
                assert error["param"] == "logit_bias" and error["code"] == "validation", error
                assert "`logit_bias`" in error["message"] and words in error["message"], error
        error = openai_error(await client.post("/v1/completions", json={"prompt": "x", "logit_bias": {"5": "high"}}),
                             422)
        assert error["param"].startswith("logit_bias"), error  # a wrong type: the parser's error, same shape
        r = await client.post("/generate", json={"inputs": "x", "parameters": {"logit_bias": {"5": 101}}})
        assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
        assert "`logit_bias`" in r.json()["error"]

    call(state, fn)
    assert not state.client.prefilled  # nothing reached the workers


def test_chat_template_errors(tokenizer):
    async def fn(client):
        bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        error = openai_error(await client.post("/v1/chat/completions", json={"messages": bad}), 422)
        assert "Conversation roles must alternate" in error["message"] and error["param"] == "messages"
        parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
        r = await client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
            tokenizer.encode("<s>[INST] a\nb [/INST]", add_special_tokens=False).ids)

    call(make_state(tokenizer, template=MISTRAL), fn)

    async def no_template(client):
        error = openai_error(await client.post("/v1/chat/completions", json={"messages": CHAT}), 400)
        assert "--chat-template" in error["message"]
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200  # completions need no template

    call(make_state(tokenizer, template=None), no_template)


@pytest.mark.parametrize("template, reason", [
    # Each sized from the client's messages, so a client reaches it: before, a 500.
    ("{% for i in range(messages|length * 10000000) %}x{% endfor %}", "OverflowError"),
    ("{% macro f(n) %}{{ f(n + messages|length) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{{ messages[0].content * 100000000000 }}", "OverflowError"),
    ("{{ 10 ** (messages|length * 10000000) }}", "OverflowError"),
])
def test_any_failure_while_rendering_the_template_is_a_422_for_that_request(tokenizer, caplog, template, reason):
    async def fn(client):
        error = openai_error(await client.post("/v1/chat/completions", json={"messages": CHAT}), 422)
        assert error["param"] == "messages" and error["code"] == "chat_template", error
        assert reason in error["message"] and len(error["message"]) < 400, error
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200  # the server goes on

    with caplog.at_level("WARNING", logger="specula.router.chat"):
        call(make_state(tokenizer, template=template), fn)
    assert any(reason in record.getMessage() for record in caplog.records)


def test_errors_outside_the_routes_take_the_openai_shape_on_v1_only(tokenizer):
    async def fn(client):
        assert openai_error(await client.get("/v1/nothing"), 404)["code"] == "not_found"
        assert openai_error(await client.get("/v1/chat/completions"), 405)["code"] == "method_not_allowed"
        assert openai_error(await client.post("/v1/completions", json={"prompt": "x" * 2000}), 413)[
            "code"] == "payload_limit"
        r = await client.get("/nothing")
        assert r.status_code == 404 and r.json()["error_type"] == "not_found"  # TGI routes keep their shape

    call(make_state(tokenizer), fn, payload_limit=1000)


def test_overload_is_429_and_worker_failures_424(tokenizer):
    state = make_state(tokenizer, max_concurrent=1, step_delay=0.01)

    async def fn(client):
        slow = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 30}))
        await asyncio.sleep(0.05)
        error = openai_error(await client.post("/v1/completions", json={"prompt": "b", "max_tokens": 1}), 429)
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
        assert (await slow).status_code == 200
        state.client.fail_next = "prefill"
        error = openai_error(await client.post("/v1/chat/completions", json={"messages": CHAT}), 424)
        assert error["type"] == "server_error" and "shard exploded" in error["message"]
        state.client.fail_next = "decode"
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "stream": True})
        events = chunks(r)
        assert events[0]["choices"][0]["delta"]["content"] == "t0 "
        assert "shard exploded" in events[-1]["error"]["message"]

    call(state, fn)
    assert state.in_flight == 0


def test_a_failed_adapter_load_is_an_http_error_before_the_stream(tokenizer):
    adapters = {"org/missing": AdapterBehaviour(delay=0.05, error="adapter `org/missing`: repository not found"),
                "../etc": AdapterBehaviour(error="adapter `../etc` is outside the adapter directories", status=400)}

    async def fn(client):
        for stream in (False, True):
            body = {"messages": CHAT, "adapter_source": "hub", "stream": stream}
            error = openai_error(await client.post("/v1/chat/completions", json={**body, "model": "org/missing"}),
                                 424)
            assert "repository not found" in error["message"]
            error = openai_error(await client.post("/v1/chat/completions", json={**body, "model": "../etc"}), 400)
            assert "outside" in error["message"]

    state = make_state(tokenizer, adapters=adapters)
    call(state, fn)
    assert state.in_flight == 0


def test_tool_calls_are_parsed_in_answers_and_streams(tokenizer, monkeypatch):
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = [answer[i:i + 7] for i in range(0, len(answer), 7)]
    monkeypatch.setattr(fake_worker, "token_text", lambda adapter_id, k: pieces[k])

    async def fn(client):
        payload = {"messages": CHAT, "tools": [WEATHER_TOOL], "max_tokens": len(pieces)}
        choice = (await client.post("/v1/chat/completions", json=payload)).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call_,) = choice["message"]["tool_calls"]
        assert call_["id"].startswith("call_") and call_["type"] == "function"
        assert call_["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        events = chunks(await client.post("/v1/chat/completions", json={**payload, "stream": True}))
        (only,) = events  # held back until the end, then one chunk with the call
        delta = only["choices"][0]["delta"]
        assert delta["tool_calls"][0]["index"] == 0 and delta["tool_calls"][0]["function"]["name"] == "get_weather"
        assert only["choices"][0]["finish_reason"] == "tool_calls"
        plain = (await client.post("/v1/chat/completions", json={**payload, "tool_choice": "none"})).json()
        assert plain["choices"][0]["message"]["content"] == answer  # no tools: nothing is parsed

    call(make_state(tokenizer), fn)


def test_openai_requests_are_counted_in_the_metrics(tokenizer, adapter_dir):
    async def fn(client):
        for _ in range(2):  # the first is counted as `other`: an adapter gets its label once loaded
            await client.post("/v1/completions", json={"model": "camel", "prompt": "x", "max_tokens": 1})
        await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        await client.post("/v1/completions", json={"prompt": "x", "temperature": -1})
        return (await client.get("/metrics")).text

    text = call(make_state(tokenizer, adapter_dirs=[adapter_dir]), fn)
    assert 'specula_request_count_total{adapter=""} 1.0' in text
    assert 'specula_request_count_total{adapter="camel"} 1.0' in text
    assert 'specula_request_count_total{adapter="other"} 1.0' in text
    assert 'specula_request_failure_total{adapter="",err="validation"} 1.0' in text


def test_openapi_document_lists_the_openai_routes(tokenizer):
    async def fn(client):
        spec = (await client.get("/api-doc/openapi.json")).json()
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}"} <= set(spec["paths"])
        assert "ChatCompletionRequest" in spec["components"]["schemas"]

    call(make_state(tokenizer), fn)


@pytest.mark.parametrize("n", [1, 2])
def test_a_waiting_chat_stream_sends_keep_alive_comments(tokenizer, monkeypatch, n):
    """As /generate_stream: SSE comments while no token comes (one choice, or several merged), skipped by clients,
    so the chunks are unchanged."""
    from specula_router import responses

    monkeypatch.setattr(responses, "KEEPALIVE_S", 0.01)

    async def fn(client):
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "n": n,
                                                             "stream": True})
        assert r.status_code == 200 and ": keep-alive\n\n" in r.text
        events = chunks(httpx.Response(200, headers=r.headers, text=r.text.replace(": keep-alive\n\n", "")))
        content = ["".join(e["choices"][0]["delta"].get("content") or "" for e in events
                           if e["choices"][0]["index"] == i) for i in range(n)]
        assert content == ["t0 t1 "] * n

    call(make_state(tokenizer, step_delay=0.05), fn)


def test_speculative_tokens_reach_the_request_from_both_routes(tokenizer, monkeypatch):
    """`extra_body={"speculative_tokens": k}`: 0 (speculation off) is kept as 0, not dropped as falsy."""
    state = make_state(tokenizer, limits=ValidationLimits(max_input_tokens=100, max_total_tokens=200,
                                                          max_speculative_tokens=4))
    submitted = capture(state, monkeypatch)

    async def fn(client):
        for extra in ({"speculative_tokens": 0}, {"speculative_tokens": 2}, {}):
            r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text

    call(state, fn)
    assert [r.speculative_tokens for r in submitted] == [0, 0, 2, 2, None, None]
    sent = state.client.prefilled  # the workers see 0 as set (speculation off), absent as unset (test_client)
    assert [r.speculative_tokens for r in sent] == [0, 0, 2, 2, None, None]


def test_openai_tool_conversation_renders_as_transformers_does(tmp_path, monkeypatch):
    """An OpenAI conversation (a `developer` message, an assistant's `tool_calls` with JSON-string `arguments`, a
    `tool` answer) gives the prompt ids of `apply_chat_template` on the conversation a template expects."""
    build_tokenizer(tmp_path)
    add_chat_template(tmp_path, "qwen_tools")
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    state = make_state(tokenizer, template=QWEN_TOOLS,
                       limits=ValidationLimits(max_input_tokens=4000, max_total_tokens=4096))
    submitted = capture(state, monkeypatch)
    call_ = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    answer = {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "temp_c": 21}'}
    messages = [{"role": "developer", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call_]}, answer]

    async def fn(client):
        r = await client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER_TOOL],
                                                            "max_tokens": 1})
        assert r.status_code == 200, r.text

    call(state, fn)
    expected = [{"role": "system", "content": "You are terse."}, messages[1],
                {"role": "assistant", "content": None, "tool_calls": [
                    {**call_, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, answer]
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    (request,) = submitted
    assert request.inputs == reference.apply_chat_template(expected, tools=[WEATHER_TOOL], add_generation_prompt=True,
                                                           tokenize=False)
    assert list(request.input_ids) == reference.apply_chat_template(
        expected, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert '"arguments": {"city": "Paris"}' in request.inputs and "You are terse.\n\n# Tools" in request.inputs


def test_a_single_stop_string_is_one_stop_sequence(tokenizer, monkeypatch):
    state = make_state(tokenizer)
    submitted = capture(state, monkeypatch)

    async def fn(client):
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "stop": "t2"})
        assert r.json()["choices"][0]["message"]["content"] == "t0 t1 "
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stop": "t2"})
        assert r.json()["choices"][0]["text"] == "t0 t1 "

    call(state, fn)
    assert [r.stopping.stop_sequences for r in submitted] == [("t2",), ("t2",)]
    assert [list(r.stopping.stop_sequences) for r in state.client.prefilled] == [["t2"], ["t2"]]


def test_frequency_and_presence_penalties_reach_the_request(tokenizer, monkeypatch):
    state = make_state(tokenizer)
    submitted = capture(state, monkeypatch)

    async def fn(client):
        penalties = {"frequency_penalty": 0.5, "presence_penalty": -1.25}
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, **penalties})
        assert r.status_code == 200, r.text
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "temperature": 0, **penalties})
        assert r.status_code == 200, r.text
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200, r.text

    call(state, fn)
    assert [(r.sampling.frequency_penalty, r.sampling.presence_penalty) for r in submitted] == [
        (0.5, -1.25), (0.5, -1.25), (0.0, 0.0)]
    assert [(r.sampling.frequency_penalty, r.sampling.presence_penalty) for r in state.client.prefilled] == [
        (0.5, -1.25), (0.5, -1.25), (0.0, 0.0)]


def test_chat_stream_chunks_carry_logprobs_with_top_logprobs(tokenizer, monkeypatch):
    generate = FakeClient._generate

    def with_alternatives(self, held):  # the worker's two alternatives for every token
        gen = generate(self, held)
        gen.top_tokens.append([TokenOut(1, "t", -0.25, False), TokenOut(2, "é", -1.5, False)])
        return gen

    monkeypatch.setattr(FakeClient, "_generate", with_alternatives)
    state = make_state(tokenizer)
    submitted = capture(state, monkeypatch)

    async def fn(client):
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "stream": True,
                                                            "logprobs": True, "top_logprobs": 2})
        return chunks(r)

    events = call(state, fn)
    assert submitted[0].top_n_tokens == 2 and state.client.prefilled[0].top_n_tokens == 2
    top = [{"token": "t", "logprob": -0.25, "bytes": [116]}, {"token": "é", "logprob": -1.5, "bytes": [195, 169]}]
    for event in events:
        (choice,) = event["choices"]
        (entry,) = choice["logprobs"]["content"]  # one per chunk: the token of its delta
        assert choice["logprobs"]["refusal"] is None
        assert entry == {"token": choice["delta"]["content"], "logprob": -0.5,
                         "bytes": list(choice["delta"]["content"].encode()), "top_logprobs": top}
    assert "".join(e["choices"][0]["delta"]["content"] for e in events) == "t0 t1 "


def test_a_medusa_adapter_is_chosen_by_model(tokenizer, adapter_dir, monkeypatch):
    state = make_state(tokenizer, adapter_dirs=[adapter_dir], adapters={"heads": AdapterBehaviour(kind="medusa")})
    submitted = capture(state, monkeypatch)

    async def fn(client):
        r = await client.post("/v1/chat/completions", json={"model": "heads", "messages": CHAT, "max_tokens": 2})
        assert r.json()["choices"][0]["message"]["content"] == "heads:t0 heads:t1 " and r.json()["model"] == "heads"

    call(state, fn)
    assert [(r.adapter_id, r.adapter_source) for r in submitted] == [("heads", "local")]
    assert [r.adapter_id for r in state.client.prefilled] == ["heads"]
    assert [(r.adapter_id, r.adapter_source) for r in state.client.load_requests] == [("heads", "local")]
