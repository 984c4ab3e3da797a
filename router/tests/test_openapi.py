"""The OpenAPI document: valid, exact about every bound, and (slow tier) fuzzed by schemathesis with every check."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import tokenizers
import uvicorn
from openapi_spec_validator import validate
from test_http_limits import LIMITS, build_state

from specula_proto import generate_pb2 as pb
from specula_router import startup
from specula_router.chat_template import ChatTemplate
from specula_router.config import RouterConfig
from specula_router.openai_models import OpenAISettings
from specula_router.schemas import GenerateParameters
from specula_router.server import create_app
from specula_router.validation_limits import ValidationError
from specula_router.wire import FLOAT32_MAX, FLOAT32_MIN_NORMAL
from specula_testing.chat_templates import LLAMA3
from specula_testing.tokenizer import build_tokenizer

SCHEMATHESIS_CONFIG = Path(__file__).with_name("schemathesis.toml")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


def info_body() -> dict:
    """A complete `/info` answer, as `startup.run` builds it, for the limits of `build_state`."""
    config = RouterConfig(model_id="fake", master_shard_uds_path="/tmp/unused-0", speculative_tokens=2)
    info = pb.InfoResponse(model_id="fake", dtype="float32", device_type="cpu", block_size=16,
                           max_position_embeddings=512, world_size=1,
                           speculation=pb.SpeculationInfo(method="ngram", max_speculative_tokens=2, mode="fixed"))
    limits = startup.Limits(LIMITS.max_input_tokens, LIMITS.max_total_tokens, 512)
    return startup.info_body(config, info, limits, num_blocks=256)


@pytest.fixture(scope="module")
def document(tokenizer) -> dict:
    return create_app(build_state(tokenizer)).openapi()


def properties(document: dict, model: str) -> dict:
    return document["components"]["schemas"][model]["properties"]


def value_schema(prop: dict) -> dict:
    """The non-null branch of a nullable property ({"type": "null"} for one that takes nothing else)."""
    return next((branch for branch in prop["anyOf"] if branch != {"type": "null"}), {"type": "null"})


def test_the_document_is_valid_openapi(document):
    validate(document)  # also resolves every $ref: the SSE schemas' StreamDetails once dangled
    text = json.dumps(document)
    assert "HTTPValidationError" not in text and "$defs" not in text


def test_answers_are_declared_as_served(document):
    paths = document["paths"]
    assert paths["/health"]["get"]["responses"]["200"]["content"] == {}  # an empty 200, as TGI
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert list(paths["/generate_stream"]["post"]["responses"]["200"]["content"]) == ["text/event-stream"]
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, code in (("/generate", "422"), ("/tokenize", "422"), ("/tokenize", "429"), ("/", "413")):
        assert paths[path]["post"]["responses"][code]["content"]["application/json"]["schema"] == error
    token = properties(document, "Token")
    assert {"type": "null"} in token["logprob"]["anyOf"]


def test_null_is_declared_wherever_it_is_accepted(document):
    for model, names in (("CompatGenerateRequest", ("parameters", "stream")),
                         ("TokenizeRequest", ("parameters", "add_special_tokens")),
                         ("GenerateParameters", tuple(GenerateParameters.model_fields))):
        for name in names:
            assert {"type": "null"} in properties(document, model)[name]["anyOf"], (model, name)
    assert properties(document, "GenerateParameters")["merged_adapters"]["anyOf"] == [
        {"$ref": "#/components/schemas/MergedAdapters"}, {"type": "null"}]
    for name in ("grammar", "response_format"):  # structured output: an object with a `type`, or null
        options = properties(document, "GenerateParameters")[name]["anyOf"]
        assert {"type": "null"} in options
        (shape,) = [option for option in options if option.get("type") == "object"]
        assert shape["required"] == ["type"] and "enum" in shape["properties"]["type"]


def test_documented_bounds_are_the_validators(document, tokenizer):
    """Each numeric parameter is accepted at its documented edge and refused just past it, with a 422."""
    validator = build_state(tokenizer).validator
    props = {name: value_schema(prop) for name, prop in properties(document, "GenerateParameters").items()}
    assert props["top_k"]["maximum"] == 512 == validator.max_top_k  # the vocabulary, not uint32
    assert (props["best_of"]["maximum"], props["top_n_tokens"]["maximum"], props["truncate"]["maximum"]) == (2, 5, 100)
    assert props["speculative_tokens"]["maximum"] == 2 and props["max_new_tokens"]["maximum"] == 199
    assert props["temperature"] == {"type": "number", "minimum": FLOAT32_MIN_NORMAL, "maximum": FLOAT32_MAX}
    assert props["stop"]["maxItems"] == 4
    context = {"best_of": {"do_sample": True}}  # fields that are only valid beside others
    for name, schema in props.items():
        if schema.get("type") not in ("integer", "number") or name == "max_new_tokens":
            continue
        for edge, past in (("minimum", -1), ("maximum", 1)):
            value = schema[edge]
            beyond = value + past if schema["type"] == "integer" else math.nextafter(value, past * math.inf)
            validator.validate("x", GenerateParameters.model_validate({**context.get(name, {}), name: value}))
            with pytest.raises(ValidationError) as info:
                validator.validate("x", GenerateParameters.model_validate({**context.get(name, {}), name: beyond}))
            assert info.value.field in (name, "best_of"), (name, beyond)
    with pytest.raises(ValidationError, match="max_new_tokens"):
        validator.validate("x", GenerateParameters(max_new_tokens=200))


def test_the_openai_routes_state_the_bounds_of_generate(document):
    """Each /v1 field that becomes a `/generate` parameter has its bounds; what only these routes refuse is stated."""
    generate = {name: value_schema(prop) for name, prop in properties(document, "GenerateParameters").items()}
    for model, top_n in (("ChatCompletionRequest", "top_logprobs"), ("CompletionRequest", "logprobs")):
        props = properties(document, model)
        fields = {name: value_schema(prop) for name, prop in props.items() if "anyOf" in prop}
        for name in ("top_p", "top_k", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty",
                     "speculative_tokens", "adapter_id", "adapter_source", "stop", "logit_bias"):
            assert fields[name] == generate[name], (model, name)
        assert fields["max_tokens"] == generate["max_new_tokens"] == {"type": "integer", "minimum": 1, "maximum": 199}
        assert fields[top_n] == generate["top_n_tokens"], (model, top_n)
        assert fields["n"] == {"type": "integer", "minimum": 1, "maximum": 8}  # --max-concurrent-requests
        assert props["temperature"]["anyOf"] == [{"type": "number", "const": 0}, generate["temperature"],
                                                 {"type": "null"}]
        assert fields["logit_bias"]["maxProperties"] == 300
    completion = properties(document, "CompletionRequest")
    assert completion["prompt"]["anyOf"][1] == {"type": "array", "items": {"type": "string", "minLength": 1},
                                                "minItems": 1, "maxItems": 8}
    assert value_schema(completion["best_of"]) == {"type": "integer", "minimum": 1, "maximum": 1}
    assert completion["suffix"]["anyOf"] == [{"type": "null"}]
    part = document["components"]["schemas"]["ContentPart"]
    assert part["required"] == ["type", "text"] and part["properties"]["type"]["const"] == "text"
    error = {"$ref": "#/components/schemas/OpenAIErrorResponse"}
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = document["paths"][path]["post"]["responses"]
        for code in ("400", "404", "413", "422", "424", "429"):
            assert responses[code]["content"]["application/json"]["schema"] == error, (path, code)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert document["paths"]["/v1/models/{model}"]["get"]["responses"]["404"]["content"]["application/json"][
        "schema"] == error


# -- slow tier: schemathesis over a live server with the fake worker ---------------------------------------


class ServerThread:
    """The router app with its batching loop, served by uvicorn on a free port in a thread of its own."""

    def __init__(self, state) -> None:
        self.state = state
        self.server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="error"))
        self.thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        loop = asyncio.create_task(self.state.scheduler.run())
        try:
            await self.server.serve()
        finally:
            loop.cancel()

    def __enter__(self) -> str:
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                port = self.server.servers[0].sockets[0].getsockname()[1]
                return f"http://127.0.0.1:{port}"
            threading.Event().wait(0.01)
        raise RuntimeError("the server did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


OPENAI_ROUTES = "^/v1/"


@pytest.mark.slow
@pytest.mark.parametrize("routes", [
    pytest.param(["--exclude-path-regex", OPENAI_ROUTES], id="tgi-lorax"),
    pytest.param(["--include-path-regex", OPENAI_ROUTES], id="openai"),
])
def test_schemathesis_finds_no_failure(tokenizer, routes):
    """The command docs/api.md gives, against the router over the fake worker: every check, zero failures."""
    state = build_state(tokenizer, max_concurrent=64, info=info_body())
    # A chat template, as every chat model has: chat requests are then served and fuzzed to the end. A server
    # without one refuses every chat request with a 400 that no request schema can state (schemathesis.toml).
    # Llama 3's renders any role and a null `content` (as "None", as transformers does), so few conversations
    # stop at the template.
    state.openai = OpenAISettings(ChatTemplate.from_text(LLAMA3, {"bos_token": "<s>", "eos_token": "</s>"}))
    with ServerThread(state) as url:
        result = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "--config-file", str(SCHEMATHESIS_CONFIG), "run",
             f"{url}/api-doc/openapi.json", "--checks", "all", "--seed", "1", "--no-color", *routes],
            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-20_000:] + result.stderr[-5_000:]
