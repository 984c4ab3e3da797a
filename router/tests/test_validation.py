"""Validator: every rule names its field and limit; defaults, seeds, truncation and aliases resolve as documented."""

from __future__ import annotations

import math
import random
import struct

import pytest
import tokenizers

from specula_router.http_errors import format_request_errors
from specula_router.sampling_validation import MAX_SEED
from specula_router.schemas import GenerateParameters
from specula_router.validation import Validator
from specula_router.validation_limits import ValidationError, ValidationLimits
from specula_router.wire import FLOAT32_BELOW_ONE, FLOAT32_MAX, FLOAT32_MIN_NORMAL
from specula_testing.tokenizer import BOS_ID, build_tokenizer

PROMPT = "def hello(name):\n    return name"

LIMITS = ValidationLimits(
    max_input_tokens=32,
    max_total_tokens=64,
    max_stop_sequences=3,
    max_best_of=2,
    max_top_n_tokens=5,
    max_speculative_tokens=4,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> tokenizers.Tokenizer:
    out_dir = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out_dir)
    return tokenizers.Tokenizer.from_file(str(out_dir / "tokenizer.json"))


@pytest.fixture()
def validator(tokenizer) -> Validator:
    return Validator(tokenizer, LIMITS, random.Random(0))


def params(**kwargs) -> GenerateParameters:
    return GenerateParameters.model_validate(kwargs)


def prompt_length(tokenizer: tokenizers.Tokenizer, text: str = PROMPT) -> int:
    return len(tokenizer.encode(text).ids)


def test_defaults(validator, tokenizer):
    request = validator.validate(PROMPT, GenerateParameters())
    ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    assert ids[0] == BOS_ID
    assert request.input_ids == tuple(ids)
    assert request.inputs == PROMPT
    sampling = request.sampling
    assert (sampling.do_sample, sampling.temperature, sampling.top_k, sampling.top_p, sampling.typical_p) == (
        False, 1.0, 0, 1.0, 1.0,
    )
    assert (sampling.repetition_penalty, sampling.frequency_penalty, sampling.presence_penalty) == (1.0, 0.0, 0.0)
    # LoRAX default: everything max_total_tokens leaves after the prompt.
    assert request.stopping.max_new_tokens == LIMITS.max_total_tokens - len(ids)
    assert request.max_total_tokens == LIMITS.max_total_tokens
    assert request.stopping.stop_sequences == ()
    assert request.stopping.ignore_eos_token is False
    assert (request.details, request.decoder_input_details, request.return_full_text) == (False, False, False)
    assert (request.top_n_tokens, request.best_of, request.truncate) == (0, 1, None)
    assert (request.adapter_id, request.adapter_source, request.api_token, request.speculative_tokens) == (
        None, None, None, None,
    )


def test_explicit_values_pass_through(validator):
    request = validator.validate(
        PROMPT,
        params(
            temperature=0.7, top_k=40, top_p=0.9, typical_p=0.95, repetition_penalty=1.1,
            frequency_penalty=-0.5, presence_penalty=1.5, max_new_tokens=7, stop=["\n\n", "###"],
            ignore_eos_token=True, details=True, decoder_input_details=True, return_full_text=True,
            adapter_id="org/adapter", adapter_source="local", api_token="secret", speculative_tokens=2,
        ),
    )
    s = request.sampling
    assert (s.do_sample, s.temperature, s.top_k, s.top_p, s.typical_p) == (True, 0.7, 40, 0.9, 0.95)
    assert (s.repetition_penalty, s.frequency_penalty, s.presence_penalty) == (1.1, -0.5, 1.5)
    assert request.stopping.max_new_tokens == 7
    assert request.stopping.stop_sequences == ("\n\n", "###")
    assert request.stopping.ignore_eos_token is True
    assert (request.details, request.decoder_input_details, request.return_full_text) == (True, True, True)
    assert (request.adapter_id, request.adapter_source, request.api_token) == ("org/adapter", "local", "secret")
    assert request.speculative_tokens == 2


