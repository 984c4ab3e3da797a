"""`specula-train`: prompt files, hidden states, checkpoints in the layouts the server loads, and training
that makes heads agree with the model more than untrained heads do."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from specula_server.adapters.medusa import load_medusa
from specula_server.models.config import ModelConfig
from specula_server.speculation.mlp_speculator_checkpoint import load_mlp_speculator
from specula_server.training.cli import app
from specula_server.training.data import HiddenStates, Sample, batches, generate_samples, read_prompts
from specula_server.training.speculators import MedusaTrainee, MLPSpeculatorTrainee
from specula_testing.worker import BlockPool, generate_alone, load_test_generator, make_spec, token_ids

PROMPT_WORDS = ["def", "return", "class", "import", "value", "self", "for", "in", "range", "print", "if", "else"]


def write_prompts(path, count: int = 24) -> None:
    with path.open("w") as f:
        for i in range(count):
            words = [PROMPT_WORDS[(i * 7 + j * 3) % len(PROMPT_WORDS)] for j in range(4 + i % 5)]
            f.write(json.dumps({"prompt": " ".join(words)}) + "\n")


def test_prompt_files(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a\\nb"}\n"plain string"\n\n{"inputs": "x"}\n{"text": "y"}\n')
    assert read_prompts(jsonl) == ["a\nb", "plain string", "x", "y"]
    lines = tmp_path / "p.txt"
    lines.write_text("one\n\ntwo\n")
    assert read_prompts(lines) == ["one", "two"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"other": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a string or an object"):
        read_prompts(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not JSON"):
        read_prompts(bad)


def test_hidden_states_match_transformers(llama_dir):
    import transformers

    generator = load_test_generator(llama_dir)
    samples = [Sample(torch.tensor([5, 9, 17, 3, 44, 8, 2]), 3), Sample(torch.tensor([7, 1, 30, 31]), 2)]
    states = HiddenStates(generator.model, max_tokens=64)(samples)
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    for sample, state in zip(samples, states):
        with torch.no_grad():
            expected = reference(sample.token_ids[None], output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(state, expected, atol=1e-4, rtol=1e-4)
        assert not state.is_inference()  # usable as a training input


def test_samples_are_the_model_s_own_greedy_continuations(llama_dir):
    generator = load_test_generator(llama_dir)
    prompts = ["def value", "return self for", "import x"]
    samples = generate_samples(generator, generator.tokenizer, prompts, max_input_tokens=16, max_new_tokens=6,
                               batch_size=2, progress=False)
    for prompt, sample in zip(prompts, samples):
        ids = generator.tokenizer.encode(prompt).ids
        assert sample.token_ids[: sample.prompt_len].tolist() == ids
        pool = BlockPool(64, 16)
        alone = token_ids(generate_alone(generator, make_spec(0, ids, pool, max_new_tokens=6)))
        assert sample.token_ids[sample.prompt_len :].tolist() == alone


def test_prompts_get_one_bos_whether_or_not_their_text_writes_it(llama_dir):
    from specula_server.training.data import encode_prompt

    tokenizer = load_test_generator(llama_dir).tokenizer
    bos = tokenizer.token_to_id("<s>")
    plain = tokenizer.encode("def value", add_special_tokens=False).ids
    assert encode_prompt(tokenizer, "def value") == [bos, *plain]
    # A chat template's rendering that writes the BOS itself is not given a second one.
    assert encode_prompt(tokenizer, "<s>def value") == tokenizer.encode("<s>def value", add_special_tokens=False).ids
    assert encode_prompt(tokenizer, "<s>def value").count(bos) == 1


def test_labels_start_at_the_last_prompt_position():
    hidden = HiddenStatesStub()
    batch = next(batches([Sample(torch.arange(10, 16), 3)], hidden, batch_size=1, shuffle=False))
    # Positions 2..5 are read by a drafter (the last prompt token's state chose the first generated token).
    assert batch.valid[0].tolist() == [False, False, True, True, True, True]
    # A head guessing 2 tokens ahead has labels at positions 2 and 3 (tokens at 4 and 5).
    assert batch.target_mask(2)[0].tolist() == [False, False, True, True, False, False]
    assert batch.shifted_tokens(2)[0].tolist() == [12, 13, 14, 15, 0, 0]


class HiddenStatesStub:
    def __call__(self, samples):
        return [torch.zeros(s.token_ids.numel(), 4) for s in samples]


@pytest.mark.parametrize("own_lm_heads", [True, False])
def test_medusa_checkpoints_load_in_the_server(tmp_path, llama_dir, own_lm_heads):
    config = ModelConfig.from_dir(llama_dir)
    torch.manual_seed(0)
    lm_head = torch.randn(config.vocab_size, config.hidden_size)
    trainee = MedusaTrainee(lm_head, num_heads=3, num_layers=2, own_lm_heads=own_lm_heads)
    with torch.no_grad():
        for p in trainee.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    trainee.save(tmp_path / "heads", "tiny", torch.float32)
    heads = load_medusa(tmp_path / "heads", config)
    assert (heads.num_heads, heads.config.num_layers, heads.config.uses_base_lm_head) == (3, 2, not own_lm_heads)
    hidden = torch.randn(5, config.hidden_size)
    served = heads(hidden, lambda x: x @ lm_head.T)
    with torch.no_grad():
        trained = torch.stack(trainee.head_logits(hidden))
    torch.testing.assert_close(served, trained, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tie_weights", [True, False])
def test_mlp_speculator_checkpoints_load_in_the_server(tmp_path, llama_dir, tie_weights):
    config = ModelConfig.from_dir(llama_dir)
    lm_head = torch.randn(config.vocab_size, config.hidden_size)
    trainee = MLPSpeculatorTrainee(lm_head, inner_dim=48, n_predict=3, tie_weights=tie_weights, scale_input=True)
    with torch.no_grad():
        for p in trainee.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    trainee.save(tmp_path / "mlp", "tiny", torch.float32, top_k_tokens_per_head=[3, 2, 2], n_candidates=4)
    served = load_mlp_speculator(tmp_path / "mlp", config)
    assert served.config.tie_weights == tie_weights and served.n_predict == 3
    hidden = torch.randn(5, config.hidden_size)
    tokens = torch.randint(0, config.vocab_size, (5, 3))
    with torch.no_grad():
        trained = torch.stack(trainee.stage_logits(hidden, tokens))
    torch.testing.assert_close(served(hidden, tokens), trained, atol=1e-4, rtol=1e-4)


def test_untrained_medusa_heads_pass_the_hidden_state_through(llama_dir):
    lm_head = torch.randn(50, 8)
    trainee = MedusaTrainee(lm_head, num_heads=2, num_layers=1, own_lm_heads=True)
    hidden = torch.randn(3, 8)
    for logits in trainee.head_logits(hidden):
        torch.testing.assert_close(logits, hidden @ lm_head.T)


def test_specula_train_medusa_beats_untrained_heads(tmp_path, llama_dir):
    write_prompts(tmp_path / "prompts.jsonl", count=96)
    out = tmp_path / "medusa"
    result = CliRunner().invoke(app, [
        "medusa", "--model-id", str(llama_dir), "--prompts", str(tmp_path / "prompts.jsonl"), "--output", str(out),
        "--num-heads", "2", "--max-new-tokens", "24", "--epochs", "30", "--batch-size", "8", "--lr", "1e-2",
        "--eval-fraction", "0.25",
    ])
    assert result.exit_code == 0, result.output
    assert "expected accepted drafts per step" in result.output
    report = json.loads((out / "training.json").read_text())
    held = report["held_out"]
    assert held["mean_accepted_after"] > held["mean_accepted_before"] + 0.3
    assert held["top1_after"][0] > held["top1_before"][0]

    # Served per request, the trained heads get more drafts accepted than untrained ones on the same prompts.
    untrained = tmp_path / "untrained"
    config = ModelConfig.from_dir(llama_dir)
    generator = load_test_generator(llama_dir)
    eye = torch.eye(config.hidden_size)
    MedusaTrainee(generator.model.compute_logits(eye).T, 2, 1, True).save(untrained, "tiny", torch.float32)
    rates = {}
    for name, path in (("trained", out), ("untrained", untrained)):
        spec_gen = load_test_generator(llama_dir, speculative_tokens=2, speculation_mode="fixed",
                                       speculator=str(path))
        drafted = accepted = 0
        pool = BlockPool(256, 16)
        for i, prompt in enumerate(read_prompts(tmp_path / "prompts.jsonl")[:8]):
            ids = spec_gen.tokenizer.encode(prompt).ids
            for o in generate_alone(spec_gen, make_spec(i, ids, pool, max_new_tokens=24, lookahead=4)):
                if o.draft_method == "medusa":
                    drafted += o.num_drafted
                    accepted += o.num_accepted
            spec_gen.reset()
            pool = BlockPool(256, 16)
        rates[name] = accepted / max(drafted, 1)
    assert rates["trained"] > rates["untrained"] + 0.1, rates


def test_specula_train_rejects_bad_settings(tmp_path, llama_dir):
    (tmp_path / "few.txt").write_text("a\nb\n")
    result = CliRunner().invoke(app, ["medusa", "--model-id", str(llama_dir), "--prompts", str(tmp_path / "few.txt"),
                                      "--output", str(tmp_path / "o")])
    assert result.exit_code != 0 and "at least 4 are needed" in result.output
    write_prompts(tmp_path / "p.jsonl", count=8)
    result = CliRunner().invoke(app, ["medusa", "--model-id", str(llama_dir), "--prompts", str(tmp_path / "p.jsonl"),
                                      "--output", str(tmp_path / "o"), "--layout", "eagle"])
    assert result.exit_code != 0 and "--layout must be fasterdecoding or lorax-v2" in result.output


def _recording_generation(monkeypatch) -> list[list[str]]:
    """Records the prompts each generation of continuations was asked for (the real generation still runs)."""
    from specula_server.training import data

    calls: list[list[str]] = []
    real = data.generate_samples

    def recorded(generator, tokenizer, prompts, *args, **kwargs):
        calls.append(list(prompts))
        return real(generator, tokenizer, prompts, *args, **kwargs)

    monkeypatch.setattr(data, "generate_samples", recorded)
    return calls


def test_the_samples_cache_generates_only_a_grown_files_new_prompts(tmp_path, llama_dir, monkeypatch):
    calls = _recording_generation(monkeypatch)
    cache = tmp_path / "samples.pt"
    prompts = tmp_path / "prompts.jsonl"

    def train(*extra: str) -> str:
        result = CliRunner().invoke(app, [
            "mlp", "--model-id", str(llama_dir), "--prompts", str(prompts), "--output", str(tmp_path / "out"),
            "--max-new-tokens", "8", "--epochs", "1", "--samples-cache", str(cache), *extra])
        assert result.exit_code == 0, result.output
        return result.output

    write_prompts(prompts, count=8)
    first = read_prompts(prompts)
    train()
    assert calls == [first]
    saved = torch.load(cache)["samples"]
    write_prompts(prompts, count=12)  # the same 8 prompts, then 4 more
    assert "reusing the continuations of 8 prompts" in train()
    assert calls[1] == read_prompts(prompts)[8:]
    grown = torch.load(cache)["samples"]
    assert len(grown) == 12 and all(grown[text] == saved[text] for text in first)
    assert "reusing the continuations of 12 prompts" in train() and len(calls) == 2

    # Another generation setting, or sampled continuations for other prompts, generate everything again.
    train("--max-new-tokens", "9")
    assert calls[2] == read_prompts(prompts)
    train("--temperature", "0.7")
    write_prompts(prompts, count=10)
    train("--temperature", "0.7")
    assert calls[4] == read_prompts(prompts)

    # The earlier layout (one list in the order of the key's prompts) is read too.
    key = {"model_id": str(llama_dir), "revision": "None", "dtype": "float32", "max_input_tokens": "512",
           "max_new_tokens": "8", "temperature": "0.0", "seed": "0", "prompts": read_prompts(prompts)}
    torch.save({"key": key, "samples": [(ids, n) for ids, n in (grown[t] for t in read_prompts(prompts))]}, cache)
    assert "reusing the continuations of 10 prompts" in train() and len(calls) == 5


def test_the_user_turn_prefix_is_where_the_template_writes_the_message():
    from specula_router.chat_template import ChatTemplate
    from specula_server.training.data import user_turn_prefix
    from specula_testing.chat_templates import CHATML, LLAMA3, MISTRAL

    def prefix(text: str, **special: str) -> str:
        template = ChatTemplate.from_text(text, special)
        return user_turn_prefix(lambda messages: template.render(messages, add_generation_prompt=False))

    assert prefix(CHATML) == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    assert prefix(LLAMA3, bos_token="<s>") == "<s><|start_header_id|>user<|end_header_id|>\n\n"
    assert prefix(MISTRAL, bos_token="<s>") == "<s>[INST] "
    with pytest.raises(ValueError, match="does not write the user's message"):
        prefix("{% for m in messages %}{{ m['role'] }}{% endfor %}")


def test_synthesized_prompts_are_the_messages_the_model_ended_each_once(llama_dir, monkeypatch):
    from specula_server.params import SamplingParams
    from specula_server.training import data

    generator = load_test_generator(llama_dir)
    eos = min(generator.eos_token_ids)
    tokenizer = generator.tokenizer
    words = [tokenizer.encode(w, add_special_tokens=False).ids for w in ("alpha beta gamma", "delta epsilon zeta",
                                                                         "eta theta iota", "kappa lambda mu")]
    prefix_ids = tokenizer.encode("user:", add_special_tokens=True).ids
    calls: list[tuple[int, int]] = []  # (prompts asked for, first seed)

    def generated(gen, tok, prompts, max_input_tokens, max_new_tokens, batch_size, sampling, progress):
        calls.append((len(prompts), sampling.seed))
        made = [words[0] + [eos], words[0] + [eos],  # the same message twice: kept once
                words[1],  # not ended by the model: dropped
                tokenizer.encode("ab", add_special_tokens=False).ids + [eos],  # too short: dropped
                words[2] + [eos], words[3] + [eos]]
        return [Sample(torch.tensor(prefix_ids + ids), len(prefix_ids)) for ids in made[: len(prompts)]]

    monkeypatch.setattr(data, "generate_samples", generated)
    sampling = SamplingParams(do_sample=True, temperature=1.0, seed=5)
    kept = data.synthesize_prompts(generator, tokenizer, "user:", 3, 16, batch_size=6, sampling=sampling,
                                   progress=False)
    assert kept == [tokenizer.decode(w, skip_special_tokens=True).strip() for w in (words[0], words[2], words[3])]
    assert calls == [(6, 5)]
    # Sampled a batch at a time, each with the seeds after the last's, until too many were tried.
    calls.clear()
    with pytest.raises(RuntimeError, match="ended 3 distinct user messages of 4 asked for in 24 samples"):
        data.synthesize_prompts(generator, tokenizer, "user:", 4, 16, batch_size=6, sampling=sampling, progress=False)
    assert calls == [(6, 5), (6, 11), (6, 17), (6, 23)]
