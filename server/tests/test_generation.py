"""Stopping, text and loading behaviour of whole generations through the worker."""

from __future__ import annotations

import pytest

from specula_proto import generate_pb2 as pb
from specula_server.params import FinishReason, SamplingParams
from specula_server.service import request_from_pb
from specula_testing.models import build_tiny_model
from specula_testing.worker import (
    BlockPool,
    generate_alone,
    load_test_generator,
    make_spec,
    stop_ending_inside_a_token,
    token_ids,
    token_texts,
)

PROMPT = [1, 50, 60, 70, 80, 90, 100]


@pytest.fixture(scope="module")
def generator(llama_dir):
    return load_test_generator(llama_dir)


def run(generator, max_new_tokens=24, **kwargs):
    spec = make_spec(0, PROMPT, BlockPool(256, 16), max_new_tokens=max_new_tokens, **kwargs)
    return generate_alone(generator, spec)


def test_token_texts_concatenate_to_the_generated_text(generator):
    outputs = run(generator, max_new_tokens=32, sampling=SamplingParams(do_sample=True, seed=3))
    final = outputs[-1].generated_text
    assert final.finish_reason is FinishReason.LENGTH and final.generated_tokens == 32
    assert "".join(t.text for o in outputs for t in o.tokens) == final.text
    assert final.text == generator.tokenizer.decode(token_ids(outputs), skip_special_tokens=True)
    assert final.seed == 3


def test_byte_fallback_pieces_add_up_to_the_generated_text(tmp_path):
    """Valid multi-byte characters are covered by test_tokens.py; here a random model emits stray byte tokens."""
    model_dir = build_tiny_model(tmp_path / "meta", "llama", tokenizer_kind="metaspace", seed=5)
    generator = load_test_generator(model_dir)
    outputs = run(generator, max_new_tokens=48, sampling=SamplingParams(do_sample=True, temperature=1.5, seed=11))
    pieces = [t.text for o in outputs for t in o.tokens]
    assert any(len(generator.tokenizer.id_to_token(t)) == 6 for t in token_ids(outputs))  # byte tokens <0xNN>
    assert "".join(pieces) == outputs[-1].generated_text.text


def test_stop_sequence_ends_generation_and_the_text_ends_with_it(generator):
    full = run(generator, max_new_tokens=24)[-1].generated_text.text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    outputs = run(generator, max_new_tokens=24, stop_sequences=[stop])
    final = outputs[-1].generated_text
    assert final.finish_reason is FinishReason.STOP_SEQUENCE
    # The text is the unstopped text up to the end of the first occurrence of the stop sequence.
    assert final.text == full[: full.find(stop) + len(stop)]
    assert "".join(token_texts(outputs)) == final.text
    assert final.generated_tokens == len(token_ids(outputs)) < 24


@pytest.mark.parametrize("span_tokens", [False, True], ids=["inside-a-token", "across-tokens"])
def test_a_stop_ending_inside_a_token_cuts_that_token_text(generator, span_tokens):
    unstopped = run(generator, max_new_tokens=24)
    pieces = token_texts(unstopped)
    stop, k, cut = stop_ending_inside_a_token(pieces, span_tokens)
    outputs = run(generator, max_new_tokens=24, stop_sequences=["never generated", stop])
    final = outputs[-1].generated_text
    assert final.finish_reason is FinishReason.STOP_SEQUENCE
    # Token ids stay whole: the token that completed the stop is the last one, and it counts.
    assert token_ids(outputs) == token_ids(unstopped)[: k + 1] and final.generated_tokens == k + 1
    assert outputs[-1].tokens[-1].text == pieces[k][:cut] != pieces[k]
    assert final.text == "".join(pieces[:k]) + pieces[k][:cut] == "".join(token_texts(outputs))
    assert final.text.endswith(stop)


def test_eos_ends_generation_unless_ignored(generator):
    tokens = token_ids(run(generator, max_new_tokens=12))
    eos = tokens[5]
    first = tokens.index(eos)
    saved = generator.eos_token_ids
    try:
        generator.eos_token_ids = frozenset({eos})
        stopped = run(generator, max_new_tokens=12, ignore_eos_token=False)
        assert token_ids(stopped) == tokens[: first + 1]
        assert stopped[-1].generated_text.finish_reason is FinishReason.EOS_TOKEN
        ignored = run(generator, max_new_tokens=12, ignore_eos_token=True)
        assert token_ids(ignored) == tokens
    finally:
        generator.eos_token_ids = saved


def test_max_new_tokens_is_exact(generator):
    for n in (1, 2, 7):
        outputs = run(generator, max_new_tokens=n)
        assert len(token_ids(outputs)) == n and outputs[-1].generated_text.generated_tokens == n


def test_truncate_keeps_the_last_prompt_tokens(generator):
    text = "def main():\n    return sorted(values, key=len)\n"
    full = generator.tokenizer.encode(text).ids
    req = pb.Request(id=1, inputs=text, truncate=5,
                     stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=1))
    assert request_from_pb(req, generator).input_ids == tuple(full[-5:])


def test_top_n_tokens_are_sorted_and_include_the_greedy_choice(generator):
    outputs = run(generator, max_new_tokens=4, top_n_tokens=3)
    for out in outputs:
        (top,) = out.top_tokens
        assert len(top) == 3 and top[0].id == out.tokens[0].id
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)


def test_sharded_checkpoint_loads_identically(tmp_path, generator):
    sharded = build_tiny_model(tmp_path / "sharded", "llama", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert token_ids(run(load_test_generator(sharded))) == token_ids(run(generator))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs(llama_dir, dtype, generator):
    half = load_test_generator(llama_dir, dtype=dtype)
    assert str(half.dtype) == f"torch.{dtype}"
    outputs = run(half, max_new_tokens=8)
    assert len(token_ids(outputs)) == 8
    assert token_ids(outputs)[0] == token_ids(run(generator, max_new_tokens=1))[0]