@pytest.mark.parametrize(
    ("kwargs", "do_sample"),
    [
        ({}, False),
        ({"do_sample": True}, True),
        ({"temperature": 0.5}, True),  # TGI's router would keep do_sample=false here
        ({"temperature": 1.0}, False),  # neutral values are not warpers
        ({"top_p": 1.0}, False),
        ({"top_k": 5}, True),
        ({"top_p": 0.9}, True),
        ({"typical_p": 0.5}, True),
        ({"repetition_penalty": 1.2}, False),  # penalties do not imply sampling
        ({"do_sample": False, "top_k": 5}, True),
    ],
)
def test_sampling_is_on_iff_asked_or_warped(validator, kwargs, do_sample):
    assert validator.validate(PROMPT, params(**kwargs)).sampling.do_sample is do_sample


POSITIVE = "in [1.1754944e-38, 3.4028235e+38] as a float32."  # float32's normal range

# (parameters, stream, field, exact message)
REJECTED = [
    ({"temperature": 0.0}, False, "temperature", f"`temperature` must be strictly positive: {POSITIVE} Given: 0.0"),
    ({"temperature": -1.0}, False, "temperature", f"`temperature` must be strictly positive: {POSITIVE} Given: -1.0"),
    ({"temperature": math.inf}, False, "temperature",
     f"`temperature` must be strictly positive: {POSITIVE} Given: inf"),
    ({"temperature": math.nan}, False, "temperature",
     f"`temperature` must be strictly positive: {POSITIVE} Given: nan"),
    # Positive and finite in float64, but 0 or infinity once sent as a float32.
    ({"temperature": 1e-50}, False, "temperature", f"`temperature` must be strictly positive: {POSITIVE} Given: 1e-50"),
    ({"temperature": 1e39}, False, "temperature", f"`temperature` must be strictly positive: {POSITIVE} Given: 1e+39"),
    ({"top_k": 0}, False, "top_k", "`top_k` must be strictly positive and at most the vocabulary size (512). Given: 0"),
    ({"top_k": -3}, False, "top_k",
     "`top_k` must be strictly positive and at most the vocabulary size (512). Given: -3"),
    ({"top_k": 513}, False, "top_k",
     "`top_k` must be strictly positive and at most the vocabulary size (512). Given: 513"),
    ({"top_k": 2**32}, False, "top_k",
     "`top_k` must be strictly positive and at most the vocabulary size (512). Given: 4294967296"),
    ({"top_p": 0.0}, False, "top_p",
     "`top_p` must be > 0.0 and <= 1.0: in [1.1754944e-38, 1] as a float32. Given: 0.0"),
    ({"top_p": 1.01}, False, "top_p",
     "`top_p` must be > 0.0 and <= 1.0: in [1.1754944e-38, 1] as a float32. Given: 1.01"),
    ({"top_p": 1e-50}, False, "top_p",
     "`top_p` must be > 0.0 and <= 1.0: in [1.1754944e-38, 1] as a float32. Given: 1e-50"),
    ({"typical_p": 0.0}, False, "typical_p",
     "`typical_p` must be > 0.0 and < 1.0: in [1.1754944e-38, 0.99999994] as a float32. Given: 0.0"),
    ({"typical_p": 1.0}, False, "typical_p",
     "`typical_p` must be > 0.0 and < 1.0: in [1.1754944e-38, 0.99999994] as a float32. Given: 1.0"),
    ({"typical_p": 0.99999999}, False, "typical_p",  # below 1, but 1.0 as a float32
     "`typical_p` must be > 0.0 and < 1.0: in [1.1754944e-38, 0.99999994] as a float32. Given: 0.99999999"),
    ({"repetition_penalty": 0.0}, False, "repetition_penalty",
     f"`repetition_penalty` must be strictly positive: {POSITIVE} Given: 0.0"),
    ({"repetition_penalty": 1e39}, False, "repetition_penalty",
     f"`repetition_penalty` must be strictly positive: {POSITIVE} Given: 1e+39"),
    ({"frequency_penalty": 2.5}, False, "frequency_penalty",
     "`frequency_penalty` must be >= -2.0 and <= 2.0. Given: 2.5"),
    ({"frequency_penalty": -2.01}, False, "frequency_penalty",
     "`frequency_penalty` must be >= -2.0 and <= 2.0. Given: -2.01"),
    ({"presence_penalty": 3.0}, False, "presence_penalty", "`presence_penalty` must be >= -2.0 and <= 2.0. Given: 3.0"),
    ({"presence_penalty": math.nan}, False, "presence_penalty",
     "`presence_penalty` must be >= -2.0 and <= 2.0. Given: nan"),
    ({"max_new_tokens": 0}, False, "max_new_tokens", "`max_new_tokens` must be strictly positive"),
    ({"max_new_tokens": -5}, False, "max_new_tokens", "`max_new_tokens` must be strictly positive"),
    ({"seed": -1}, False, "seed", f"`seed` must be >= 0 and <= {MAX_SEED}. Given: -1"),
    ({"seed": 2**64}, False, "seed", f"`seed` must be >= 0 and <= {MAX_SEED}. Given: {2**64}"),
    ({"truncate": 0}, False, "truncate", "`truncate` must be between 1 and 32. Given: 0"),
    ({"truncate": 33}, False, "truncate", "`truncate` must be between 1 and 32. Given: 33"),
    ({"stop": ["a", "b", "c", "d"]}, False, "stop", "`stop` supports up to 3 stop sequences. Given: 4"),
    ({"stop": ["ok", ""]}, False, "stop", "`stop` sequences must not be empty strings"),
    ({"best_of": 3, "do_sample": True}, False, "best_of", "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 0}, False, "best_of", "`best_of` must be > 0 and <= 2. Given: 0"),
    ({"best_of": 2}, False, "best_of", "you must use sampling when `best_of` is > 1"),
    ({"best_of": 2, "temperature": 1.0}, False, "best_of", "you must use sampling when `best_of` is > 1"),
    ({"best_of": 2, "do_sample": True, "seed": 5}, False, "seed", "`seed` must not be set when `best_of` > 1"),
    ({"best_of": 2, "do_sample": True}, True, "best_of", "`best_of` != 1 is not supported when streaming tokens"),
    ({"decoder_input_details": True}, True, "decoder_input_details",
     "`decoder_input_details` == true is not supported when streaming tokens"),
    ({"top_n_tokens": 6}, False, "top_n_tokens", "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"top_n_tokens": -1}, False, "top_n_tokens", "`top_n_tokens` must be >= 0 and <= 5. Given: -1"),
    ({"return_k_alternatives": 9}, False, "return_k_alternatives",
     "`return_k_alternatives` must be >= 0 and <= 5. Given: 9"),
    ({"top_n_tokens": 2, "return_k_alternatives": 3}, False, "top_n_tokens",
     "`top_n_tokens` and `return_k_alternatives` are aliases and must be equal when both are given. "
     "Given: 2 and 3"),
    ({"speculative_tokens": 5}, False, "speculative_tokens", "`speculative_tokens` must be >= 0 and <= 4. Given: 5"),
    ({"speculative_tokens": -1}, False, "speculative_tokens",
     "`speculative_tokens` must be >= 0 and <= 4. Given: -1"),
    ({"adapter_source": "ftp"}, False, "adapter_source",
     "`adapter_source` must be one of ['hub', 'local']. Given: 'ftp'"),
    ({"adapter_id": "org/a", "adapter_source": "s3"}, False, "adapter_source",
     "`adapter_source` must be one of ['hub', 'local']. Given: 's3'"),
    ({"adapter_id": "a" * 257}, False, "adapter_id", "`adapter_id` must be at most 256 characters. Given: 257"),
    ({"adapter_id": "org/lora\n"}, False, "adapter_id", "`adapter_id` must not contain control characters"),
    ({"adapter_id": "org/\x00lora"}, False, "adapter_id", "`adapter_id` must not contain control characters"),
    ({"adapter_id": "org/\x7flora"}, False, "adapter_id", "`adapter_id` must not contain control characters"),
    ({"adapter_id": " org/lora"}, False, "adapter_id", "`adapter_id` must not start or end with whitespace"),
    ({"grammar": {"type": "xml", "value": "<a/>"}}, False, "grammar.type",
     "`grammar.type` must be one of json, json_object, regex. Given: 'xml'"),
    ({"grammar": {"type": "regex", "value": "a+"}, "response_format": {"type": "json_object"}}, False, "grammar",
     "`grammar` and `response_format` cannot both be set: give one"),
    ({"response_format": {"type": "json_object", "schema": [1]}}, False, "response_format.schema",
     "`response_format.schema` must be a JSON schema: an object. Given: list"),
    ({"watermark": True}, False, "watermark", "`watermark` is not supported"),
    ({"adapter_id": "a", "merged_adapters": {"ids": ["a", "b"], "weights": [0.5, 0.5]}}, False, "merged_adapters",
     "at most one of `adapter_id` or `adapters` may be provided"),
]


@pytest.mark.parametrize(("kwargs", "stream", "field", "message"), REJECTED)
def test_rejected_parameters_name_field_and_limit(validator, kwargs, stream, field, message):
    with pytest.raises(ValidationError) as info:
        validator.validate(PROMPT, params(**kwargs), stream=stream)
    assert info.value.message == message
    assert str(info.value) == message
    assert info.value.field == field
    assert info.value.error_type == "validation"


def test_empty_inputs_rejected(validator):
    with pytest.raises(ValidationError) as info:
        validator.validate("", GenerateParameters())
    assert (info.value.field, info.value.message) == ("inputs", "`inputs` cannot be empty")


def test_best_of_disabled_when_limit_is_one(tokenizer):
    limits = ValidationLimits(max_input_tokens=32, max_total_tokens=64, max_best_of=1)
    validator = Validator(tokenizer, limits, random.Random(0))
    with pytest.raises(ValidationError, match="`best_of` != 1 is not allowed for this endpoint"):
        validator.validate(PROMPT, params(best_of=2, do_sample=True))
    assert validator.validate(PROMPT, params(best_of=1)).best_of == 1


def test_best_of_accepted_with_sampling(validator):
    request = validator.validate(PROMPT, params(best_of=2, top_k=10))
    assert request.best_of == 2
    assert request.sampling.do_sample is True
    assert 0 <= request.sampling.seed <= MAX_SEED  # a seed is still drawn; the server derives one per sequence


def test_input_length_limit(validator, tokenizer):
    long_prompt = " ".join(f"word{i}" for i in range(100))
    length = prompt_length(tokenizer, long_prompt)
    assert length > LIMITS.max_input_tokens
    with pytest.raises(ValidationError) as info:
        validator.validate(long_prompt, GenerateParameters())
    assert info.value.field == "inputs"
    assert info.value.message == f"`inputs` must have at most 32 tokens. Given: {length}"


def test_truncate_keeps_last_tokens_before_length_checks(validator, tokenizer):
    long_prompt = " ".join(f"word{i}" for i in range(100))
    full_ids = tokenizer.encode(long_prompt).ids
    request = validator.validate(long_prompt, params(truncate=10, max_new_tokens=5))
    assert request.input_ids == tuple(full_ids[-10:])
    assert request.truncate == 10
    assert request.inputs == long_prompt  # the text is kept as received
    # A truncate longer than the prompt keeps it whole.
    short = validator.validate(PROMPT, params(truncate=32))
    assert short.input_ids == tuple(tokenizer.encode(PROMPT).ids)


def test_total_tokens_limit(validator, tokenizer):
    length = prompt_length(tokenizer)
    allowed = LIMITS.max_total_tokens - length
    assert validator.validate(PROMPT, params(max_new_tokens=allowed)).stopping.max_new_tokens == allowed
    with pytest.raises(ValidationError) as info:
        validator.validate(PROMPT, params(max_new_tokens=allowed + 1))
    assert info.value.field == "max_new_tokens"
    assert info.value.message == (
        f"`inputs` tokens + `max_new_tokens` must be <= 64. Given: {length} `inputs` tokens and "
        f"{allowed + 1} `max_new_tokens`"
    )


def test_position_limit_counts_speculative_lookahead(tokenizer):
    limits = ValidationLimits(
        max_input_tokens=32, max_total_tokens=64, max_speculative_tokens=4, max_position_embeddings=40
    )
    validator = Validator(tokenizer, limits, random.Random(0))
    length = prompt_length(tokenizer)
    room = 40 - length - 4
    # Default: capped by the position limit, not just by max_total_tokens.
    assert validator.validate(PROMPT, GenerateParameters()).stopping.max_new_tokens == room
    assert validator.validate(PROMPT, params(max_new_tokens=room)).stopping.max_new_tokens == room
    with pytest.raises(ValidationError) as info:
        validator.validate(PROMPT, params(max_new_tokens=room + 1))  # within max_total_tokens (64)
    assert info.value.field == "max_new_tokens"
    assert info.value.message == (
        f"`inputs` tokens + `max_new_tokens` + speculative tokens must be <= 40 (the model's maximum positions). "
        f"Given: {length} `inputs` tokens, {room + 1} `max_new_tokens` and 4 speculative tokens"
    )
    # A request that speculates less may generate more.
    request = validator.validate(PROMPT, params(speculative_tokens=0, max_new_tokens=room + 4))
    assert request.stopping.max_new_tokens == room + 4
    assert request.speculative_tokens == 0


def test_position_limit_leaves_no_room(tokenizer):
    length = prompt_length(tokenizer)
    limits = ValidationLimits(
        max_input_tokens=32, max_total_tokens=64, max_speculative_tokens=4, max_position_embeddings=length + 4
    )
    validator = Validator(tokenizer, limits, random.Random(0))
    with pytest.raises(ValidationError, match="the model's maximum positions") as info:
        validator.validate(PROMPT, GenerateParameters())
    assert f"Given: {length} `inputs` tokens, 1 `max_new_tokens` and 4 speculative tokens" in info.value.message


def test_given_seed_is_kept(validator):
    assert validator.validate(PROMPT, params(seed=1234, do_sample=True)).sampling.seed == 1234
    assert validator.validate(PROMPT, params(seed=MAX_SEED)).sampling.seed == MAX_SEED
    assert validator.validate(PROMPT, params(seed=0)).sampling.seed == 0


def test_missing_seed_is_drawn_from_the_rng(tokenizer):
    def seeds(rng_seed: int) -> list[int]:
        validator = Validator(tokenizer, LIMITS, random.Random(rng_seed))
        return [validator.validate(PROMPT, params(do_sample=True)).sampling.seed for _ in range(3)]

    first = seeds(7)
    assert first == seeds(7)  # deterministic with a seeded generator
    assert first != seeds(8)
    assert len(set(first)) == 3  # a fresh seed per request
    assert all(0 <= seed <= MAX_SEED for seed in first)
    assert Validator(tokenizer, LIMITS).validate(PROMPT, GenerateParameters()).sampling.seed >= 0


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"top_n_tokens": 3}, 3),
        ({"return_k_alternatives": 4}, 4),
        ({"top_n_tokens": 2, "return_k_alternatives": 2}, 2),
        ({"top_n_tokens": 0}, 0),
        ({"top_n_tokens": 5}, 5),
        ({}, 0),
    ],
)
def test_top_n_tokens_aliases(validator, kwargs, expected):
    assert validator.validate(PROMPT, params(**kwargs)).top_n_tokens == expected


