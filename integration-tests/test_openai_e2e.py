"""The OpenAI-compatible API of the real stack, spoken to by the official `openai` client, huggingface_hub's
`InferenceClient.chat_completion` and text-generation's `Client.chat` (each unchanged, in the clients' venv).

The model is the tiny test Llama with room in its vocabulary for every test template's markers as special
tokens; its own chat template is Qwen2.5's tool-use template. Greedy chat answers are checked against
transformers: `apply_chat_template(..., add_generation_prompt=True)` then `generate`, for the model's template
and for templates given with --chat-template (Llama-3, Mistral).
"""

from __future__ import annotations

import httpx
import pytest
import torch
import transformers
from stack import MAX_POSITIONS
from wire import REQUEST_TIMEOUT_S, generate, metric

from specula_testing.adapters import build_lora_adapter
from specula_testing.chat_templates import TEMPLATES, WEATHER_TOOL, add_chat_template
from specula_testing.models import build_tiny_model

PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "user", "content": PROMPT}]
VOCAB_SIZE = 600  # the tokenizer's ~512 entries, then the templates' markers as special tokens
MODEL_TEMPLATE = "qwen_tools"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("chat-model") / "llama", "llama",
                            max_position_embeddings=MAX_POSITIONS, vocab_size=VOCAB_SIZE)
    for name in [n for n in TEMPLATES if n != MODEL_TEMPLATE] + [MODEL_TEMPLATE]:
        add_chat_template(path, name)  # every marker becomes a special token; the last template is the model's
    return path


