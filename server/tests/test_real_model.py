"""The real-model tier: SmolLM2-135M-Instruct (a Q4_1 GGUF from the package index, `specula_testing.real_model`).

Served output against transformers loading the same GGUF, chat prompts against `apply_chat_template`, three
shards against one, speculation against none, and `--quantize` against the float model on text that is in no
corpus of this repository's models (an English passage written for this test; a third-party package's Python).
"""

from __future__ import annotations

import math
from pathlib import Path

import jinja2
import pytest
import torch
import transformers
from test_tensor_parallel import run_ranks
from tokenizers import pre_tokenizers

from specula_router.chat_template import load_chat_template
from specula_server.hub import resolve_model_dir
from specula_server.params import SamplingParams
from specula_server.tokens import load_tokenizer
from specula_testing.real_model import fetch_smollm2
from specula_testing.worker import (
    BlockPool,
    assert_same_greedy_output,
    generate_alone,
    load_test_generator,
    make_spec,
    step,
    token_ids,
)

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Rewrite this function so that its parameter is called `items` instead of `xs`:\n\n"
                                 "def total(xs):\n    result = 0\n    for x in xs:\n        result += x\n"
                                 "    return result\n"}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Summarize: The lighthouse was built in 1871 and automated in 1964. Today the "
                                 "keeper's house is a museum with 12 rooms."}],
    [{"role": "user", "content": "Name three prime numbers."},
     {"role": "assistant", "content": "2, 3 and 5."},
     {"role": "user", "content": "Three more, please."}],
    [{"role": "user", "content": "Écris une phrase sur la mer. 日本語でも。"}],
]
NUM_NEW = 24
ENGLISH = Path(__file__).parent / "data" / "held_out_english.txt"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return fetch_smollm2()


@pytest.fixture(scope="module")
def model_dir(smollm2) -> Path:
    return resolve_model_dir(str(smollm2))


@pytest.fixture(scope="module")
def generator(smollm2):
    return load_test_generator(smollm2, num_blocks=512)


@pytest.fixture(scope="module")
def reference(smollm2):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_prompts(model_dir) -> list[list[int]]:
    """Each conversation rendered by the router's chat template and tokenized as the router does."""
    template, tokenizer = load_chat_template(model_dir), load_tokenizer(model_dir)
    return [tokenizer.encode(template.render(chat), add_special_tokens=False).ids for chat in CHATS]


def hub_tokenizer(smollm2: Path):
    """transformers' tokenizer for the file, splitting digits first as the model's own tokenizer.json on the Hub
    does (and llama.cpp for `tokenizer.ggml.pre = smollm`): transformers' GGUF reader leaves that split out."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tokenizer


def test_chat_prompts_equal_apply_chat_template(smollm2, chat_prompts):
    tokenizer = hub_tokenizer(smollm2)
    for chat, ids in zip(CHATS, chat_prompts):
        assert ids == tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)


def reference_greedy(model, prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """transformers' greedy decoding over its own KV cache, past any EOS; the tokens and their log-probabilities."""
    tokens, logprobs = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(num_new):
            logits = out.logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


def test_greedy_chat_answers_match_transformers_on_the_same_file(generator, reference, chat_prompts):
    for i, prompt in enumerate(chat_prompts):
        outputs = generate_alone(generator, make_spec(i, prompt, BlockPool(512, 16), max_new_tokens=NUM_NEW))
        expected_tokens, expected_logprobs = reference_greedy(reference, prompt, NUM_NEW)
        assert token_ids(outputs) == expected_tokens, i
        assert [t.logprob for o in outputs for t in o.tokens] == pytest.approx(expected_logprobs, abs=2e-4)


def test_the_model_answers_like_a_model(generator, chat_prompts):
    spec = make_spec(0, chat_prompts[0], BlockPool(512, 16), max_new_tokens=NUM_NEW, ignore_eos_token=False)
    assert generate_alone(generator, spec)[-1].generated_text.text == "The capital of France is Paris."


def test_three_shards_answer_as_one(smollm2, generator, chat_prompts):
    """9 query and 3 KV heads split over three ranks (two would split a head)."""
    prompts = chat_prompts[:3]
    expected = [token_ids(generate_alone(generator, make_spec(i, p, BlockPool(512, 16), max_new_tokens=NUM_NEW)))
                for i, p in enumerate(prompts)]
    settings = {"prompts": prompts, "max_new_tokens": NUM_NEW, "num_blocks": 512, "samplings": [SamplingParams()]}
    results = run_ranks(smollm2, settings, world_size=3)
    assert all(results[rank] == expected for rank in range(3))