def test_empty_adapter_id_means_base_model(validator):
    request = validator.validate(PROMPT, params(adapter_id="", adapter_source="local", api_token="secret"))
    assert (request.adapter_id, request.adapter_source, request.api_token) == (None, None, None)


def test_adapter_source_defaults_to_the_servers(tokenizer):
    assert Validator(tokenizer, LIMITS).validate(PROMPT, params(adapter_id="a")).adapter_source == "hub"
    local = Validator(tokenizer, LIMITS, default_adapter_source="local")
    request = local.validate(PROMPT, params(adapter_id="x" * 256))
    assert (request.adapter_id, request.adapter_source) == ("x" * 256, "local")
    assert local.validate(PROMPT, params(adapter_id="a", adapter_source="hub")).adapter_source == "hub"
    with pytest.raises(ValueError, match="--adapter-source must be one of hub, local"):
        Validator(tokenizer, LIMITS, default_adapter_source="s3")


def test_api_token_is_kept_for_the_load_but_never_shown(validator):
    request = validator.validate(PROMPT, params(adapter_id="org/private", api_token="hf_secret_token"))
    assert request.api_token == "hf_secret_token"
    assert "hf_secret_token" not in repr(request) and "hf_secret_token" not in str(request)
    with pytest.raises(ValidationError) as info:
        validator.validate(PROMPT, params(adapter_id="org/\x00", api_token="hf_secret_token"))
    assert "hf_secret_token" not in info.value.message


