"""The published Python clients, unchanged, against the real stack.

`text-generation` (TGI) and `lorax-client` (LoRAX) post to `POST /` and parse the answers with their own
pydantic models; a field we name or type differently breaks them. Each test runs a small script with the
clients' interpreter (`clients_python`, see conftest.py) and compares what the client parsed with what the
server answers over raw HTTP.
"""

from __future__ import annotations

import httpx
from wire import LONG_GENERATION, REQUEST_TIMEOUT_S, generate, wait_idle

PROMPT = "The quick brown fox"


def raw(base_url: str, **parameters) -> dict:
    r = generate(base_url, PROMPT, details=True, **parameters)
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(details: dict) -> list[int]:
    return [t["id"] for t in details["tokens"]]


TEXT_GENERATION_SCRIPT = """
import asyncio
from text_generation import AsyncClient, Client

client, aclient, prompt = Client(ARGS["url"], timeout=60), AsyncClient(ARGS["url"], timeout=60), ARGS["prompt"]
out = {}
out["generate"] = client.generate(prompt, max_new_tokens=12, decoder_input_details=True,
                                  top_n_tokens=3).model_dump(mode="json")
seeded = dict(max_new_tokens=20, do_sample=True, temperature=1.3, seed=1234)
out["seeded"] = [client.generate(prompt, **seeded).model_dump(mode="json") for _ in range(2)]
out["stream"] = [e.model_dump(mode="json") for e in client.generate_stream(prompt, max_new_tokens=12)]

async def run_async():
    generated = await aclient.generate(prompt, max_new_tokens=12, decoder_input_details=True, top_n_tokens=3)
    stream = [e.model_dump(mode="json") async for e in aclient.generate_stream(prompt, max_new_tokens=12)]
    seeded_text = (await aclient.generate(prompt, **seeded)).generated_text
    return generated.model_dump(mode="json"), stream, seeded_text

out["async_generate"], out["async_stream"], out["async_seeded_text"] = asyncio.run(run_async())
print(json.dumps(out))
"""


def test_text_generation_client_generates_streams_and_reproduces_seeds(base_url, run_client):
    out = run_client(TEXT_GENERATION_SCRIPT, url=base_url, prompt=PROMPT)
    expected = raw(base_url, max_new_tokens=12, decoder_input_details=True, top_n_tokens=3)

    for generated in (out["generate"], out["async_generate"]):
        assert generated["generated_text"] == expected["generated_text"]
        d = generated["details"]
        assert d["finish_reason"] == expected["details"]["finish_reason"]
        assert d["generated_tokens"] == expected["details"]["generated_tokens"] == len(d["tokens"])
        assert token_ids(d) == token_ids(expected["details"])
        assert [p["id"] for p in d["prefill"]] == [p["id"] for p in expected["details"]["prefill"]]
        assert d["prefill"][0]["logprob"] is None and d["prefill"][1]["logprob"] < 0  # decoder_input_details
        assert [[t["id"] for t in top] for top in d["top_tokens"]] == \
            [[t["id"] for t in top] for top in expected["details"]["top_tokens"]]
        assert all(len(top) == 3 for top in d["top_tokens"])

    first, second = out["seeded"]
    assert first["generated_text"] == second["generated_text"] == out["async_seeded_text"]
    assert first["details"]["seed"] == 1234

    for stream in (out["stream"], out["async_stream"]):
        final = stream[-1]
        assert "".join(e["token"]["text"] for e in stream if not e["token"]["special"]) == final["generated_text"]
        assert final["generated_text"] == expected["generated_text"]
        assert final["details"]["generated_tokens"] == len(stream)
        assert final["details"]["finish_reason"] == expected["details"]["finish_reason"]
        assert all(e["generated_text"] is None for e in stream[:-1])


TEXT_GENERATION_ERRORS_SCRIPT = """
import asyncio
from text_generation import AsyncClient, Client

client, aclient, prompt = Client(ARGS["url"], timeout=60), AsyncClient(ARGS["url"], timeout=60), ARGS["prompt"]
cases = {
    "temperature": dict(temperature=-1),  # refused by the client's own model, before sending
    "top_n_tokens": dict(top_n_tokens=6),  # above the server's --max-top-n-tokens (5)
    "max_new_tokens": dict(max_new_tokens=100000),  # above max_total_tokens
    "stop": dict(stop_sequences=["a", "b", "c", "d", "e"]),  # above --max-stop-sequences (4)
}
out = {}

def caught(call):
    try:
        call()
    except Exception as e:
        return [f"{type(e).__module__}.{type(e).__name__}", str(e)]
    return None

for name, kwargs in cases.items():
    out[name] = caught(lambda: client.generate(prompt, **kwargs))
out["stream_stop"] = caught(lambda: list(client.generate_stream(prompt, stop_sequences=["a"] * 5)))
out["async_top_n_tokens"] = caught(lambda: asyncio.run(aclient.generate(prompt, top_n_tokens=6)))
print(json.dumps(out))
"""


def test_text_generation_client_raises_validation_errors(base_url, run_client):
    out = run_client(TEXT_GENERATION_ERRORS_SCRIPT, url=base_url, prompt=PROMPT)
    for case, field in (("temperature", "temperature"), ("top_n_tokens", "top_n_tokens"),
                        ("max_new_tokens", "max_new_tokens"), ("stop", "stop"), ("stream_stop", "stop"),
                        ("async_top_n_tokens", "top_n_tokens")):
        assert out[case] is not None, f"{case}: no error raised"
        kind, message = out[case]
        assert kind == "text_generation.errors.ValidationError", (case, kind, message)
        assert field in message, (case, message)


