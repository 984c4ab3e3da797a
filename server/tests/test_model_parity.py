"""The worker's model against transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from specula_kernels import native
from specula_testing.worker import BlockPool, generate_alone, load_test_generator, make_spec, step, token_ids

PROMPTS = [
    [1, 50, 60, 70, 80, 90, 100],
    [1, 7],
    [1] + list(range(100, 160)),
    [1, 300, 301, 302, 300, 301, 302, 300, 301],
]
NUM_NEW = 32


def reference_greedy(model, prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by full forward passes (no cache): the plainest possible reference."""
    ids, tokens, logprobs = torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(num_new):
            logits = model(ids).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs


@pytest.fixture(params=["native", "pytorch"])
def kernels(request, monkeypatch):
    """The forward on the native kernels (decode attention in place, fused layer operations; skipped where they
    are not built) or on PyTorch's operators alone."""
    if request.param == "native" and native.library() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    if request.param == "pytorch":
        monkeypatch.setattr(native, "library", lambda: None)
    return request.param


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama31"])
def test_greedy_tokens_and_logprobs_match_transformers(model_dirs, kind, kernels):
    model_dir = model_dirs[kind]
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = load_test_generator(model_dir)
    for i, prompt in enumerate(PROMPTS):
        pool = BlockPool(256, 16)
        outputs = generate_alone(generator, make_spec(i, prompt, pool, max_new_tokens=NUM_NEW))
        expected_tokens, expected_logprobs = reference_greedy(reference, prompt, NUM_NEW)
        assert token_ids(outputs) == expected_tokens
        logprobs = [t.logprob for o in outputs for t in o.tokens]
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)


def test_prefill_logprobs_match_transformers(llama_dir):
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    generator = load_test_generator(llama_dir)
    prompt = PROMPTS[2]
    spec = make_spec(0, prompt, BlockPool(256, 16), max_new_tokens=1, prefill_logprobs=True)
    (out,) = step(generator, new=[spec])
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), -1)
    expected = logprobs[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1).tolist()
    assert [t.id for t in out.prefill_tokens] == prompt
    assert torch.isnan(torch.tensor(out.prefill_tokens[0].logprob))
    assert [t.logprob for t in out.prefill_tokens[1:]] == pytest.approx(expected, abs=1e-4)


def test_legacy_rope_config_keys(tmp_path, model_dirs):
    """Checkpoints written before transformers 5 carry `rope_theta` / `rope_scaling` at the top level."""
    from specula_server.models.config import ModelConfig

    raw = json.loads((model_dirs["llama31"] / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params
    legacy, modern = ModelConfig.from_dict(raw), ModelConfig.from_dir(model_dirs["llama31"])
    assert legacy == modern
    assert legacy.rope_scaling is not None and legacy.rope_scaling.factor == 8.0


def test_unsupported_architecture_is_a_clear_error(llama_dir):
    from specula_server.distributed import ShardGroup
    from specula_server.models import UnsupportedModelError, build_model
    from specula_server.models.config import ModelConfig

    raw = json.loads((llama_dir / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        build_model(ModelConfig.from_dict(raw), weights=None, group=ShardGroup())