def test_checks_run_before_tokenisation(tokenizer):
    class ExplodingTokenizer:
        def encode_batch(self, *args, **kwargs):
            raise AssertionError("tokenised an invalid request")

    validator = Validator(ExplodingTokenizer(), LIMITS)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="temperature"):
        validator.validate(PROMPT, params(temperature=0.0))


def test_tokenizer_failure_is_a_validation_error():
    class FailingTokenizer:
        def encode_batch(self, *args, **kwargs):
            raise Exception("bad input")

    validator = Validator(FailingTokenizer(), LIMITS)  # type: ignore[arg-type]
    with pytest.raises(ValidationError) as info:
        validator.validate(PROMPT, GenerateParameters())
    assert (info.value.field, info.value.message) == ("inputs", "tokenizer error bad input")


def test_wire_type_edges_are_accepted(validator):
    """The largest and smallest values each float32 / uint32 field can hold pass, so the bounds are not too tight."""
    tiny, huge, below_one = FLOAT32_MIN_NORMAL, FLOAT32_MAX, FLOAT32_BELOW_ONE
    s = validator.validate(PROMPT, params(temperature=tiny, top_k=512, top_p=tiny, typical_p=below_one,
                                          repetition_penalty=huge, frequency_penalty=1e-45, seed=MAX_SEED)).sampling
    assert (s.temperature, s.top_k, s.top_p, s.typical_p, s.repetition_penalty) == (tiny, 512, tiny, below_one, huge)
    assert struct.unpack("f", struct.pack("f", s.temperature))[0] > 0.0  # still positive on the wire
    assert struct.unpack("f", struct.pack("f", s.typical_p))[0] < 1.0
    assert validator.validate(PROMPT, params(temperature=huge)).sampling.temperature == huge