@pytest.fixture(scope="module")
def adapters(chat_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("openai-adapters")
    build_lora_adapter(chat_model, path / "code-lora", rank=8, std=0.2)
    return path


@pytest.fixture(scope="module")
def chat_server(chat_model, adapters, tmp_path_factory):
    from conftest import _start, _stop

    launcher = _start(chat_model, tmp_path_factory.mktemp("openai-run"),
                      ["--adapter-dir", str(adapters), "--adapter-source", "local"], "openai")
    yield launcher
    _stop(launcher)
    launcher.close()


@pytest.fixture(scope="module")
def reference(chat_model):
    """transformers' greedy answer: (prompt ids, generated ids, text) for messages under a template; `bias`
    ({token id: bias}) is added to the logits as OpenAI's `logit_bias` is (transformers' `sequence_bias`)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model)
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()

    def run(messages, max_new_tokens, template=None, tools=None, bias=None):
        ids = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, add_generation_prompt=True,
                                            return_dict=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 sequence_bias=[[[t], b] for t, b in bias.items()] if bias else None)
        generated = out[0, len(ids):].tolist()
        return ids, generated, tokenizer.decode(generated, skip_special_tokens=True)

    return run


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=REQUEST_TIMEOUT_S)


OPENAI_SCRIPT = """
import openai
from openai import OpenAI

client = OpenAI(base_url=ARGS["url"] + "/v1", api_key="unused", timeout=60, max_retries=0)
messages, prompt = ARGS["messages"], ARGS["prompt"]
greedy = dict(max_tokens=12, temperature=0)
out = {}
out["chat"] = client.chat.completions.create(model="tgi", messages=messages, **greedy).model_dump(mode="json")
stream = client.chat.completions.create(model="tgi", messages=messages, stream=True,
                                        stream_options={"include_usage": True}, **greedy)
out["stream"] = [chunk.model_dump(mode="json") for chunk in stream]
out["n"] = client.chat.completions.create(model="tgi", messages=messages, max_tokens=8, n=3, temperature=0.9,
                                          seed=3).model_dump(mode="json")
out["logprobs"] = client.chat.completions.create(model="tgi", messages=messages, logprobs=True, top_logprobs=3,
                                                 **greedy).model_dump(mode="json")
out["completion"] = client.completions.create(model=ARGS["model"], prompt=prompt, **greedy).model_dump(mode="json")
out["completions"] = client.completions.create(model="", prompt=[prompt, "x = 1"], n=2, logprobs=2,
                                               **greedy).model_dump(mode="json")
out["models"] = [m.model_dump(mode="json") for m in client.models.list()]
out["adapter"] = client.completions.create(model="code-lora", prompt=prompt, **greedy).model_dump(mode="json")
out["no_speculation"] = client.completions.create(model="tgi", prompt=prompt, extra_body={"speculative_tokens": 0},
                                                  **greedy).model_dump(mode="json")

def caught(call):
    try:
        call()
    except openai.APIStatusError as e:
        return [type(e).__name__, e.status_code, e.message]
    return None

out["not_found"] = caught(lambda: client.chat.completions.create(model="org/nope", messages=messages))
out["unprocessable"] = caught(lambda: client.chat.completions.create(model="tgi", messages=messages,
                                                                      max_tokens=100000))
out["bad_request"] = caught(lambda: client.completions.create(model="tgi", prompt=prompt, suffix="return"))
out["template"] = caught(lambda: client.chat.completions.create(
    model="tgi", messages=[{"role": "critic", "content": "x"}]))
print(json.dumps(out))
"""


def test_official_openai_client(chat_server, run_client, reference, chat_model):
    url = chat_server.url
    out = run_client(OPENAI_SCRIPT, url=url, messages=MESSAGES, prompt=PROMPT, model=str(chat_model))
    ids, generated, text = reference(MESSAGES, 12)

    chat = out["chat"]
    assert chat["object"] == "chat.completion" and chat["model"] == "tgi"
    assert chat["choices"][0]["message"]["content"] == text  # greedy chat equals transformers on the template's ids
    assert chat["usage"]["prompt_tokens"] == len(ids) and chat["usage"]["completion_tokens"] == len(generated)

    *deltas, last = out["stream"]
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in deltas) == text
    assert deltas[-1]["choices"][0]["finish_reason"] == chat["choices"][0]["finish_reason"]
    assert last["choices"] == [] and last["usage"] == chat["usage"]

    assert sorted(c["index"] for c in out["n"]["choices"]) == [0, 1, 2]
    content = out["logprobs"]["choices"][0]["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == text
    assert all(len(t["top_logprobs"]) == 3 and t["logprob"] <= 0 for t in content)
    for t in content:  # greedy: the chosen token is the most likely alternative
        top = t["top_logprobs"][0]
        assert top["token"] == t["token"] and abs(top["logprob"] - t["logprob"]) < 1e-4

    plain = generate(url, PROMPT, max_new_tokens=12).json()["generated_text"]
    assert out["completion"]["choices"][0]["text"] == plain == out["no_speculation"]["choices"][0]["text"]
    assert [c["index"] for c in out["completions"]["choices"]] == [0, 1, 2, 3]
    assert out["completions"]["choices"][0]["text"] == plain
    logprobs = out["completions"]["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == plain and len(logprobs["top_logprobs"]) == len(logprobs["tokens"])
    assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])  # keyed by text: equal texts share a key

    ids_listed = [m["id"] for m in out["models"]]
    assert ids_listed == [str(chat_model), "code-lora"]
    assert out["models"][1]["parent"] == str(chat_model)
    lora_text = generate(url, PROMPT, max_new_tokens=12, adapter_id="code-lora").json()["generated_text"]
    assert out["adapter"]["choices"][0]["text"] == lora_text != plain

    assert out["not_found"][:2] == ["NotFoundError", 404] and "org/nope" in out["not_found"][2]
    assert out["unprocessable"][:2] == ["UnprocessableEntityError", 422] and "max_tokens" in out["unprocessable"][2]
    assert out["bad_request"][:2] == ["BadRequestError", 400] and "suffix" in out["bad_request"][2]
    assert out["template"][:2] == ["UnprocessableEntityError", 422]
    assert "Unexpected message role: critic" in out["template"][2]


LOGIT_BIAS_SCRIPT = """
import openai
from openai import OpenAI

client = OpenAI(base_url=ARGS["url"] + "/v1", api_key="unused", timeout=60, max_retries=0)
greedy = dict(model="tgi", messages=ARGS["messages"], max_tokens=16, temperature=0, logit_bias=ARGS["bias"])
out = {"speculating": client.chat.completions.create(**greedy).model_dump(mode="json")}
out["plain"] = client.chat.completions.create(extra_body={"speculative_tokens": 0}, **greedy).model_dump(mode="json")
try:
    client.chat.completions.create(**dict(greedy, logit_bias={"100000": -100}))
except openai.APIStatusError as e:
    out["error"] = [type(e).__name__, e.status_code, e.body]
print(json.dumps(out))
"""


def test_logit_bias_through_the_official_client(chat_model, launch_with, run_client, reference):
    """Banning the token greedy chat starts with changes the answer to transformers' under the same bias, with
    speculation on and off; an id past the vocabulary is a 422 naming `logit_bias`."""
    server = launch_with(chat_model, "--speculative-tokens", "3", "--speculation-mode", "fixed")
    _, generated, text = reference(MESSAGES, 16)
    bias = {generated[0]: -100.0}
    _, biased_ids, biased_text = reference(MESSAGES, 16, bias=bias)
    assert biased_ids[0] != generated[0] and biased_text != text
    out = run_client(LOGIT_BIAS_SCRIPT, url=server.url, messages=MESSAGES, bias={str(t): b for t, b in bias.items()})
    assert out["speculating"]["choices"][0]["message"]["content"] == biased_text
    assert out["plain"]["choices"][0]["message"]["content"] == biased_text
    assert metric(server.url, "specula_spec_decode_num_draft_tokens_total") > 0  # the first request did speculate
    name, status, body = out["error"]
    assert (name, status, body["param"], body["code"]) == ("UnprocessableEntityError", 422, "logit_bias", "validation")


HF_CLIENTS_SCRIPT = """
from huggingface_hub import InferenceClient
from text_generation import Client
from text_generation.types import Message

messages = ARGS["messages"]
hf = InferenceClient(base_url=ARGS["url"], timeout=60)
out = {"hf": hf.chat_completion(messages, max_tokens=12, temperature=0)}
out["hf_stream"] = [c.choices[0].delta.content for c in hf.chat_completion(messages, max_tokens=12, temperature=0,
                                                                             stream=True) if c.choices]
tgi = Client(ARGS["url"], timeout=60)
out["tgi"] = tgi.chat([Message(**m) for m in messages], max_tokens=12, temperature=0).model_dump(mode="json")
chunks = []
try:  # text-generation 0.7.0 parses every line as JSON, the final `data: [DONE]` too (as with TGI itself)
    for chunk in tgi.chat([Message(**m) for m in messages], max_tokens=12, temperature=0, stream=True):
        chunks.append(chunk.choices[0].delta.content)
except json.JSONDecodeError:
    chunks.append("<[DONE] not parsed>")
out["tgi_stream"] = chunks
print(json.dumps(out))
"""


def test_huggingface_inference_client_and_text_generation_chat(chat_server, run_client, reference):
    out = run_client(HF_CLIENTS_SCRIPT, url=chat_server.url, messages=MESSAGES)
    _, _, text = reference(MESSAGES, 12)
    assert out["hf"]["choices"][0]["message"]["content"] == text
    assert "".join(c or "" for c in out["hf_stream"]) == text
    assert out["tgi"]["choices"][0]["message"]["content"] == text
    assert out["tgi_stream"][-1] == "<[DONE] not parsed>" and "".join(c or "" for c in out["tgi_stream"][:-1]) == text


def test_tools_render_with_the_models_template(chat_server, reference):
    body = {"messages": MESSAGES, "tools": [WEATHER_TOOL], "max_tokens": 10, "temperature": 0}
    r = post(chat_server.url, "/v1/chat/completions", **body)
    assert r.status_code == 200, r.text
    ids, _, text = reference(MESSAGES, 10, tools=[WEATHER_TOOL])
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert r.json()["choices"][0]["message"]["content"] == text  # random weights write no call: plain content


def test_headers_and_metrics_as_for_generate(chat_server):
    url = chat_server.url
    before = metric(url, "specula_request_count_total", adapter="")
    r = post(url, "/v1/chat/completions", messages=MESSAGES, max_tokens=5, temperature=0)
    assert r.status_code == 200
    assert r.headers["x-generated-tokens"] == "5" and r.headers["x-compute-type"] == "cpu"
    assert int(r.headers["x-prompt-tokens"]) == r.json()["usage"]["prompt_tokens"]
    assert metric(url, "specula_request_count_total", adapter="") == before + 1
    error = post(url, "/v1/nothing").json()
    assert set(error["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("name", ["llama3", "mistral"])
def test_chat_template_flag_renders_as_transformers(chat_model, tmp_path, launch_with, reference, name):
    template_file = tmp_path / f"{name}.jinja"
    template_file.write_text(TEMPLATES[name].template)
    server = launch_with(chat_model, "--chat-template", str(template_file))
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "    pass"},
                {"role": "user", "content": "and with memoization?"}]
    r = post(server.url, "/v1/chat/completions", messages=messages, max_tokens=10, temperature=0)
    assert r.status_code == 200, r.text
    ids, _, text = reference(messages, 10, template=TEMPLATES[name].template)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert r.json()["choices"][0]["message"]["content"] == text
    if name == "mistral":
        r = post(server.url, "/v1/chat/completions", messages=messages[:1] * 2)
        assert r.status_code == 422 and "alternate" in r.json()["error"]["message"]


@pytest.fixture
def launch_with(tmp_path):
    from conftest import _start, _stop

    started = []

    def start(model_dir, *args):
        launcher = _start(model_dir, tmp_path / f"launcher{len(started)}", list(args), f"template{len(started)}")
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        _stop(launcher)
        launcher.close()


def test_the_demo_model_chats_out_of_the_box(launch_with):
    server = launch_with(None)
    r = post(server.url, "/v1/chat/completions", messages=[{"role": "user", "content": PROMPT}], max_tokens=16,
             temperature=0)
    assert r.status_code == 200, r.text
    expected = generate(server.url, PROMPT + "\n", max_new_tokens=16).json()["generated_text"]
    assert r.json()["choices"][0]["message"]["content"] == expected  # the template writes "<s>" + prompt + "\n"
    models = httpx.get(f"{server.url}/v1/models", timeout=REQUEST_TIMEOUT_S).json()["data"]
    assert {"camel-case", "two-space", "medusa"} <= {m["id"] for m in models}
    assert not {"draft-model", "mlp-speculator"} & {m["id"] for m in models}  # speculators are no models
