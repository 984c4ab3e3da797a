"""Structured output in the worker: every generated token follows the request's grammar, under speculation too.

The references are llguidance's own compilation of the schema or regex, `jsonschema` and `re.fullmatch` on
the outputs; exactness against the same worker without drafts (greedy tokens, and a chi-square test of the
sampled distribution).
"""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import llguidance
import pytest
import torch
from test_speculation import chi_square_p_value, memory_bound_costs

from specula_server.grammar import GrammarCompiler, MaskJob, apply_masks, mask_words
from specula_server.params import SamplingParams
from specula_server.speculation.drafters import Draft
from specula_server.speculation.speculator import GRAMMAR_METHOD, within_grammar
from specula_testing.adapters import build_medusa_adapter
from specula_testing.worker import (
    BlockPool,
    generate_alone,
    load_test_generator,
    make_spec,
    run_steps,
    step,
    token_ids,
)

# Nested objects, arrays, enums, integer ranges and string lengths; every string and array is bounded, so a
# complete output exists within a known number of tokens whatever a random model prefers.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "zip": {"type": "integer", "minimum": 10000,
                                                                               "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
MAX_JSON_TOKENS = 120  # more than the longest output the schema allows
REGEX = r"[a-c]{2,4}-[0-9]{1,3}( [xyz]+)?"
PROMPT = [1, 300, 301, 302, 303, 304]


def json_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def regex_grammar(regex: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(regex)


@pytest.fixture(scope="module")
def plain(llama_dir):
    return load_test_generator(llama_dir, num_blocks=1024)


@pytest.fixture(scope="module")
def medusa_dir(llama_dir, tmp_path_factory):
    return build_medusa_adapter(llama_dir, tmp_path_factory.mktemp("medusa") / "heads", num_heads=3)


def speculative(llama_dir, **settings):
    generator = load_test_generator(llama_dir, num_blocks=1024, speculative_tokens=4, speculation_mode="fixed",
                                    **settings)
    generator.speculator.step_cost = memory_bound_costs()
    return generator


@pytest.fixture(scope="module")
def drafting(llama_dir, medusa_dir):
    """Generators without speculation, with prompt lookup, and with Medusa heads."""
    return {
        "off": load_test_generator(llama_dir, num_blocks=1024),
        "ngram": speculative(llama_dir),
        "medusa": speculative(llama_dir, speculator=str(medusa_dir)),
    }


def texts_of(outputs, n: int) -> list[str]:
    """The generated text of requests 0 .. n-1 (each must have finished)."""
    texts = {o.request_id: o.generated_text.text for o in outputs if o.generated_text is not None}
    assert not [o.error for o in outputs if o.error]
    assert sorted(texts) == list(range(n))
    return [texts[i] for i in range(n)]


def sampled_specs(grammar: str, n: int, max_new_tokens: int, seed_offset: int = 0, lookahead: int = 8):
    pool = BlockPool(1024, 16)
    return [make_spec(i, PROMPT, pool, max_new_tokens=max_new_tokens, lookahead=lookahead, grammar=grammar,
                      sampling=SamplingParams(do_sample=True, temperature=1.0, seed=seed_offset + i))
            for i in range(n)]


@pytest.mark.parametrize("method", ["off", "ngram", "medusa"])
def test_sampled_outputs_follow_the_json_schema(drafting, method):
    """100 sampled outputs (temperature 1, a random model, different seeds), run as one batch: every one parses
    and validates against the schema."""
    outputs = run_steps(drafting[method], sampled_specs(json_grammar(SCHEMA), 100, MAX_JSON_TOKENS))
    for text in texts_of(outputs, 100):
        jsonschema.validate(json.loads(text), SCHEMA)
    finished = [o.generated_text for o in outputs if o.generated_text is not None]
    assert {g.finish_reason.value for g in finished} == {"eos_token"}  # the grammar ended them, not the length
    if method != "off":
        assert sum(o.num_drafted for o in outputs) > 0


@pytest.mark.parametrize("method", ["off", "ngram", "medusa"])
def test_sampled_outputs_match_the_regex(drafting, method):
    outputs = run_steps(drafting[method], sampled_specs(regex_grammar(REGEX), 50, 40))
    for text in texts_of(outputs, 50):
        assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("method", ["ngram", "medusa"])
def test_constrained_greedy_output_is_identical_with_speculation(drafting, method):
    for grammar in (json_grammar(SCHEMA), regex_grammar(REGEX)):
        pool = BlockPool(1024, 16)
        for prompt in (PROMPT, [1] + [50, 60, 70, 80] * 5):
            expected = generate_alone(drafting["off"], make_spec(0, prompt, pool, max_new_tokens=MAX_JSON_TOKENS,
                                                                 grammar=grammar, lookahead=8))
            got = generate_alone(drafting[method], make_spec(0, prompt, pool, max_new_tokens=MAX_JSON_TOKENS,
                                                             grammar=grammar, lookahead=8))
            assert token_ids(got) == token_ids(expected)
            assert [t.logprob for o in got for t in o.tokens] == pytest.approx(
                [t.logprob for o in expected for t in o.tokens], abs=1e-4)


def test_forced_tokens_are_drafted_and_accepted(drafting):
    """Long fixed keys: the grammar's forced tokens are verified as drafts, several per step."""
    schema = {"type": "object", "properties": {"customer_identifier": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9},
                                               "shipping_address_line": {"enum": ["north", "south"]}},
              "required": ["customer_identifier", "shipping_address_line"], "additionalProperties": False}
    pool = BlockPool(1024, 16)
    outputs = generate_alone(drafting["ngram"], make_spec(0, PROMPT, pool, max_new_tokens=60, lookahead=8,
                                                          grammar=json_grammar(schema)))
    text = outputs[-1].generated_text.text
    jsonschema.validate(json.loads(text), schema)
    forced = [o for o in outputs if o.draft_method == GRAMMAR_METHOD]
    assert forced and sum(o.num_accepted for o in forced) >= 5
    assert len(outputs) < len(token_ids(outputs))  # fewer steps than tokens


