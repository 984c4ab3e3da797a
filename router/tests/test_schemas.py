"""HTTP schemas: lenient but strictly typed requests, responses that the published clients parse unchanged.

The client checks run the real `text-generation` and `lorax-client` packages in their own virtual
environment (they pin other pydantic versions than ours), in a subprocess: `.venv-clients` at the repository
root, set up on first use (`specula_testing.clients`), or $SPECULA_CLIENTS_PYTHON.
"""

from __future__ import annotations

import json
import random
import subprocess
from typing import Any

import pydantic
import pytest
import tokenizers

from specula_router.response_schemas import (
    AdapterInfo,
    AlternativeToken,
    BestOfSequence,
    Details,
    ErrorResponse,
    FinishReason,
    GenerateResponse,
    Info,
    PrefillToken,
    SimpleToken,
    SpeculationInfo,
    StreamDetails,
    StreamResponse,
    Token,
)
from specula_router.schemas import CompatGenerateRequest, GenerateParameters, GenerateRequest, TokenizeRequest
from specula_router.validation import Validator
from specula_router.validation_limits import ValidationLimits
from specula_testing import clients
from specula_testing.tokenizer import build_tokenizer


def run_clients(script: str, payload: Any = None) -> Any:
    """Run `script` with the published clients' interpreter; it reads JSON on stdin and prints JSON."""
    result = subprocess.run(
        [clients.clients_python(), "-c", script],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=60,
        env=clients.clients_env(),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# -- requests ---------------------------------------------------------------------------------------------


def test_every_parameter_accepts_null():
    nulls = {name: None for name in GenerateParameters.model_fields}
    parsed = GenerateParameters.model_validate(nulls)
    assert parsed == GenerateParameters()
    assert parsed.stop == [] and parsed.details is False and parsed.do_sample is False


def test_unknown_fields_are_ignored():
    parsed = CompatGenerateRequest.model_validate(
        {"inputs": "hi", "parameters": {"max_new_tokens": 3, "apply_chat_template": False}, "extra": 1}
    )
    assert parsed.parameters.max_new_tokens == 3
    assert not hasattr(parsed, "extra")


def test_missing_or_null_parameters_use_defaults():
    assert GenerateRequest.model_validate({"inputs": "hi"}).parameters == GenerateParameters()
    compat = CompatGenerateRequest.model_validate({"inputs": "hi", "parameters": None, "stream": None})
    assert compat.parameters == GenerateParameters() and compat.stream is False


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"inputs": "hi", "parameters": {"temperature": "0.5"}}, ("parameters", "temperature")),
        ({"inputs": "hi", "parameters": {"max_new_tokens": 5.0}}, ("parameters", "max_new_tokens")),
        ({"inputs": "hi", "parameters": {"max_new_tokens": True}}, ("parameters", "max_new_tokens")),
        ({"inputs": "hi", "parameters": {"do_sample": "true"}}, ("parameters", "do_sample")),
        ({"inputs": "hi", "parameters": {"stop": [1, 2]}}, ("parameters", "stop", 0)),
        ({"inputs": "hi", "parameters": {"adapter_id": 7}}, ("parameters", "adapter_id")),
        ({"inputs": "hi", "parameters": {"grammar": "json"}}, ("parameters", "grammar")),
        ({"inputs": 5}, ("inputs",)),
        ({"parameters": {}}, ("inputs",)),
        ({"inputs": "hi", "stream": "yes"}, ("stream",)),
    ],
)
def test_types_are_strict(body, loc):
    with pytest.raises(pydantic.ValidationError) as info:
        CompatGenerateRequest.model_validate(body)
    assert info.value.errors()[0]["loc"] == loc


def test_json_integers_are_valid_floats():
    parsed = GenerateParameters.model_validate_json('{"temperature": 1, "top_p": 1, "frequency_penalty": -2}')
    assert (parsed.temperature, parsed.top_p, parsed.frequency_penalty) == (1.0, 1.0, -2.0)
    assert isinstance(parsed.temperature, float)


def test_single_stop_string_is_a_list():
    assert GenerateParameters.model_validate({"stop": "###"}).stop == ["###"]


def test_tokenize_request():
    parsed = TokenizeRequest.model_validate({"inputs": "hi", "parameters": {"whatever": 1}})
    assert parsed.inputs == "hi" and parsed.add_special_tokens is True


def test_every_parameter_is_documented():
    schema = GenerateParameters.model_json_schema()
    undocumented = [name for name, prop in schema["properties"].items() if not prop.get("description")]
    assert undocumented == []
    props = {name: prop["anyOf"][0] for name, prop in schema["properties"].items()}  # [value, null]
    assert all(prop["anyOf"][-1] == {"type": "null"} for prop in schema["properties"].values())
    assert props["adapter_source"]["enum"] == ["hub", "local"]
    assert props["adapter_id"]["maxLength"] == 256
    assert GenerateRequest.model_json_schema()["examples"][0]["inputs"]


