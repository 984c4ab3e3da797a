"""LoRAX's `merged_adapters` in the router: every bad merge a 422 naming its field, a merge named by its whole
specification, loaded once, cached and counted like an adapter, over /generate and the OpenAI routes."""

from __future__ import annotations

import random

import pytest
from fake_worker import FakeClient
from test_http import call
from test_http_limits import build_state, generate, tokenizer  # noqa: F401 (a fixture)

from specula_router.merges import ADAPTER_ID_CONFLICT, NO_ADAPTER_IDS, WEIGHT_MISMATCH, MergeSpec, is_merged_id
from specula_router.schemas import GenerateParameters
from specula_router.validation import Validator
from specula_router.validation_limits import ValidationError, ValidationLimits

LIMITS = ValidationLimits(max_input_tokens=32, max_total_tokens=64)
TWO = {"ids": ["a", "b"], "weights": [0.5, 0.5]}


@pytest.fixture()
def validator(tokenizer) -> Validator:  # noqa: F811
    return Validator(tokenizer, LIMITS, random.Random(0), default_adapter_source="local")


def validate(validator, **parameters):
    return validator.validate("def f():", GenerateParameters.model_validate(parameters))


@pytest.mark.parametrize(("parameters", "field", "message"), [
    ({"adapter_id": "a", "merged_adapters": TWO}, "merged_adapters", ADAPTER_ID_CONFLICT),
    ({"merged_adapters": {"ids": [], "weights": []}}, "merged_adapters.ids", NO_ADAPTER_IDS),
    ({"merged_adapters": {"ids": ["a", "b"], "weights": [1.0]}}, "merged_adapters.weights", WEIGHT_MISMATCH),
    ({"merged_adapters": {"ids": ["a"]}}, "merged_adapters.weights", WEIGHT_MISMATCH),
    ({"merged_adapters": {**TWO, "merge_strategy": "svd"}}, "merged_adapters.merge_strategy",
     "`merged_adapters.merge_strategy` must be one of linear, ties, dare_linear, dare_ties. Given: 'svd'"),
    ({"merged_adapters": {**TWO, "merge_strategy": "ties", "density": 0.5, "majority_sign_method": "median"}},
     "merged_adapters.majority_sign_method",
     "`merged_adapters.majority_sign_method` must be one of total, frequency. Given: 'median'"),
    ({"merged_adapters": {**TWO, "merge_strategy": "ties"}}, "merged_adapters.density",  # LoRAX's default 0
     "`merged_adapters.density` must be > 0.0 and <= 1.0 for ties. Given: 0.0"),
    ({"merged_adapters": {**TWO, "merge_strategy": "dare_linear", "density": 1.5}}, "merged_adapters.density",
     "`merged_adapters.density` must be > 0.0 and <= 1.0 for dare_linear. Given: 1.5"),
    ({"merged_adapters": {**TWO, "density": -0.1}}, "merged_adapters.density",
     "`merged_adapters.density` must be >= 0.0 and <= 1.0. Given: -0.1"),
    ({"merged_adapters": {"ids": ["a", "b"], "weights": [0.5, float("nan")]}}, "merged_adapters.weights",
     "`merged_adapters.weights` must be finite numbers"),
    ({"merged_adapters": {"ids": [f"a{i}" for i in range(17)], "weights": [1.0] * 17}}, "merged_adapters.ids",
     "`merged_adapters.ids` must name at most 16 adapters. Given: 17"),
    ({"merged_adapters": {"ids": ["a", ""], "weights": [1.0, 1.0]}}, "merged_adapters.ids",
     "`merged_adapters.ids` must not contain an empty id"),
    ({"merged_adapters": {"ids": ["a", "b\n"], "weights": [1.0, 1.0]}}, "merged_adapters.ids",
     "`merged_adapters.ids` must hold ids without control characters or surrounding whitespace. Given: 'b\\n'"),
    ({"merged_adapters": {"ids": ["merge:0123"], "weights": [1.0]}}, "merged_adapters.ids",
     "`merged_adapters.ids` must not name a merge (`merge:...`)"),
    ({"merged_adapters": {**TWO, "merge_strategy": "dare_ties", "density": 0.5, "seed": 2**64}},
     "merged_adapters.seed", f"`merged_adapters.seed` must be >= 0 and <= {2**64 - 1}. Given: {2**64}"),
    ({"adapter_id": "merge:0123"}, "adapter_id",
     "`adapter_id` must not start with `merge:` (merged adapters' names): use `merged_adapters`"),
    ({"merged_adapters": {**TWO}, "adapter_source": "s3"}, "adapter_source",
     "`adapter_source` must be one of ['hub', 'local']. Given: 's3'"),
])
def test_bad_merges_are_422s_naming_the_field(validator, parameters, field, message):
    with pytest.raises(ValidationError) as info:
        validate(validator, **parameters)
    assert (info.value.field, info.value.message) == (field, message)