def test_logprobs_are_those_of_the_masked_distribution(plain):
    """A position the grammar allows one token at reports log-prob 0; top-n alternatives are allowed tokens."""
    pool = BlockPool(1024, 16)
    outputs = generate_alone(plain, make_spec(0, PROMPT, pool, max_new_tokens=20, grammar=regex_grammar("abc[0-9]"),
                                              top_n_tokens=3))
    tokens = [t for o in outputs for t in o.tokens]
    assert re.fullmatch("abc[0-9]", "".join(t.text for t in tokens))
    last = outputs[-1].top_tokens[-1]
    assert all(alt.text.isdigit() or alt.logprob == float("-inf") for alt in last)
    total = sum(torch.tensor(alt.logprob).exp().item() for alt in last)
    assert total <= 1.0 + 1e-5
    forced = [t for t in tokens[:-1]]  # "abc" is one path: each of its tokens is certain under the mask
    assert all(abs(t.logprob) < 1e-5 for t in forced)


def sample_under_grammar(generator, prompt, grammar, offset, n=1200) -> tuple[Counter, int]:
    """The first 3 tokens of n seeded samples, and how many drafts were verified."""
    counts, drafted = Counter(), 0
    pool = BlockPool(1024, 16)
    for seed in range(n):
        s = make_spec(0, prompt, pool, max_new_tokens=6, lookahead=4, grammar=grammar,
                      sampling=SamplingParams(do_sample=True, temperature=1.5, top_k=6, seed=seed + offset))
        outputs = generate_alone(generator, s)
        counts[tuple(token_ids(outputs)[:3])] += 1
        drafted += sum(o.num_drafted for o in outputs)
        pool.give(s.blocks)
    return counts, drafted


@pytest.fixture(scope="module")
def abc_prompt(plain) -> list[int]:
    """Text the regex below allows, repeated, so prompt lookup drafts tokens the grammar keeps."""
    return [1] + plain.tokenizer.encode("cab bad fed cab bad fed cab bad", add_special_tokens=False).ids


ABC_REGEX = "[a-f ]{3,12}"