OVERLOAD_SCRIPT = """
import asyncio
import lorax
from text_generation import AsyncClient, Client

url, prompt = ARGS["url"], ARGS["prompt"]
out = {}

def caught(call):
    try:
        call()
    except Exception as e:
        return f"{type(e).__module__}.{type(e).__name__}"
    return None

out["text_generation"] = caught(lambda: Client(url, timeout=60).generate(prompt, max_new_tokens=1))
out["text_generation_stream"] = caught(lambda: list(Client(url, timeout=60).generate_stream(prompt, max_new_tokens=1)))
out["text_generation_async"] = caught(
    lambda: asyncio.run(AsyncClient(url, timeout=60).generate(prompt, max_new_tokens=1)))
out["lorax"] = caught(lambda: lorax.Client(url, timeout=60).generate(prompt, max_new_tokens=1))
print(json.dumps(out))
"""


def test_clients_raise_overloaded_error_on_429(overload_server, run_client):
    url = overload_server.url
    wait_idle(url)
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        with client.stream("POST", f"{url}/generate_stream",
                           json={"inputs": PROMPT, "parameters": LONG_GENERATION}) as stream:
            lines = stream.iter_lines()  # kept open: the server's one slot stays taken
            assert next(lines).startswith("data:")
            out = run_client(OVERLOAD_SCRIPT, url=url, prompt=PROMPT)
    assert out == {"text_generation": "text_generation.errors.OverloadedError",
                   "text_generation_stream": "text_generation.errors.OverloadedError",
                   "text_generation_async": "text_generation.errors.OverloadedError",
                   "lorax": "lorax.errors.OverloadedError"}
    wait_idle(url)


LORAX_SCRIPT = """
import asyncio
import lorax

client, prompt = lorax.Client(ARGS["url"], timeout=60), ARGS["prompt"]
out = {}
out["generate"] = client.generate(prompt, max_new_tokens=12, ignore_eos_token=True, decoder_input_details=True,
                                  return_k_alternatives=3).model_dump(mode="json")
seeded = dict(max_new_tokens=20, do_sample=True, temperature=1.3, seed=99)
out["seeded"] = [client.generate(prompt, **seeded).generated_text for _ in range(2)]
out["stream"] = [e.model_dump(mode="json") for e in client.generate_stream(prompt, max_new_tokens=12,
                                                                          ignore_eos_token=True)]

async def run_async():
    aclient = lorax.AsyncClient(ARGS["url"], timeout=60)
    generated = await aclient.generate(prompt, max_new_tokens=12, ignore_eos_token=True)
    stream = [e.model_dump(mode="json") async for e in aclient.generate_stream(prompt, max_new_tokens=12,
                                                                              ignore_eos_token=True)]
    return generated.model_dump(mode="json"), stream

out["async_generate"], out["async_stream"] = asyncio.run(run_async())

def caught(call):
    try:
        call()
    except Exception as e:
        return [f"{type(e).__module__}.{type(e).__name__}", str(e)]
    return None

out["adapter"] = caught(lambda: client.generate(prompt, adapter_id="org/some-lora", max_new_tokens=2))
out["adapter_stream"] = caught(lambda: list(client.generate_stream(prompt, adapter_id="org/some-lora")))
out["adapter_async"] = caught(lambda: asyncio.run(lorax.AsyncClient(ARGS["url"]).generate(
    prompt, adapter_id="org/some-lora", max_new_tokens=2)))
out["k_alternatives"] = caught(lambda: client.generate(prompt, return_k_alternatives=6))
out["temperature"] = caught(lambda: client.generate(prompt, temperature=-1))
out["base_model"] = client.generate(prompt, adapter_id="", max_new_tokens=3).generated_text
print(json.dumps(out))
"""


def test_lorax_client_generates_streams_and_maps_errors(base_url, run_client):
    out = run_client(LORAX_SCRIPT, url=base_url, prompt=PROMPT)
    expected = raw(base_url, max_new_tokens=12, ignore_eos_token=True, decoder_input_details=True,
                   return_k_alternatives=3)

    for generated in (out["generate"], out["async_generate"]):
        assert generated["generated_text"] == expected["generated_text"]
        d = generated["details"]
        assert d["prompt_tokens"] == expected["details"]["prompt_tokens"]  # lorax-client requires it
        assert d["generated_tokens"] == 12 == len(d["tokens"]) and d["finish_reason"] == "length"
        assert token_ids(d) == token_ids(expected["details"])
        assert all(isinstance(t["logprob"], float) for t in d["tokens"])
    d = out["generate"]["details"]
    assert [[a["id"] for a in t["alternative_tokens"]] for t in d["tokens"]] == \
        [[a["id"] for a in t["alternative_tokens"]] for t in expected["details"]["tokens"]]
    assert [p["id"] for p in d["prefill"]] == [p["id"] for p in expected["details"]["prefill"]]

    assert out["seeded"][0] == out["seeded"][1]
    for stream in (out["stream"], out["async_stream"]):
        assert len(stream) == 12 and stream[-1]["generated_text"] == expected["generated_text"]
        assert "".join(e["token"]["text"] for e in stream) == expected["generated_text"]
        assert stream[-1]["details"]["prompt_tokens"] == expected["details"]["prompt_tokens"]

    for case in ("adapter", "adapter_stream", "adapter_async"):
        assert out[case] is not None and out[case][0] == "lorax.errors.GenerationError", (case, out[case])
        assert "org/some-lora" in out[case][1]
    assert out["k_alternatives"][0] == "lorax.errors.ValidationError"
    assert "return_k_alternatives" in out["k_alternatives"][1]
    assert out["temperature"][0] == "lorax.errors.ValidationError" and "temperature" in out["temperature"][1]
    assert out["base_model"] == raw(base_url, max_new_tokens=3)["generated_text"]