def test_a_merge_is_an_adapter_named_by_its_whole_specification(validator):
    valid = validate(validator, merged_adapters=TWO, api_token="secret")
    assert valid.merge == MergeSpec(("a", "b"), (0.5, 0.5), "linear", 1.0, "total", 0, "local")
    assert valid.adapter_id == valid.merge.adapter_id and is_merged_id(valid.adapter_id)
    assert valid.adapter_source == "local" and valid.api_token == "secret"
    assert validate(validator, adapter_id="", merged_adapters=TWO).adapter_id == valid.adapter_id  # "" is the base

    def name(**merge):
        return validate(validator, merged_adapters={**TWO, **merge}).adapter_id

    # What a strategy does not read does not split the cache; everything it reads does.
    assert name(density=0.3, majority_sign_method="frequency", seed=4) == valid.adapter_id
    assert name(weights=[0.5, 0.6]) != valid.adapter_id and name(ids=["b", "a"]) != valid.adapter_id
    assert name(merge_strategy="ties", density=0.5, seed=1) == name(merge_strategy="ties", density=0.5, seed=2)
    assert name(merge_strategy="ties", density=0.5) != name(merge_strategy="ties", density=0.6)
    assert name(merge_strategy="ties", density=0.5) != name(merge_strategy="ties", density=0.5,
                                                            majority_sign_method="frequency")
    assert validate(validator, merged_adapters=TWO, adapter_source="hub").adapter_id != valid.adapter_id
    # DARE: the request's seed, else one derived from the merge, the same every time.
    dare = {**TWO, "merge_strategy": "dare_ties", "density": 0.5}
    derived = validate(validator, merged_adapters=dare).merge.seed
    assert derived == validate(validator, merged_adapters=dare).merge.seed != 0
    assert validate(validator, merged_adapters={**dare, "seed": 7}).merge.seed == 7
    assert name(**dare, seed=7) != name(**dare, seed=8)


def test_merges_are_loaded_once_cached_counted_and_labelled(tokenizer):  # noqa: F811
    client = FakeClient()

    async def fn(http):
        merged = {"max_new_tokens": 2, "merged_adapters": {**TWO, "merge_strategy": "ties", "density": 0.5}}
        answers = [await http.post("/generate", json=generate(merged)) for _ in range(3)]
        lorax = await http.post("/generate", json=generate({**merged, "adapter_id": "a"}))
        openai = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "model": "tgi",
                                                          "merged_adapters": merged["merged_adapters"]})
        return answers, lorax, openai, (await http.get("/metrics")).text

    answers, lorax, openai, metrics = call(build_state(tokenizer, client), fn)
    assert [a.status_code for a in answers] == [200] * 3 and openai.status_code == 200, openai.text
    (load,) = client.load_requests
    (merge,) = client.load_merges
    assert merge == MergeSpec(("a", "b"), (0.5, 0.5), "ties", 0.5, "total", 0, "hub")
    assert load.adapter_id == merge.adapter_id
    assert answers[0].json()["generated_text"].startswith(merge.adapter_id)  # the fake answers with its adapter
    assert (lorax.status_code, lorax.json()) == (422, {"error": ADAPTER_ID_CONFLICT, "error_type": "validation"})
    assert 'specula_adapter_merge_requests_total{cache="miss"} 1.0' in metrics
    assert 'specula_adapter_merge_requests_total{cache="hit"} 3.0' in metrics
    assert 'specula_request_success_total{adapter="merged"} 4.0' in metrics and "merge:" not in metrics


def test_merges_take_adapter_slots_and_are_offloaded_least_recently_used_first(tokenizer):  # noqa: F811
    client = FakeClient()
    state = build_state(tokenizer, client)
    state.scheduler.adapters.max_active_adapters = 1

    async def fn(http):
        one = {"max_new_tokens": 1, "merged_adapters": TWO}
        other = {"max_new_tokens": 1, "merged_adapters": {"ids": ["a", "b"], "weights": [0.4, 0.6]}}
        return [(await http.post("/generate", json=generate(p))).status_code
                for p in (one, other, {"max_new_tokens": 1, "adapter_id": "a"}, one)]

    assert call(state, fn) == [200] * 4
    names = [call_[1] for call_ in client.adapter_calls]
    assert [c[0] for c in client.adapter_calls] == ["load", "offload", "load", "offload", "load", "offload", "load"]
    assert names[0] == names[6] and is_merged_id(names[0]) and names[4] == "a"
