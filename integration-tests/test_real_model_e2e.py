"""The README's real-model quick start, run as written: SmolLM2-135M-Instruct's GGUF served by the launcher, asked
through curl's requests, the published `text-generation` client and the official `openai` client.

The answers asserted here are the ones README.md shows; if the model's output changes, both change together.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from stack import LauncherProcess, started, stopped

from specula_testing.real_model import fetch_smollm2

pytestmark = pytest.mark.real_model

CAPITAL_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CAPITAL_ANSWER = "The capital of France is Paris."
PLANETS_PROMPT = "<|im_start|>user\nName the planets of the solar system.<|im_end|>\n<|im_start|>assistant\n"
PLANETS_ANSWER = ("The planets of the solar system are:\n\nMercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus, "
                  "Neptune, and Pluto.")


@pytest.fixture(scope="module")
def real_server(tmp_path_factory) -> Iterator[LauncherProcess]:
    launcher = started(LauncherProcess(fetch_smollm2(), tmp_path_factory.mktemp("real"),
                                       ["--speculative-tokens", "4", "--kv-cache-memory", "256MiB"], "real-model"))
    yield launcher
    stopped(launcher)


def test_chat_completions_answer_the_readme_question(real_server):
    response = httpx.post(f"{real_server.url}/v1/chat/completions", timeout=60, json={
        "model": "tgi", "messages": CAPITAL_QUESTION, "max_tokens": 32, "temperature": 0})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (CAPITAL_ANSWER, "stop")


def test_generate_and_generate_stream_answer_the_readme_prompt(real_server):
    body = {"inputs": PLANETS_PROMPT, "parameters": {"max_new_tokens": 64}}
    response = httpx.post(f"{real_server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["generated_text"] == PLANETS_ANSWER
    with httpx.stream("POST", f"{real_server.url}/generate_stream", json=body, timeout=60) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data:")]
    assert '"generated_text":' in events[-1] and "Neptune, and Pluto." in events[-1]


def test_the_published_clients_get_the_readme_answers(real_server, run_client):
    result = run_client("""
        from openai import OpenAI
        from text_generation import Client

        tgi = Client(ARGS["url"], timeout=60)
        client = OpenAI(base_url=ARGS["url"] + "/v1", api_key="unused")
        chat = client.chat.completions.create(model="tgi", messages=ARGS["messages"], max_tokens=32, temperature=0)
        print(json.dumps({"tgi": tgi.generate(ARGS["prompt"], max_new_tokens=64).generated_text,
                          "openai": chat.choices[0].message.content}))
    """, url=real_server.url, prompt=PLANETS_PROMPT, messages=CAPITAL_QUESTION)
    assert result == {"tgi": PLANETS_ANSWER, "openai": CAPITAL_ANSWER}
