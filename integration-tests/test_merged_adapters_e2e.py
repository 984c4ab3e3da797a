"""LoRAX's `merged_adapters` through the whole stack: over /generate, /generate_stream, the OpenAI routes and the
published `lorax-client`, with prompt-lookup speculation on, merged once and then served from the cache."""

from __future__ import annotations

import httpx
import pytest
from wire import generate, generate_stream, metric

from specula_testing.adapters import build_lora_adapter

PROMPT = "def add(a, b):\n    return a + b\n"
MERGE = {"ids": ["code-lora", "style-lora"], "weights": [0.6, 0.8], "merge_strategy": "ties", "density": 0.5,
         "majority_sign_method": "total"}

LORAX_SCRIPT = """
import lorax
from lorax.types import MergedAdapters

client, prompt = lorax.Client(ARGS["url"], timeout=60), ARGS["prompt"]
merge = MergedAdapters(**ARGS["merge"])
out = {"generate": client.generate(prompt, merged_adapters=merge, max_new_tokens=16).generated_text,
       "stream": "".join(e.token.text for e in client.generate_stream(prompt, merged_adapters=merge,
                                                                      max_new_tokens=16) if not e.token.special)}
try:
    client.generate(prompt, merged_adapters=MergedAdapters(**{**ARGS["merge"], "merge_strategy": "dare_ties",
                                                               "density": 0.0}), max_new_tokens=2)
except Exception as e:
    out["error"] = [f"{type(e).__module__}.{type(e).__name__}", str(e)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def merge_server(model_dir, tmp_path_factory):
    from conftest import _start, _stop

    adapters = tmp_path_factory.mktemp("merge-adapters")
    build_lora_adapter(model_dir, adapters / "code-lora", rank=8, std=0.2, seed=1)
    build_lora_adapter(model_dir, adapters / "style-lora", rank=8, std=0.2, seed=2)
    launcher = _start(model_dir, tmp_path_factory.mktemp("merge-run"),
                      ["--speculative-tokens", "4", "--speculation-mode", "fixed", "--adapter-dir", str(adapters),
                       "--adapter-source", "local", "--max-active-adapters", "3"], "merged-adapters")
    yield launcher
    _stop(launcher)
    launcher.close()


def test_merged_adapters_over_http_openai_and_the_lorax_client(merge_server, run_client):
    url = merge_server.url
    texts = {name: generate(url, PROMPT, max_new_tokens=16, **parameters).json()["generated_text"]
             for name, parameters in (("base", {}), ("code", {"adapter_id": "code-lora"}),
                                      ("merged", {"merged_adapters": MERGE}))}
    assert texts["merged"] != texts["base"] and texts["merged"] != texts["code"], texts
    response, events = generate_stream(url, PROMPT, max_new_tokens=16, merged_adapters=MERGE)
    assert events[-1]["generated_text"] == texts["merged"]
    completion = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tgi", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "merged_adapters": MERGE})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == texts["merged"]
    out = run_client(LORAX_SCRIPT, url=url, prompt=PROMPT, merge=MERGE)
    assert out["generate"] == out["stream"] == texts["merged"], out
    assert out["error"][0] == "lorax.errors.ValidationError" and "merged_adapters.density" in out["error"][1], out
    assert metric(url, "specula_adapter_merge_requests_total", cache="miss") == 1
    assert metric(url, "specula_adapter_merge_requests_total", cache="hit") == 4
    assert metric(url, "specula_request_success_total", adapter="merged") == 5


def test_a_merge_of_one_adapter_is_that_adapter_and_conflicts_are_422(merge_server):
    url = merge_server.url
    alone = generate(url, PROMPT, max_new_tokens=16, adapter_id="style-lora").json()["generated_text"]
    merged = generate(url, PROMPT, max_new_tokens=16, merged_adapters={"ids": ["style-lora"], "weights": [1.0]})
    assert merged.status_code == 200 and merged.json()["generated_text"] == alone, merged.text
    both = generate(url, PROMPT, max_new_tokens=2, adapter_id="code-lora", merged_adapters=MERGE)
    assert both.status_code == 422 and both.json() == {
        "error": "at most one of `adapter_id` or `adapters` may be provided", "error_type": "validation"}
    missing = generate(url, PROMPT, max_new_tokens=2, merged_adapters={"ids": ["code-lora", "nope"],
                                                                     "weights": [1.0, 1.0]})
    assert missing.status_code == 424 and "nope" in missing.json()["error"], missing.text