def test_speculative_sampling_under_a_grammar_keeps_the_masked_distribution(llama_dir, abc_prompt):
    """Chi-square of the first 3 sampled tokens under a grammar: speculation (prompt lookup, fixed length) vs none."""
    plain = load_test_generator(llama_dir, num_blocks=1024)
    spec = load_test_generator(llama_dir, num_blocks=1024, speculative_tokens=3, speculation_mode="fixed")
    baseline, _ = sample_under_grammar(plain, abc_prompt, regex_grammar(ABC_REGEX), 0)
    speculated, drafted = sample_under_grammar(spec, abc_prompt, regex_grammar(ABC_REGEX), 10**6)
    assert drafted > 0
    assert chi_square_p_value(speculated, baseline, 1200) > 1e-3


def test_the_masked_distribution_test_detects_an_unmasked_draw(llama_dir, abc_prompt, monkeypatch):
    """Verifying against the unmasked distribution (masks applied only to plain steps) fails the same test:
    drafts the grammar allows are then accepted at the rate of the raw model."""
    import specula_server.step_rows as step_rows

    original = step_rows.grammar_masks
    monkeypatch.setattr(step_rows, "grammar_masks",
                        lambda reqs, vocab_size, plan=None: None if plan is not None else original(reqs, vocab_size))
    plain = load_test_generator(llama_dir, num_blocks=1024)
    spec = load_test_generator(llama_dir, num_blocks=1024, speculative_tokens=3, speculation_mode="fixed")
    baseline, _ = sample_under_grammar(plain, abc_prompt, regex_grammar(ABC_REGEX), 0)
    broken, _ = sample_under_grammar(spec, abc_prompt, regex_grammar(ABC_REGEX), 10**6)
    assert chi_square_p_value(broken, baseline, 1200) < 1e-3


def test_a_draft_is_cut_where_the_grammar_forbids_it(plain):
    compiler = GrammarCompiler(plain.tokenizer, plain.model.config.vocab_size, [2])
    grammar = compiler.start(regex_grammar("ab+"))
    enc = lambda s: plain.tokenizer.encode(s, add_special_tokens=False).ids  # noqa: E731
    a, b, c = enc("a")[0], enc("b")[0], enc("c")[0]

    class R:  # the fields `within_grammar` reads
        spec = make_spec(0, [1], BlockPool(4, 16), grammar="x")
    r = R()
    r.grammar = grammar
    assert within_grammar(r, Draft(torch.tensor([a, b, c, b]))).tokens.tolist() == [a, b]
    # A tree: root ─ a ─ b ─ c (cut), a ─ c (cut), and b at the root (cut); a's subtree keeps b only.
    tree = Draft(torch.tensor([a, b, c, c, b]), torch.tensor([-1, 0, 1, 0, -1]))
    kept = within_grammar(r, tree)
    assert kept.tokens.tolist() == [a, b] and kept.node_parents() == [-1, 0]


def test_masks_of_a_tree_follow_each_path(plain):
    """`fill_masks` over a tree gives, per node, the mask of the state after its path (checked against a fresh
    matcher that consumed the path), and leaves the matcher where it was."""
    vocab = plain.model.config.vocab_size
    compiler = GrammarCompiler(plain.tokenizer, vocab, [2])
    g = json_grammar(SCHEMA)
    grammar = compiler.start(g)
    ids = plain.tokenizer.encode('{"name":"ab', add_special_tokens=False).ids
    tokens = ids + [ids[1], 5]
    parents = list(range(-1, len(ids) - 1)) + [-1, 1]
    out = torch.zeros(1 + len(tokens), mask_words(vocab), dtype=torch.int32)
    grammar.fill_masks(out, 0, tokens, parents)
    for node in range(len(parents)):
        path = []
        at = node
        while at >= 0:
            path.insert(0, tokens[at])
            at = parents[at]
        reference = llguidance.LLMatcher(compiler.tokenizer, g)
        if reference.validate_tokens(path) == len(path):
            reference.consume_tokens(path)
            expected = reference.compute_bitmask()  # llguidance's own words (it may round the width differently)
            got = out[node + 1].numpy().tobytes()
            assert got[: len(expected)] == expected[: len(got)] and not any(got[len(expected):]), node
    assert grammar.valid_prefix(ids) == len(ids)  # the matcher is back at the start
    logits = torch.zeros(out.shape[0], vocab)
    apply_masks(logits, torch.arange(out.shape[0]), out)
    assert torch.isfinite(logits).sum(-1).min() >= 1