CLIENT_REQUESTS_SCRIPT = r"""
import json
from text_generation import types as tgi
from lorax import types as lorax

tgi_params = tgi.Parameters(details=True, do_sample=True, max_new_tokens=12, repetition_penalty=1.1,
    frequency_penalty=0.5, seed=42, stop=["###"], temperature=0.7, top_k=20, top_p=0.9, truncate=16,
    typical_p=0.95, decoder_input_details=True, top_n_tokens=3)
lorax_params = lorax.Parameters(adapter_id="org/adapter", adapter_source="hub", api_token="tok",
    details=True, do_sample=False, max_new_tokens=None, ignore_eos_token=True, return_k_alternatives=2,
    stop=[], seed=None)
print(json.dumps({
    "tgi": tgi.Request(inputs="Hello world", stream=False, parameters=tgi_params).dict(),
    "tgi_stream": tgi.Request(inputs="Hello world", stream=True, parameters=tgi.Parameters(details=True)).dict(),
    "lorax": lorax.Request(inputs="Hello world", stream=False, parameters=lorax_params).dict(by_alias=True),
}))
"""


@pytest.fixture(scope="module")
def validator(tmp_path_factory) -> Validator:
    out_dir = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out_dir)
    tokenizer = tokenizers.Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    limits = ValidationLimits(max_input_tokens=32, max_total_tokens=64, max_speculative_tokens=2)
    return Validator(tokenizer, limits, random.Random(0))


def test_published_client_request_bodies_parse_and_validate(validator):
    bodies = run_clients(CLIENT_REQUESTS_SCRIPT)

    tgi = CompatGenerateRequest.model_validate(bodies["tgi"])
    request = validator.validate(tgi.inputs, tgi.parameters, stream=tgi.stream)
    s = request.sampling
    assert (s.do_sample, s.seed, s.temperature, s.top_k, s.top_p, s.typical_p) == (True, 42, 0.7, 20, 0.9, 0.95)
    assert (s.repetition_penalty, s.frequency_penalty) == (1.1, 0.5)
    assert request.stopping.max_new_tokens == 12 and request.stopping.stop_sequences == ("###",)
    assert (request.top_n_tokens, request.truncate, request.details, request.decoder_input_details) == (
        3, 16, True, True,
    )

    stream = CompatGenerateRequest.model_validate(bodies["tgi_stream"])
    assert stream.stream is True
    assert validator.validate(stream.inputs, stream.parameters, stream=True).stopping.max_new_tokens == 20

    lorax = CompatGenerateRequest.model_validate(bodies["lorax"])
    request = validator.validate(lorax.inputs, lorax.parameters, stream=lorax.stream)
    assert (request.adapter_id, request.adapter_source, request.api_token) == ("org/adapter", "hub", "tok")
    assert request.top_n_tokens == 2 and request.stopping.ignore_eos_token is True
    assert request.sampling.do_sample is False
    assert request.stopping.max_new_tokens == 64 - request.input_length  # LoRAX default


# -- responses --------------------------------------------------------------------------------------------


def token(i: int, *, alternatives: bool = False, skipped: bool = False) -> Token:
    alts = [AlternativeToken(id=i + 10, text=f"alt{i}", logprob=-2.5)] if alternatives else None
    return Token(id=i, text=f"t{i}", logprob=-0.25 * (i + 1), special=False, alternative_tokens=alts, skipped=skipped)


def full_response() -> GenerateResponse:
    tokens = [token(0, alternatives=True), token(1, alternatives=True, skipped=True)]
    prefill = [PrefillToken(id=1, text="<s>", logprob=None), PrefillToken(id=5, text="Hi", logprob=-1.5)]
    top_tokens = [[token(10), token(11)], [token(12), token(13)]]
    other = BestOfSequence(
        generated_text="other", finish_reason=FinishReason.LENGTH, generated_tokens=2, seed=7,
        prefill=prefill, tokens=[token(2), token(3)], top_tokens=top_tokens,
    )
    details = Details(
        finish_reason=FinishReason.EOS_TOKEN, prompt_tokens=2, generated_tokens=2, seed=2**64 - 1,
        prefill=prefill, tokens=tokens, top_tokens=top_tokens, best_of_sequences=[other], skipped_tokens=1,
    )
    return GenerateResponse(generated_text="t0t1", details=details)


def stream_events() -> list[StreamResponse]:
    first = StreamResponse(index=1, token=token(0), top_tokens=[token(10)])
    last = StreamResponse(
        index=2,
        token=token(1, skipped=True),
        generated_text="t0t1",
        details=StreamDetails(finish_reason=FinishReason.STOP_SEQUENCE, prompt_tokens=3, generated_tokens=2, seed=9,
                              input_length=3),
    )
    return [first, last]


def test_absent_optional_parts_are_omitted():
    plain = token(0)
    assert "alternative_tokens" not in plain.model_dump(mode="json")
    assert plain.model_dump(mode="json")["skipped"] is False
    assert GenerateResponse(generated_text="x").model_dump(mode="json") == {"generated_text": "x"}
    details = Details(finish_reason=FinishReason.LENGTH, prompt_tokens=1, generated_tokens=0)
    dumped = details.model_dump(mode="json")
    assert "top_tokens" not in dumped and "best_of_sequences" not in dumped
    assert dumped["seed"] is None and dumped["skipped_tokens"] == 0 and dumped["finish_reason"] == "length"
    event = StreamResponse(index=1, token=plain).model_dump(mode="json")
    assert event["generated_text"] is None and event["details"] is None  # SSE events carry explicit nulls
    assert "top_tokens" not in event