@pytest.mark.parametrize("speculator", ["", "suffix"])
def test_speculation_leaves_greedy_answers_unchanged(smollm2, generator, chat_prompts, speculator):
    drafted = load_test_generator(smollm2, num_blocks=512, speculative_tokens=4, speculator=speculator)

    def run(gen, prompt):
        return generate_alone(gen, make_spec(0, prompt, BlockPool(512, 16), max_new_tokens=32, lookahead=4))

    assert_same_greedy_output(generator, drafted, chat_prompts[:4], run)


def perplexity(generator, ids: list[int]) -> float:
    (out,) = step(generator, new=[make_spec(0, ids, BlockPool(512, 16), max_new_tokens=1, prefill_logprobs=True)])
    step(generator, finished=[0])
    logprobs = [t.logprob for t in out.prefill_tokens[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def held_out_texts(model_dir: Path) -> dict[str, list[int]]:
    tokenizer = load_tokenizer(model_dir)
    code = (Path(jinja2.__file__).parent / "utils.py").read_text()[:4000]
    return {"english": tokenizer.encode(ENGLISH.read_text()).ids, "code": tokenizer.encode(code).ids}


# Perplexity of each setting over the float model's, at most (measured: int8 +0.4% / -0.1%, w8a8 +0.6% / +0.6%, int4
# with groups of 32 +7.8% / +3.6% on English / code; docs/benchmarks.md), and whether its greedy answer to the first
# chat is the float model's (int4's is not: it parts at the first token). The LM head, tied to the Q8_0 embedding,
# is quantized too.
PERPLEXITY_TOLERANCE = {("int8", 64): 1.02, ("w8a8", 64): 1.02, ("int4", 32): 1.12}
SAME_ANSWER = {("int8", 64): True, ("w8a8", 64): True, ("int4", 32): False}


@pytest.mark.parametrize("method,group_size", list(PERPLEXITY_TOLERANCE))
def test_quantized_weights_keep_perplexity_within_tolerance(smollm2, generator, model_dir, chat_prompts, method,
                                                            group_size):
    quantized = load_test_generator(smollm2, num_blocks=512, quantize=method, quantize_group_size=group_size)
    for name, ids in held_out_texts(model_dir).items():
        base, ours = perplexity(generator, ids), perplexity(quantized, ids)
        assert ours <= base * PERPLEXITY_TOLERANCE[(method, group_size)], (name, base, ours)
    answers = [generate_alone(g, make_spec(0, chat_prompts[0], BlockPool(512, 16), max_new_tokens=NUM_NEW,
                                           ignore_eos_token=False))[-1].generated_text.text
               for g in (generator, quantized)]
    assert (answers[1] == answers[0]) == SAME_ANSWER[(method, group_size)], answers


def test_the_files_own_blocks_keep_the_float_models_answers_and_perplexity(smollm2, generator, model_dir,
                                                                           chat_prompts):
    """`--quantize gguf` multiplies the very values the float model holds (the file's Q4_1 layers and its Q8_0
    embedding as the LM head); only the order of the float32 sums differs."""
    served = load_test_generator(smollm2, num_blocks=512, quantize="gguf")
    for name, ids in held_out_texts(model_dir).items():
        assert perplexity(served, ids) == pytest.approx(perplexity(generator, ids), rel=1e-3), name

    def run(gen, prompt):
        return generate_alone(gen, make_spec(0, prompt, BlockPool(512, 16), max_new_tokens=NUM_NEW))

    assert_same_greedy_output(generator, served, chat_prompts, run)


def test_the_model_writes_its_own_training_prompts(smollm2, model_dir, tmp_path):
    """`specula-train prompts`: the messages SmolLM2 writes at its user turn, as transformers renders each chat."""
    import json

    from typer.testing import CliRunner

    from specula_server.training.cli import app

    out = tmp_path / "prompts.jsonl"
    result = CliRunner().invoke(app, ["prompts", "--model-id", str(smollm2), "--count", "6", "--output", str(out),
                                      "--max-new-tokens", "64", "--generation-batch-size", "8"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    messages = [row["message"] for row in rows]
    assert len(rows) == 6 and len(set(messages)) == 6 and all(len(m) >= 8 for m in messages)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    for row in rows:
        assert row["prompt"] == tokenizer.apply_chat_template([{"role": "user", "content": row["message"]}],
                                                              tokenize=False, add_generation_prompt=True)