def test_a_grammar_that_does_not_compile_fails_its_request_alone(plain):
    pool = BlockPool(1024, 16)
    bad = make_spec(0, PROMPT, pool, max_new_tokens=8, grammar=regex_grammar("(abc"))
    good = make_spec(1, PROMPT, pool, max_new_tokens=8, grammar=regex_grammar("x+"))
    outputs = run_steps(plain, [bad, good])
    errors = {o.request_id: o.error for o in outputs if o.error}
    assert list(errors) == [0] and "does not compile" in errors[0]
    text = next(o.generated_text.text for o in outputs if o.request_id == 1 and o.generated_text)
    assert re.fullmatch("x+", text)


def test_a_resumed_request_replays_its_tokens_into_its_grammar(plain):
    """Preempted after some tokens and resumed with `generated_ids`, it goes on exactly as uninterrupted."""
    pool = BlockPool(1024, 16)
    grammar = json_grammar(SCHEMA)
    greedy = generate_alone(plain, make_spec(0, PROMPT, pool, max_new_tokens=MAX_JSON_TOKENS, grammar=grammar))
    full = token_ids(greedy)
    resumed = generate_alone(plain, make_spec(1, PROMPT, pool, max_new_tokens=MAX_JSON_TOKENS, grammar=grammar,
                                              generated_ids=tuple(full[:7])))
    assert full[:7] + token_ids(resumed) == full
    assert resumed[-1].generated_text.text == greedy[-1].generated_text.text