def test_top_k_is_bounded_by_the_workers_vocabulary(tokenizer):
    validator = Validator(tokenizer, ValidationLimits(max_input_tokens=32, max_total_tokens=64, vocab_size=1024))
    assert validator.max_top_k == 1024 and validator.validate(PROMPT, params(top_k=1024)).sampling.top_k == 1024
    with pytest.raises(ValidationError, match=r"vocabulary size \(1024\). Given: 1025"):
        validator.validate(PROMPT, params(top_k=1025))


def test_tokenize_applies_the_input_limits_and_truncate(validator, tokenizer):
    long_text = "def f(x): return x\n" * 20
    num_tokens = len(tokenizer.encode(long_text).ids)
    assert num_tokens > LIMITS.max_input_tokens
    with pytest.raises(ValidationError) as info:
        validator.tokenize(long_text)
    assert (info.value.field, info.value.message) == (
        "inputs", f"`inputs` must have at most {LIMITS.max_input_tokens} tokens. Given: {num_tokens}")
    tail = validator.tokenize(long_text, truncate=10)
    assert [t.id for t in tail] == tokenizer.encode(long_text).ids[-10:]
    encoded = long_text.encode("utf-8")
    assert tail[-1].stop == len(encoded) and all(t.text == encoded[t.start:t.stop].decode() for t in tail)
    with pytest.raises(ValidationError, match="`truncate` must be between 1 and 32. Given: 33"):
        validator.tokenize("hi", truncate=33)