def test_responses_round_trip_through_json():
    for model in [full_response(), *stream_events(), ErrorResponse(error="boom", error_type="generation")]:
        assert type(model).model_validate_json(model.model_dump_json()) == model
    dumped = json.loads(full_response().model_dump_json())
    assert dumped["details"]["finish_reason"] == "eos_token"
    assert dumped["details"]["seed"] == 2**64 - 1
    assert dumped["details"]["prefill"][0]["logprob"] is None
    assert dumped["details"]["tokens"][1] == {
        "id": 1, "text": "t1", "logprob": -0.5, "special": False, "skipped": True,
        "alternative_tokens": [{"id": 11, "text": "alt1", "logprob": -2.5}],
    }


CLIENT_RESPONSES_SCRIPT = r"""
import json, sys
from text_generation import types as tgi
from lorax import types as lorax

data = json.load(sys.stdin)
out = {}
for name, types in (("tgi", tgi), ("lorax", lorax)):
    out[name] = {
        "response": types.Response(**data["response"]).model_dump(mode="json"),
        "events": [types.StreamResponse(**event).model_dump(mode="json") for event in data["events"]],
    }
out["lorax"]["plain"] = lorax.Response(**data["plain"]).model_dump(mode="json")
print(json.dumps(out))
"""


def test_published_clients_parse_our_responses():
    payload = {
        "response": full_response().model_dump(mode="json"),
        "events": [event.model_dump(mode="json") for event in stream_events()],
        "plain": GenerateResponse(generated_text="no details").model_dump(mode="json"),
    }
    parsed = run_clients(CLIENT_RESPONSES_SCRIPT, payload)

    for name in ("tgi", "lorax"):
        response = parsed[name]["response"]
        assert response["generated_text"] == "t0t1"
        assert response["details"]["finish_reason"] == "eos_token"
        assert response["details"]["seed"] == 2**64 - 1
        assert [t["id"] for t in response["details"]["tokens"]] == [0, 1]
        assert response["details"]["best_of_sequences"][0]["generated_text"] == "other"
        events = parsed[name]["events"]
        assert events[0]["generated_text"] is None and events[0]["details"] is None
        assert events[1]["details"]["finish_reason"] == "stop_sequence"

    lorax = parsed["lorax"]
    assert lorax["response"]["details"]["prompt_tokens"] == 2
    assert lorax["response"]["details"]["tokens"][0]["alternative_tokens"] == [
        {"id": 10, "text": "alt0", "logprob": -2.5}
    ]
    assert lorax["events"][1]["details"]["prompt_tokens"] == 3
    assert lorax["plain"] == {"generated_text": "no details", "details": None}
    tgi = parsed["tgi"]
    assert [[t["id"] for t in step] for step in tgi["response"]["details"]["top_tokens"]] == [[10, 11], [12, 13]]
    assert [t["id"] for t in tgi["events"][0]["top_tokens"]] == [10]
    # The events carry TGI's `index` and `details.input_length`; the published clients (text-generation 0.7,
    # lorax-client) predate them and must still parse the events, as they did above.
    assert [e["index"] for e in payload["events"]] == [1, 2] and payload["events"][1]["details"]["input_length"] == 3


# -- info and tokenize ------------------------------------------------------------------------------------


def test_info_reports_speculation_adapters_and_legacy_input_length():
    info = Info(
        model_id="org/model", model_dtype="bfloat16", model_device_type="cuda", max_concurrent_requests=128,
        max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5, max_input_tokens=1024, max_total_tokens=2048,
        waiting_served_ratio=1.2, max_batch_total_tokens=32000, max_waiting_tokens=20, validation_workers=2,
        block_size=16, version="0.1.0",
        speculation=SpeculationInfo(method="ngram", max_speculative_tokens=4, mode="adaptive"),
        adapters=AdapterInfo(max_active_adapters=4, adapter_source="hub", preloaded_adapter_ids=["org/a"]),
    )
    dumped = json.loads(info.model_dump_json())
    assert dumped["max_input_length"] == dumped["max_input_tokens"] == 1024
    assert dumped["speculation"] == {"method": "ngram", "max_speculative_tokens": 4, "mode": "adaptive",
                                     "reserved_lookahead_tokens": 0, "speculator": None}
    assert dumped["adapters"] == {"max_active_adapters": 4, "adapter_source": "hub",
                                  "preloaded_adapter_ids": ["org/a"]}
    assert dumped["model_sha"] is None and dumped["num_shard"] == 1
    assert Info.model_validate(dumped) == info  # the computed field is ignored on the way in


def test_simple_token_shape():
    assert SimpleToken(id=3, text="ab", start=0, stop=2).model_dump() == {
        "id": 3, "text": "ab", "start": 0, "stop": 2, "special": False,
    }