def test_a_mask_job_runs_beside_the_step(plain):
    compiler = GrammarCompiler(plain.tokenizer, plain.model.config.vocab_size, [2])
    job = MaskJob([(3, compiler.start(regex_grammar("q")), [], [])], plain.model.config.vocab_size).wait()
    assert job.spans() == [(3, 0, 1)] and not job.errors
    allowed = [t for t in range(plain.model.config.vocab_size) if job.bitmask[0, t // 32] >> (t % 32) & 1]
    assert [plain.tokenizer.decode([t]) for t in allowed] == ["q"]


def test_mixed_batch_of_constrained_and_free_requests(plain):
    """A constrained request beside unconstrained ones leaves theirs exactly as alone."""
    pool = BlockPool(1024, 16)
    alone = token_ids(generate_alone(plain, make_spec(5, PROMPT, pool, max_new_tokens=12)))
    specs = [make_spec(0, PROMPT, pool, max_new_tokens=MAX_JSON_TOKENS, grammar=json_grammar(SCHEMA)),
             make_spec(5, PROMPT, pool, max_new_tokens=12)]
    outputs = run_steps(plain, specs)
    assert [t.id for o in outputs if o.request_id == 5 for t in o.tokens] == alone
    jsonschema.validate(json.loads(next(o.generated_text.text for o in outputs
                                        if o.request_id == 0 and o.generated_text)), SCHEMA)
    assert not step(plain)


def test_a_request_waits_for_its_grammar_without_stalling_the_others(llama_dir, monkeypatch):
    """While one request's grammar compiles, steps go on for the others; it then continues exactly as it would
    have without the wait (its first token comes from the logits its prompt's forward kept)."""
    import threading

    from specula_server.grammar import GrammarCompiler as Compiler

    generator = load_test_generator(llama_dir, num_blocks=1024)
    grammar = regex_grammar("[a-f]{4,8}")
    pool = BlockPool(1024, 16)
    expected = token_ids(generate_alone(generator, make_spec(0, PROMPT, pool, max_new_tokens=12, grammar=grammar)))

    release = threading.Event()
    compile_for_real = Compiler._compile

    def slow_compile(self, text):
        assert release.wait(timeout=30)
        return compile_for_real(self, text)

    monkeypatch.setattr(Compiler, "_compile", slow_compile)
    generator = load_test_generator(llama_dir, num_blocks=1024)
    free = make_spec(1, [1, 7, 8, 9], pool, max_new_tokens=30)
    outputs = step(generator, new=[make_spec(0, PROMPT, pool, max_new_tokens=12, grammar=grammar), free])
    for _ in range(3):
        outputs += step(generator)
    assert {o.request_id for o in outputs} == {1} and len(token_ids(outputs)) == 4  # request 1 went on alone
    release.set()
    while generator.requests:
        outputs += step(generator)
    assert [t.id for o in outputs if o.request_id == 0 for t in o.tokens] == expected


@pytest.fixture(scope="module")
def more_drafters(llama_dir, tmp_path_factory):
    """A draft model (a noisy copy of the target) and suffix decoding."""
    from test_draft_model import perturbed_copy

    draft = perturbed_copy(llama_dir, tmp_path_factory.mktemp("grammar-draft") / "noisy", std=0.1)
    return {"draft_model": speculative(llama_dir, speculator=str(draft)),
            "suffix": speculative(llama_dir, speculator="suffix")}


@pytest.mark.parametrize("method", ["draft_model", "suffix"])
def test_constrained_greedy_output_is_identical_with_every_drafter(drafting, more_drafters, method):
    pool = BlockPool(1024, 16)
    for grammar in (json_grammar(SCHEMA), regex_grammar(REGEX)):
        expected = generate_alone(drafting["off"], make_spec(0, PROMPT, pool, max_new_tokens=MAX_JSON_TOKENS,
                                                             grammar=grammar, lookahead=8))
        got = generate_alone(more_drafters[method], make_spec(0, PROMPT, pool, max_new_tokens=MAX_JSON_TOKENS,
                                                              grammar=grammar, lookahead=8))
        assert token_ids(got) == token_ids(expected)


def test_sampled_drafts_of_a_draft_model_follow_the_schema(more_drafters):
    """Drafts sampled from the draft model's q are kept whole (see `within_grammar`) and rejected by the rule
    where the grammar forbids them: every output still validates."""
    outputs = run_steps(more_drafters["draft_model"], sampled_specs(json_grammar(SCHEMA), 30, MAX_JSON_TOKENS))
    for text in texts_of(outputs, 30):
        jsonschema.validate(json.loads(text), SCHEMA)
    assert sum(o.num_drafted for o in outputs if o.draft_method == "draft_model") > 0


def test_adapters_and_grammars_share_a_batch(llama_dir, tmp_path_factory):
    """Constrained and free requests, with a LoRA adapter and without, in one batch, speculating: each gets
    exactly the tokens it gets in the same batch without speculation, and the constrained ones validate."""
    from specula_testing.adapters import build_lora_adapter

    root = tmp_path_factory.mktemp("grammar-lora")
    build_lora_adapter(llama_dir, root / "code", rank=4, std=0.2)

    def generator(**settings):
        g = load_test_generator(llama_dir, num_blocks=1024, adapter_dirs=(root,), **settings)
        g.adapters.load("code", "local")
        return g

    def batch(g):
        pool = BlockPool(1024, 16)
        specs = [make_spec(0, PROMPT, pool, max_new_tokens=MAX_JSON_TOKENS, lookahead=8, grammar=json_grammar(SCHEMA),
                           adapter_id="code"),
                 make_spec(1, PROMPT, pool, max_new_tokens=20, lookahead=8, adapter_id="code"),
                 make_spec(2, [1] + [50, 60, 70] * 4, pool, max_new_tokens=MAX_JSON_TOKENS, lookahead=8,
                           grammar=json_grammar(SCHEMA)),
                 make_spec(3, PROMPT, pool, max_new_tokens=20, lookahead=8)]
        outputs = run_steps(g, specs)
        return {i: [t.id for o in outputs if o.request_id == i for t in o.tokens] for i in range(4)}, outputs

    plain_tokens, _ = batch(generator())
    speculating = generator(speculative_tokens=4, speculation_mode="fixed")
    speculating.speculator.step_cost = memory_bound_costs()
    tokens, outputs = batch(speculating)
    assert tokens == plain_tokens
    for i in (0, 2):
        jsonschema.validate(json.loads(next(o.generated_text.text for o in outputs
                                            if o.request_id == i and o.generated_text)), SCHEMA)
    assert sum(o.num_drafted for o in outputs) > 0


def test_a_biased_model_cannot_write_a_non_ascii_digit_through_a_date_regex(plain):
    """TGI reads `\\d` as [0-9]; llguidance's own regex syntax reads it as any Unicode digit. With every byte of
    the fullwidth and Arabic-Indic digits pushed up by +100, the router's grammar still yields a date that
    `datetime` reads, while llguidance's raw reading of the same regex lets the bias through (the control: the
    test can fail)."""
    from datetime import date

    from specula_router.grammar import regex_grammar as router_regex_grammar

    date_regex = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"
    foreign = "０１２３４５６７８９٠١٢٣٤٥٦٧٨٩"
    tokens = {t for char in foreign for t in plain.tokenizer.encode(char, add_special_tokens=False).ids}
    bias = tuple(sorted((t, 100.0) for t in tokens))
    pool = BlockPool(1024, 16)

    def answer(grammar: str) -> str:
        spec = make_spec(0, PROMPT, pool, max_new_tokens=16, grammar=grammar, ignore_eos_token=False,
                         sampling=SamplingParams(logit_bias=bias))
        return generate_alone(plain, spec)[-1].generated_text.text

    ours = answer(router_regex_grammar(date_regex, "grammar.value").text)
    assert ours.isascii() and date.fromisoformat(ours), ours
    assert not answer(regex_grammar(date_regex)).isascii()


def test_a_grammar_that_trips_a_limit_later_fails_its_request_with_a_short_message(plain, caplog):
    """`a{1000000}` compiles, and its first mask is fine; after a token, llguidance's lexer runs out of room and
    its mask would allow only EOS: an empty answer with status 200 before. Now the request fails, its message is
    llguidance's first line (not its parser state), and the failure is logged."""
    pool = BlockPool(1024, 16)
    bomb = make_spec(0, PROMPT, pool, max_new_tokens=8, grammar=regex_grammar("a{1000000}"))
    good = make_spec(1, PROMPT, pool, max_new_tokens=8, grammar=regex_grammar("x+"))
    with caplog.at_level("WARNING", logger="specula.grammar"):
        outputs = run_steps(plain, [bomb, good])
    errors = {o.request_id: o.error for o in outputs if o.error}
    assert list(errors) == [0], errors
    assert "cannot be enforced: lexer error: too many expressions constructed" in errors[0], errors[0]
    assert "\n" not in errors[0] and "<state>" not in errors[0] and len(errors[0]) < 300
    assert any("too many expressions" in record.getMessage() for record in caplog.records)
    assert re.fullmatch("x+", next(o.generated_text.text for o in outputs if o.request_id == 1 and o.generated_text))


def test_a_prompt_whose_grammar_still_compiles_waits_then_decodes_as_if_it_had_not(plain, monkeypatch):
    """Its prompt runs and keeps its last logits while the grammar compiles, another request decoding meanwhile;
    once the grammar is ready its first token comes from those logits: the same tokens, log-probabilities and
    text as with the grammar ready at once."""
    from specula_server.grammar import RequestGrammar

    def run(steps_compiling: int) -> dict[int, list[tuple[int, float]]]:
        pool = BlockPool(1024, 16)
        specs = [make_spec(0, PROMPT, pool, max_new_tokens=10, grammar=regex_grammar(ABC_REGEX)),
                 make_spec(1, PROMPT[:5], pool, max_new_tokens=10)]
        ready = RequestGrammar.is_ready
        compiling = {"steps": steps_compiling}
        monkeypatch.setattr(RequestGrammar, "is_ready", property(lambda g: compiling["steps"] <= 0 and ready.fget(g)))
        got: dict[int, list[tuple[int, float]]] = {0: [], 1: []}
        outputs = step(plain, new=specs)
        while True:
            for out in outputs:
                assert not out.error, out.error
                got[out.request_id] += [(t.id, t.logprob) for t in out.tokens]
            if not plain.requests:
                return got
            if steps_compiling and compiling["steps"] > 0:
                assert not got[0] and 0 in plain._waiting  # no token before its grammar is ready
            compiling["steps"] -= 1
            outputs = step(plain)

    expected, waited = run(0), run(3)
    assert [t for t, _ in waited[0]] == [t for t, _ in expected[0]] and len(expected[0]) > 0
    assert [lp for _, lp in waited[0]] == pytest.approx([lp for _, lp in expected[0]], abs=1e-5)
    assert waited[1] == expected[1]
    assert re.fullmatch(ABC_REGEX, plain.tokenizer.decode([t for t, _ in waited[0]]))