def test_truncated_tokenize_keeps_byte_offsets_into_the_whole_input(validator, tokenizer):
    text = "é🚀" * 40 + " tail"
    tail = validator.tokenize(text, truncate=3)
    encoded = text.encode("utf-8")
    assert [t.id for t in tail] == tokenizer.encode(text).ids[-3:]
    assert tail[-1].stop == len(encoded) and tail[-1].text == encoded[tail[-1].start:tail[-1].stop].decode()


def test_tokenize_offsets_are_utf8_bytes(validator, tokenizer):
    text = "héllo 🚀 x"
    tokens = validator.tokenize(text)
    encoding = tokenizer.encode(text)
    assert [t.id for t in tokens] == encoding.ids
    assert tokens[0].id == BOS_ID and tokens[0].special and tokens[0].text == "<s>"
    encoded = text.encode("utf-8")
    for token in tokens[1:]:
        assert not token.special
        assert 0 <= token.start < token.stop <= len(encoded)
        assert token.text == encoded[token.start : token.stop].decode("utf-8")
    assert tokens[-1].stop == len(encoded)
    rocket = [t for t in tokens if t.text == "🚀"]
    assert rocket and all((t.start, t.stop) == (7, 11) for t in rocket)  # "h"=1, "é"=2, "llo "=4 bytes
    assert [t.id for t in validator.tokenize(text, add_special_tokens=False)] == encoding.ids[1:]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_input_tokens": 0, "max_total_tokens": 8}, "max_input_tokens must be >= 1"),
        ({"max_input_tokens": 8, "max_total_tokens": 8}, "max_total_tokens (8) must be > max_input_tokens (8)"),
        ({"max_input_tokens": 4, "max_total_tokens": 8, "max_best_of": 0}, "max_best_of must be >= 1"),
        ({"max_input_tokens": 4, "max_total_tokens": 8, "max_top_n_tokens": -1}, "max_top_n_tokens must be >= 0"),
        ({"max_input_tokens": 4, "max_total_tokens": 8, "max_position_embeddings": 0},
         "max_position_embeddings must be >= 1"),
    ],
)
def test_limits_are_checked(kwargs, message):
    with pytest.raises(ValueError) as info:
        ValidationLimits(**kwargs)
    assert message in str(info.value)


def test_format_request_errors():
    errors = [
        {"loc": ("body", "parameters", "top_k"), "msg": "Input should be a valid integer"},
        {"loc": ("body", "inputs"), "msg": "Field required"},
    ]
    assert format_request_errors(errors) == (
        "`parameters.top_k`: Input should be a valid integer; `inputs`: Field required"
    )
    assert format_request_errors([]) == "invalid request body"


def test_prompt_logprobs_need_the_prompt_in_one_prefill(tokenizer):
    """Longer prompts are prefilled in chunks, but prompt log-probabilities need every row in one forward."""
    limits = ValidationLimits(max_input_tokens=32, max_total_tokens=64, max_batch_prefill_tokens=8)
    validator = Validator(tokenizer, limits, rng=random.Random(0))
    long = "a b c d e f g h i j k l"
    assert len(validator.validate(long, GenerateParameters(max_new_tokens=2)).input_ids) > 8  # chunked, fine
    with pytest.raises(ValidationError, match=r"at most 8 tokens \(--max-batch-prefill-tokens\)") as e:
        validator.validate(long, GenerateParameters(max_new_tokens=2, decoder_input_details=True))
    assert e.value.field == "decoder_input_details"
    assert validator.validate("a", GenerateParameters(max_new_tokens=2, decoder_input_details=True))


def test_logit_bias_is_sorted_by_id_without_zero_biases_and_does_not_turn_sampling_on(validator):
    s = validator.validate(PROMPT, params(logit_bias={"7": -100, "3": 0.5, "9": 0, "0": 100.0})).sampling
    assert s.logit_bias == ((0, 100.0), (3, 0.5), (7, -100.0)) and not s.do_sample
    assert validator.validate(PROMPT, params(logit_bias={})).sampling.logit_bias == ()
    assert validator.validate(PROMPT, params()).sampling.logit_bias == ()


def test_logit_bias_keys_are_token_ids_of_the_workers_vocabulary(tokenizer):
    validator = Validator(tokenizer, ValidationLimits(max_input_tokens=32, max_total_tokens=64, vocab_size=1024))
    assert validator.validate(PROMPT, params(logit_bias={"1023": 1})).sampling.logit_bias == ((1023, 1.0),)
    for key in ("1024", "-1", "07", "+7", "7 ", "7\n", "x", "", "1e3", "9" * 5000):
        with pytest.raises(ValidationError, match=r"`logit_bias` keys must be token ids in \[0, 1023\]") as e:
            validator.validate(PROMPT, params(logit_bias={key: 1}))
        assert e.value.field == "logit_bias"
        assert len(e.value.message) < 200  # a huge key is not echoed whole


@pytest.mark.parametrize("value", [100.0001, -100.5, 1e300, math.inf, -math.inf, math.nan])
def test_logit_bias_values_lie_in_minus_100_to_100(validator, value):
    assert validator.validate(PROMPT, params(logit_bias={"5": 100, "6": -100})).sampling.logit_bias == (
        (5, 100.0), (6, -100.0))
    with pytest.raises(ValidationError, match=r"`logit_bias` values must be >= -100 and <= 100. Given: .* for "
                                              r"token 5") as e:
        validator.validate(PROMPT, params(logit_bias={"5": value}))
    assert e.value.field == "logit_bias"


def test_logit_bias_holds_at_most_300_tokens(validator):
    assert len(validator.validate(PROMPT, params(logit_bias={str(i): 1 for i in range(300)})).sampling.logit_bias) \
        == 300
    with pytest.raises(ValidationError, match=r"at most 300 tokens. Given: 301"):
        validator.validate(PROMPT, params(logit_bias={str(i): 1 for i in range(301)}))
