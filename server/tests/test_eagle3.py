"""EAGLE-3 drafters in the `speculators` layout: loading, the draft layer against a reference, exact decoding.

The draft layer's logits must equal a plain-PyTorch re-implementation of `speculators`' EAGLE-3 forward (and,
where a Python with the package is named by SPECULATORS_PYTHON, the package's own forward and checkpoints).
Drafted incrementally over the paged KV, each draft must equal the one computed from scratch over the
request's whole history; greedy output must equal decoding without speculation, alone and batched; seeded
sampling must draw the same tokens (drafts are deterministic, and draws depend on seed and position only).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_speculation import PROMPTS

from specula_server.kv_cache import KVCache
from specula_server.models.config import ModelConfig
from specula_server.params import SamplingParams
from specula_server.speculation import eagle3_drafter
from specula_server.speculation.eagle3 import LLAMA_DEFAULTS, Eagle3Error
from specula_server.speculation.eagle3_checkpoint import load_eagle3
from specula_server.speculation.eagle3_drafter import Eagle3Drafter
from specula_testing.eagle3 import (
    SPECULATORS_SCRIPT,
    build_eagle3,
    build_echo_eagle3,
)
from specula_testing.worker import (
    BlockPool,
    assert_same_greedy_output,
    generate_alone,
    load_test_generator,
    make_spec,
    run_steps,
    token_ids,
)

K = 3
VARIANTS = {
    "plain": {},
    "reduced-vocab": {"draft_vocab_size": 200},
    "two-layers": {"num_layers": 2, "draft_vocab_size": 300},
    "norm-before-residual": {"norm_before_residual": True},
    "eagle-3.1": {"fc_norm": True, "norm_output": True, "draft_vocab_size": 300},
    "norm-before-fc": {"norm_before_fc": True},
}
SPECULATORS_PYTHON = os.environ.get("SPECULATORS_PYTHON")
needs_speculators = pytest.mark.skipif(
    not SPECULATORS_PYTHON, reason="SPECULATORS_PYTHON (a Python with the `speculators` package) is not set")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_config(llama_dir):
    return ModelConfig.from_dir(llama_dir)


@pytest.fixture(scope="module")
def checkpoints(llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle3")
    made = {name: build_eagle3(root / name, llama_dir, layer_ids=[0, 1, 2], seed=i, **options)
            for i, (name, options) in enumerate(VARIANTS.items())}
    made["default-ids"] = build_eagle3(root / "default-ids", llama_dir, seed=9)  # 2, L // 2, L - 3 of 5 layers
    made["echo"] = build_echo_eagle3(root / "echo", llama_dir)
    return made


@pytest.fixture(scope="module")
def plain(llama_dir):
    return load_test_generator(llama_dir)


def with_eagle(llama_dir, checkpoint, mode="fixed", tokens=K, **settings):
    return load_test_generator(llama_dir, speculative_tokens=tokens, speculation_mode=mode,
                               speculator=str(checkpoint), **settings)


def run(generator, prompt, request_id=0, **kwargs):
    return generate_alone(generator, make_spec(request_id, prompt, BlockPool(256, 16), **kwargs))


# --- a plain-PyTorch reference of speculators' EAGLE-3 forward ------------------------------------------------


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:  # [T, heads, d]
    d = x.shape[-1]
    freqs = positions.float()[:, None] / theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


class ReferenceDraft:
    """`Eagle3DraftModel.forward` for one sequence, written out: the first step over every row (causal), then
    chained steps of the last row that see the first step's keys and their own earlier steps' (the training
    mask's diagonal), which is what drafting a chain after the last row is."""

    def __init__(self, directory: Path, embed: torch.Tensor | None = None):
        self.w = load_file(directory / "model.safetensors")
        if embed is not None:  # a checkpoint without its own embedding uses the verifier's
            self.w["embed_tokens.weight"] = embed
        config = json.loads((directory / "config.json").read_text())
        self.c, layer = config, config["transformer_layer_config"]
        self.eps, self.theta = layer["rms_norm_eps"], layer["rope_parameters"]["rope_theta"]
        self.heads, self.kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
        self.num_layers = layer["num_hidden_layers"]
        self.d2t = self.w["d2t"]

    def layer(self, i, x, positions, cache, embeds=None):
        w, p = self.w, f"layers.{i}."
        if i == 0:
            normed = rms(x, w[p + "hidden_norm.weight"], self.eps)
            residual = normed if self.c["norm_before_residual"] else x
            inputs = torch.cat([rms(embeds, w[p + "input_layernorm.weight"], self.eps), normed], -1)
        else:
            residual, inputs = x, rms(x, w[p + "input_layernorm.weight"], self.eps)
        t = x.shape[0]
        q = (inputs @ w[p + "self_attn.q_proj.weight"].T).view(t, self.heads, -1)
        k = (inputs @ w[p + "self_attn.k_proj.weight"].T).view(t, self.kv_heads, -1)
        v = (inputs @ w[p + "self_attn.v_proj.weight"].T).view(t, self.kv_heads, -1)
        q, k = rotate(q, positions, self.theta), rotate(k, positions, self.theta)
        keys, values = torch.cat([cache[i][0], k]), torch.cat([cache[i][1], v])
        cache[i] = (keys, values)
        rep = self.heads // self.kv_heads
        scores = torch.einsum("thd,shd->hts", q, keys.repeat_interleave(rep, 1)) / q.shape[-1] ** 0.5
        if t > 1:  # the first step: causal
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), values.repeat_interleave(rep, 1)).reshape(t, -1)
        h = residual + out @ w[p + "self_attn.o_proj.weight"].T
        m = rms(h, w[p + "post_attention_layernorm.weight"], self.eps)
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        return h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    def step(self, tokens, state, positions, cache):
        embeds = self.w["embed_tokens.weight"][tokens]
        h = self.layer(0, state, positions, cache, embeds)
        for i in range(1, self.num_layers):
            h = self.layer(i, h, positions, cache)
        normed = rms(h, self.w["norm.weight"], self.eps)
        return normed @ self.w["lm_head.weight"].T, normed if self.c["norm_output"] else h

    def chain(self, aux: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, k: int, fed=None):
        """Logits `[k, draft_vocab]` of the chain after the last row: `aux [T, A*H]` and `tokens [T]` are the
        pairs (g_p, token p + 1) at `positions`; each step feeds the previous step's argmax (or `fed[s]`)."""
        w, eps = self.w, self.eps
        if self.c["norm_before_fc"]:
            aux = rms(aux, w["input_norm.weight"], eps)
        if self.c["fc_norm"]:
            chunks = aux.chunk(len([n for n in w if n.startswith("fc_norm.")]), -1)
            aux = torch.cat([rms(c, w[f"fc_norm.{a}.weight"], eps) for a, c in enumerate(chunks)], -1)
        head_dim = self.w["layers.0.self_attn.k_proj.weight"].shape[0] // self.kv_heads
        cache = [(torch.empty(0, self.kv_heads, head_dim),) * 2 for _ in range(self.num_layers)]
        logits, state = self.step(tokens, aux @ w["fc.weight"].T, positions, cache)
        out = [logits[-1]]
        position, state = positions[-1:], state[-1:]
        for s in range(k - 1):
            token = out[-1].argmax() + self.d2t[out[-1].argmax()] if fed is None else fed[s]
            position = position + 1
            logits, state = self.step(torch.as_tensor(token).view(1), state, position, cache)
            out.append(logits[0])
        return torch.stack(out)


# --- the draft layer on a hand-built request ----------------------------------------------------------------


def fake_request(tokens: torch.Tensor, aux: torch.Tensor, blocks: list[int] | None = None, block_size: int = 16):
    """What the drafter reads of a request: its tokens (with room for drafts), slots in `blocks` (by default
    the first few, shuffled) and the target's rows."""
    capacity = tokens.numel() + 16
    buffer = torch.zeros(capacity, dtype=torch.long)
    buffer[: tokens.numel()] = tokens
    blocks = blocks or torch.randperm(capacity // block_size + 1).tolist()
    slots = torch.tensor(blocks)[:, None] * block_size + torch.arange(block_size)
    return SimpleNamespace(token_ids=buffer, slots=slots.flatten()[:capacity], num_tokens=tokens.numel(),
                           draft_cached=0, eagle_aux=[aux], eagle_kept=aux.shape[0])


def drafter_for(checkpoint: Path, llama_dir: Path, model_config) -> Eagle3Drafter:
    model = load_eagle3(checkpoint, str(llama_dir), model_config, None)
    drafter = Eagle3Drafter(model, torch.device("cpu"))
    drafter.allocate_kv_cache(16, 16)
    return drafter


def recorded_logits(drafter: Eagle3Drafter, requests, lengths) -> tuple[list, list[torch.Tensor]]:
    """The drafts, and the logits of every forward's rows the drafts came from (the last row of each request
    in the catch-up, every row in the chain)."""
    seen: list[torch.Tensor] = []
    forward = drafter.model.forward

    def recording(*args, **kwargs):
        logits, state = forward(*args, **kwargs)
        seen.append(logits)
        return logits, state

    drafter.model.forward = recording
    try:
        drafts = drafter.draft(requests, lengths)
    finally:
        del drafter.model.forward
    return drafts, seen


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_draft_logits_match_the_reference(variant, checkpoints, llama_dir, model_config):
    torch.manual_seed(0)
    drafter = drafter_for(checkpoints[variant], llama_dir, model_config)
    reference = ReferenceDraft(checkpoints[variant])
    num_aux = drafter.model.aux_size
    tokens = torch.randint(0, model_config.vocab_size, (11,))
    aux = torch.randn(10, num_aux)
    drafts, seen = recorded_logits(drafter, [fake_request(tokens, aux)], [4])
    assert seen[0].shape[0] == 1  # the catch-up over 10 rows takes the draft head over the last one only
    expected = reference.chain(aux, tokens[1:], torch.arange(10), 4)
    got = torch.stack([seen[0][-1]] + [logits[0] for logits in seen[1:]])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert drafts[0].tokens.tolist() == (expected.argmax(-1) + reference.d2t[expected.argmax(-1)]).tolist()


def test_batched_drafts_equal_drafts_alone(checkpoints, llama_dir, model_config):
    """Requests of different lengths and draft counts, drafted together, as each alone (padding, grouping)."""
    torch.manual_seed(1)
    drafter = drafter_for(checkpoints["two-layers"], llama_dir, model_config)
    num_aux = drafter.model.aux_size
    specs = [(torch.randint(0, 512, (n,)), torch.randn(n - 1, num_aux), k) for n, k in ((7, 3), (2, 1), (20, 4))]
    alone = [drafter.draft([fake_request(t, a)], [k])[0].tokens.tolist() for t, a, k in specs]
    blocks = [[3, 0], [5, 1], [2, 7, 4]]  # the requests' own blocks, out of order
    together = drafter.draft([fake_request(t, a, b) for (t, a, _), b in zip(specs, blocks)], [k for *_, k in specs])
    assert [d.tokens.tolist() for d in together] == alone
    assert [len(d) for d in alone] == [3, 1, 4]


@pytest.mark.parametrize("variant,quantize", [(v, None) for v in VARIANTS] + [("plain", "int8"),
                                                                                ("two-layers", "int4")])
def test_the_native_draft_stack_gives_the_layer_by_layer_bits(variant, quantize, checkpoints, llama_dir,
                                                               model_config, monkeypatch):
    """Chains of one row a request run the draft layers as one native call (`NativeStack.run_eagle3`): the same
    logits and states, bit for bit, as the layer-by-layer path, with float32, int8 or int4 products."""
    from specula_kernels import native
    from specula_kernels.decode_layers import NativeStack

    if native.library() is None:
        pytest.skip("no native kernels")
    torch.manual_seed(2)
    from specula_server.layers.quantization import Quantization

    quantization = None if quantize is None else Quantization(quantize, group_size=32)
    model = load_eagle3(checkpoints[variant], str(llama_dir), model_config, None, quantization=quantization)
    assert model._native_stack() is not None
    calls = []
    run = NativeStack.run_eagle3
    monkeypatch.setattr(NativeStack, "run_eagle3", lambda self, *a: calls.append(1) or run(self, *a))
    specs = [(torch.randint(0, 512, (n,)), torch.randn(n - 1, model.aux_size), k) for n, k in ((9, 4), (3, 2))]

    def chains() -> tuple[list, list[torch.Tensor]]:
        drafter = Eagle3Drafter(model, torch.device("cpu"))
        drafter.allocate_kv_cache(16, 16)
        states: list[torch.Tensor] = []
        forward = model.forward

        def recording(*args, **kwargs):
            logits, state = forward(*args, **kwargs)
            states.append(torch.cat([logits, state.float()], -1))
            return logits, state

        model.forward = recording
        try:
            drafts = drafter.draft([fake_request(t, a, b) for (t, a, _), b in zip(specs, ([2, 0], [1]))],
                                   [k for *_, k in specs])
        finally:
            del model.forward
        return [d.tokens.tolist() for d in drafts], states

    native_drafts, native_rows = chains()
    assert len(calls) == 4  # the catch-up (at most 8 rows a request) and the chain's three steps
    model._stack = None
    drafts, rows = chains()
    assert len(calls) == 4
    assert native_drafts == drafts
    assert len(native_rows) == len(rows) == 4 and all(torch.equal(a, b) for a, b in zip(native_rows, rows))


def test_auxiliary_states_are_the_residual_stream(llama_dir, plain):
    """Layer id l is the input of layer l (0: the embeddings), the last id the last layer's output before the
    final norm: transformers' hidden_states[l], and the final norm's input for the last."""
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    captured = []
    reference.model.norm.register_forward_hook(lambda module, args, output: captured.append(args[0]))
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        states = reference(ids, output_hidden_states=True).hidden_states
    expected = torch.cat([states[1][0], states[0][0], captured[0][0]], dim=-1)  # ids (1, 0, 2), in that order
    model = plain.model
    r = SimpleNamespace(token_ids=ids[0], slots=torch.arange(ids.shape[1]))
    from specula_server.batch import build_step

    step = build_step([r], [0], [ids.shape[1]], torch.device("cpu"))
    kv = KVCache.allocate(4, 16, 2, model.num_kv_heads, model.config.head_dim, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        _, aux = model.forward_with_aux(step.input_ids, step.positions, kv.layers, step.attn, None, (1, 0, 2))
    torch.testing.assert_close(aux, expected, rtol=1e-4, atol=1e-4)


# --- loading and refusing -------------------------------------------------------------------------------------


def rewrite(directory: Path, target: Path, config_changes=None, drop=(), tensors=None) -> Path:
    shutil.copytree(directory, target)
    config = json.loads((target / "config.json").read_text())
    for key, value in (config_changes or {}).items():
        if value is None and key in ("transformer_layer_config",):
            config.pop(key)
        elif isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    (target / "config.json").write_text(json.dumps(config))
    weights = load_file(target / "model.safetensors")
    weights = {k: v for k, v in weights.items() if k not in drop}
    weights.update(tensors or {})
    save_file(weights, target / "model.safetensors")
    return target


def test_default_layer_ids_and_checkpoint_fields(checkpoints, llama_dir, model_config, tmp_path):
    deep = ModelConfig.from_dict({**json.loads((llama_dir / "config.json").read_text()), "num_hidden_layers": 8})
    model = load_eagle3(checkpoints["eagle-3.1"], str(llama_dir), model_config, None)
    assert model.layer_ids == (0, 1, 2) and model.spec.fc_norm and model.spec.norm_output
    assert model.spec.speculative_tokens == 3 and model.spec.draft_vocab_size == 300
    assert model.to_target(torch.arange(300)).unique().numel() == 300
    with pytest.raises(Eagle3Error, match=r"2 layers \(its auxiliary hidden states are read after layers \[2, 1, -1\]"):
        load_eagle3(checkpoints["default-ids"], str(llama_dir), model_config, None)
    assert load_eagle3(rewrite(checkpoints["default-ids"], tmp_path / "deep", {
        "transformer_layer_config": {"num_hidden_layers": 1}}), str(llama_dir), deep, None).layer_ids == (2, 4, 5)


@pytest.mark.parametrize("changes,message", [
    ({"speculators_config": {"verifier": {"name_or_path": "org/other-model", "architectures": ["Qwen2ForCausalLM"]}}},
     (r"its verifier is org/other-model, which is not the served model .*llama: the served model has architecture "
     r"LlamaForCausalLM \(it was trained for Qwen2ForCausalLM\)")),
    ({"target_hidden_size": 128}, r"not the served model .*hidden size 64 \(its verifier's: 128\)"),
    ({"transformer_layer_config": {"vocab_size": 1000}}, r"vocabulary of 512 tokens \(its verifier's: 1000\)"),
    ({"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}, r"2 layers \(its auxiliary hidden states are read after"),
])
def test_a_checkpoint_for_another_model_is_refused_naming_both(checkpoints, llama_dir, tmp_path, changes, message):
    bad = rewrite(checkpoints["plain"], tmp_path / "bad", changes)
    with pytest.raises(Eagle3Error, match=message):
        with_eagle(llama_dir, bad)


@pytest.mark.parametrize("changes,drop,tensors,message", [
    ({"transformer_layer_config": None}, (), None, "lacks transformer_layer_config"),
    ({"transformer_layer_config": {"model_type": "qwen3"}}, (), None, "a 'qwen3' layer; the server implements llama"),
    ({"draft_vocab_size": "many"}, (), None, "malformed field"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}, (), None, "must be distinct"),
    ({"norm_before_fc": True, "fc_norm": True}, (), None, "exclude each other"),
    ({}, ("layers.0.hidden_norm.weight",), None, "tensor layers.0.hidden_norm.weight is missing"),
    ({}, (), {"fc.weight": torch.zeros(64, 128)}, r"fc.weight has shape \[64, 128\], expected \[64, 192\]"),
    ({}, (), {"d2t": torch.full((200,), 400)}, "outside the 512-token vocabulary"),
    ({}, ("embed_tokens.weight",), None, None),  # the verifier's embedding then
])
def test_malformed_checkpoints_are_refused_clearly(checkpoints, llama_dir, model_config, tmp_path, changes, drop,
                                                    tensors, message):
    bad = rewrite(checkpoints["reduced-vocab"], tmp_path / "bad", changes, drop, tensors)
    if message is None:
        generator = with_eagle(llama_dir, bad)
        assert generator.draft_model.model.embed is generator.model.embed_tokens
        return
    with pytest.raises(Eagle3Error, match=message):
        with_eagle(llama_dir, bad)


def test_no_config_or_weights(checkpoints, llama_dir, model_config, tmp_path):
    shutil.copytree(checkpoints["plain"], tmp_path / "empty")
    (tmp_path / "empty" / "model.safetensors").unlink()
    with pytest.raises(Eagle3Error, match="cannot read its weights"):
        load_eagle3(tmp_path / "empty", str(llama_dir), model_config, None)


def test_a_checkpoint_from_the_hub_cache(llama_dir, checkpoints, plain, tmp_path, monkeypatch):
    from specula_server.speculation.eagle3_checkpoint import find_eagle3

    repo = tmp_path / "models--org--tiny-eagle3"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(checkpoints["echo"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert find_eagle3("org/tiny-eagle3", tmp_path) == repo / "snapshots" / commit
    assert find_eagle3("org/not-cached", tmp_path) is None
    assert find_eagle3(str(llama_dir), tmp_path) is None  # a model directory is no EAGLE-3 checkpoint
    generator = with_eagle(llama_dir, "org/tiny-eagle3", hub_cache=tmp_path)
    assert generator.speculation.drafter.name == "eagle3"
    expected = token_ids(run(plain, PROMPTS[0], max_new_tokens=8))
    assert token_ids(run(generator, PROMPTS[0], max_new_tokens=8)) == expected


# --- exact decoding ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant,width", [("plain", 1), ("echo", 1), ("eagle-3.1", 1), ("echo", 3), ("plain", 2)])
def test_greedy_output_is_identical(llama_dir, checkpoints, plain, variant, width):
    generator = with_eagle(llama_dir, checkpoints[variant], draft_tree_width=width)
    assert generator.speculation.drafter.name == "eagle3"
    drafted = accepted = 0
    for got in assert_same_greedy_output(plain, generator, PROMPTS, run, max_new_tokens=24):
        assert {o.draft_method for o in got if o.num_drafted} == {"eagle3"}
        drafted += sum(o.num_drafted for o in got)
        accepted += sum(o.num_accepted for o in got)
    assert drafted > 0
    if variant == "echo":
        assert 0 < accepted < drafted  # both acceptance and rejection were exercised


@pytest.mark.parametrize("method,kind", [("int8", "Int8Linear"), ("int4", "Int4Linear")])
def test_a_quantized_speculator_drafts_and_decodes_exactly(llama_dir, checkpoints, plain, method, kind):
    """`--speculator-quantize`: the draft layer's products, fc and head in int8 or int4; drafts still accepted
    (the echo drafter's guesses survive quantization) and the output still the target's own."""
    generator = with_eagle(llama_dir, checkpoints["echo"], speculator_quantize=method, quantize_group_size=32)
    model = generator.eagle.model
    assert {type(m).__name__ for m in (model.fc, model.lm_head, model.first.self_attn.qkv_proj.linear,
                                       model.first.mlp.down_proj.linear)} == {kind}
    drafted = accepted = 0
    for got in assert_same_greedy_output(plain, generator, PROMPTS, run, max_new_tokens=24):
        drafted += sum(o.num_drafted for o in got)
        accepted += sum(o.num_accepted for o in got)
    assert 0 < accepted < drafted


def test_speculator_quantize_is_checked(llama_dir, checkpoints, tmp_path):
    with pytest.raises(ValueError, match="--speculator-quantize gguf is not supported; supported: int8, int4"):
        with_eagle(llama_dir, checkpoints["echo"], speculator_quantize="gguf")
    # The drafter's inputs (64 wide) are not whole groups of 128: the error names the drafter's flag.
    with pytest.raises(ValueError, match="--speculator-quantize int4 with --quantize-group-size 128 needs every"):
        with_eagle(llama_dir, checkpoints["echo"], speculator_quantize="int4", quantize_group_size=128)
    with pytest.raises(ValueError, match="--speculator-quantize quantizes an EAGLE-3 speculator; no --speculator"):
        load_test_generator(llama_dir, speculative_tokens=2, speculator="suffix", speculator_quantize="int8")
    from specula_testing.adapters import build_medusa_adapter

    medusa = build_medusa_adapter(llama_dir, tmp_path / "medusa")
    with pytest.raises(ValueError, match=f"--speculator-quantize quantizes an EAGLE-3 speculator; {medusa} is not"):
        load_test_generator(llama_dir, speculative_tokens=2, speculator=str(medusa), speculator_quantize="int8")


@pytest.mark.parametrize("width", [1, 2])
def test_batched_greedy_output_is_identical(llama_dir, checkpoints, plain, width):
    generator = with_eagle(llama_dir, checkpoints["echo"], tokens=4, draft_tree_width=width)
    expected = {i: token_ids(run(plain, p, max_new_tokens=20)) for i, p in enumerate(PROMPTS)}
    pool = BlockPool(256, 16)
    specs = [make_spec(i, p, pool, max_new_tokens=20, lookahead=8, speculative_tokens=0 if i == 3 else None)
             for i, p in enumerate(PROMPTS)]
    got: dict[int, list[int]] = {i: [] for i in expected}
    for out in run_steps(generator, specs):
        got[out.request_id] += [t.id for t in out.tokens]
        assert out.request_id != 3 or not out.num_drafted
    assert got == expected


@pytest.mark.parametrize("max_kept_rows", [64, 1])
def test_incremental_drafts_equal_drafts_from_scratch(llama_dir, checkpoints, plain, monkeypatch, max_kept_rows):
    """Every draft made over the paged KV (caught up after accepted and rejected drafts, and at the end of steps
    once a request keeps more than `max_kept_rows` rows) equals the draft computed from the whole history again,
    from the target's states over it."""
    monkeypatch.setattr(eagle3_drafter, "MAX_KEPT_ROWS", max_kept_rows)
    generator = with_eagle(llama_dir, checkpoints["echo"])
    drafter = generator.draft_model
    made = []
    draft = Eagle3Drafter.draft

    def recording(self, requests, lengths):
        drafts = draft(self, requests, lengths)
        made.extend((r.token_ids[: r.num_tokens].clone(), d.tokens.tolist()) for r, d in zip(requests, drafts))
        return drafts

    monkeypatch.setattr(Eagle3Drafter, "draft", recording)
    outputs = run(generator, PROMPTS[1], max_new_tokens=24)
    assert sum(o.num_accepted for o in outputs) > 0 and len(made) > 3
    monkeypatch.setattr(Eagle3Drafter, "draft", draft)
    scratch = drafter_for(checkpoints["echo"], llama_dir, ModelConfig.from_dir(llama_dir))
    from specula_server.batch import build_step

    for history, tokens in made:
        r = SimpleNamespace(token_ids=history, slots=torch.arange(history.numel()))
        step = build_step([r], [0], [history.numel() - 1], torch.device("cpu"))
        kv = KVCache.allocate(8, 16, 2, plain.model.num_kv_heads, plain.model.config.head_dim, torch.float32,
                              torch.device("cpu"))
        with torch.inference_mode():
            _, aux = plain.model.forward_with_aux(step.input_ids, step.positions, kv.layers, step.attn, None,
                                                  drafter.layer_ids)
        again = scratch.draft([fake_request(history, aux)], [len(tokens)])[0].tokens.tolist()
        assert again == tokens


def test_idle_requests_drop_their_rows_and_draft_again(llama_dir, checkpoints, plain, monkeypatch):
    """A request that drafts nothing for a while (here: its decode steps 3-10 plan no drafts) keeps its rows up to
    `IDLE_ROWS`, then drops them without running the draft layer over them (their draft entries zeroed); it drafts
    again afterwards, and its output is plain decoding's."""
    monkeypatch.setattr(eagle3_drafter, "IDLE_ROWS", 3)
    generator = with_eagle(llama_dir, checkpoints["echo"])
    speculator, resumed = generator.speculator, []
    plan = speculator.plan

    def plan_with_a_pause(reqs):
        plan_with_a_pause.calls += 1
        if 3 <= plan_with_a_pause.calls <= 10:
            return None
        planned = plan(reqs)
        if plan_with_a_pause.calls > 10:
            resumed.append(planned is not None)
        return planned

    plan_with_a_pause.calls = 0
    monkeypatch.setattr(speculator, "plan", plan_with_a_pause)
    run_over, skipped, skipped_slots = set(), set(), []
    catch_up, skip = Eagle3Drafter._catch_up, Eagle3Drafter._skip

    def recording_catch_up(self, requests, counts):
        for r, c in zip(requests, counts):
            run_over.update(range(r.draft_cached, r.draft_cached + c))
        return catch_up(self, requests, counts)

    def recording_skip(self, requests, counts):
        for r, c in zip(requests, counts):
            skipped.update(range(r.draft_cached, r.draft_cached + c))
            skipped_slots.append(r.slots[r.draft_cached : r.draft_cached + c].clone())
        return skip(self, requests, counts)

    monkeypatch.setattr(Eagle3Drafter, "_catch_up", recording_catch_up)
    monkeypatch.setattr(Eagle3Drafter, "_skip", recording_skip)
    outputs = run(generator, PROMPTS[1], max_new_tokens=40)
    assert token_ids(outputs) == token_ids(run(plain, PROMPTS[1], max_new_tokens=40))
    assert len(skipped) >= 4 and not skipped & run_over  # dropped, never run over
    assert any(resumed), "no drafts after the pause"
    slots = torch.cat(skipped_slots)
    for keys, values in generator.draft_model.kv_cache.layers:
        assert not keys[slots].any() and not values[slots].any()


def test_chains_carry_the_draft_layers_probabilities_and_stop_where_told(llama_dir, checkpoints, plain,
                                                                        monkeypatch):
    """Each chain token carries the draft layer's probability of it (softmax of the row's logits at the drafted
    token), and a chain ends where `extend` says another token is not worth drafting; output is unchanged."""
    generator = with_eagle(llama_dir, checkpoints["reduced-vocab"])
    drafter = generator.eagle
    rows, drafts = [], []
    forward, draft = drafter.model.forward, drafter.draft

    def recording_forward(*args, **kwargs):
        logits, state = forward(*args, **kwargs)
        rows.append(logits.clone())
        return logits, state

    def two_at_most(requests, lengths, extend=None):
        rows.clear()
        got = draft(requests, lengths, lambda i, confidences: len(confidences) < 2)
        drafts.append((got[0], min(lengths[0], 2), torch.cat(rows)))
        return got

    monkeypatch.setattr(drafter.model, "forward", recording_forward)
    monkeypatch.setattr(drafter, "draft", two_at_most)
    outputs = run(generator, PROMPTS[0], max_new_tokens=24)
    assert token_ids(outputs) == token_ids(run(plain, PROMPTS[0], max_new_tokens=24))
    assert len(drafts) > 5 and all(len(d) == most for d, most, _ in drafts)  # K = 3 granted, two drafted
    for d, _, logits in drafts:
        probabilities = logits.softmax(dim=-1)
        best = probabilities.argmax(dim=-1)
        assert drafter.model.to_target(best).tolist() == d.tokens.tolist()
        assert d.confidences == pytest.approx(probabilities.gather(-1, best[:, None])[:, 0].tolist(), rel=1e-5)


def cheap_drafts(generator) -> None:
    """A fixed cost profile for the adaptive controller: a plain step of 4.4 ms for one sequence, a draft about
    a tenth of that (worth verifying above about 10% acceptance)."""
    from specula_server.speculation.controller import StepCostModel

    cost = StepCostModel(learning=False)
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.004 + 0.0004 * n)
    generator.speculator.step_cost = cost


def rated_drafter(generator, monkeypatch, chain) -> list:
    """Has the EAGLE-3 drafter draft `chain(request, k)` (k (token, probability) pairs) in place of its draft
    layer: each token written past the request's tokens, the chain ended where the controller's `extend` says,
    the request's rows left as the draft layer's catch-up leaves them. Returns the drafts made, as they are made."""
    from specula_server.speculation.drafters import Draft

    made = []

    def draft(requests, lengths, extend=None):
        out = []
        for i, (r, k) in enumerate(zip(requests, lengths)):
            tokens, confidences = [], []
            for token, confidence in chain(r, k):
                r.token_ids[r.num_tokens + len(tokens)] = token
                tokens.append(token)
                confidences.append(confidence)
                if len(tokens) == k or (extend is not None and not extend(i, confidences)):
                    break
            r.draft_cached, r.eagle_kept = r.num_tokens - 1, 0
            r.eagle_aux.clear()
            out.append(Draft(torch.tensor(tokens, dtype=torch.long), confidences=tuple(confidences)))
        made.extend(out)
        return out

    monkeypatch.setattr(generator.eagle, "draft", draft)
    return made


def test_rated_chains_are_verified_by_their_tokens_probabilities(llama_dir, checkpoints, plain, monkeypatch):
    """Adaptive mode drafts a rated chain before choosing its length, and prices each token by what tokens of
    its probability were accepted at, whatever the request's own record (held at 0 here): chains whose tokens the
    draft layer gives 0.95 (always right) are verified whole; those it gives 0.05 (always wrong) end at their
    first token and are declined. Output is the plain one."""
    from specula_server.speculation.controller import AcceptanceEstimate

    generator = with_eagle(llama_dir, checkpoints["echo"], mode="adaptive")
    cheap_drafts(generator)

    class NeverAccepted(AcceptanceEstimate):  # the request's own record
        def estimate(self, prior: float) -> float:
            return 0.0

    plan = generator.speculator.plan

    def planned(requests):
        for r in requests:
            r.acceptance = NeverAccepted()
        return plan(requests)

    monkeypatch.setattr(generator.speculator, "plan", planned)
    prompt = PROMPTS[3]
    expected = token_ids(run(plain, prompt, max_new_tokens=48))
    rights = []  # per chain drafted, whether it was a right one

    def chain(r, k):  # right and rated 0.95, then wrong and rated 0.05, taking turns
        rights.append(len(rights) % 2 == 0)
        nexts = expected[r.num_generated : r.num_generated + k]
        return [(t, 0.95) for t in nexts] if rights[-1] else [((t + 1) % 64, 0.05) for t in nexts]

    made = rated_drafter(generator, monkeypatch, chain)
    outputs = run(generator, prompt, max_new_tokens=48)
    assert token_ids(outputs) == expected
    verified = [(o.num_drafted, o.num_accepted) for o in outputs if o.num_drafted]
    right = [len(d) for d, ok in zip(made, rights) if ok]
    assert len(right) >= 5 and all(n == K for n in right[:-1]), right  # the last may be cut by max_new_tokens
    assert verified == [(n, n) for n in right], (verified, right)
    assert {len(d) for d, ok in zip(made, rights) if not ok} == {1}


def test_rated_chains_batched_and_under_a_grammar_decode_exactly(llama_dir, checkpoints, plain, monkeypatch):
    """Rated chains for a batch, adaptive mode: a request under a JSON-schema grammar (its chains cut before a
    token the grammar forbids, its forced tokens drafted as the grammar's), one without, one with speculation
    off; every third token of each chain wrong though rated 0.9, so chains are verified, accepted in part and
    rejected. Each request's tokens are the plain ones."""
    from test_grammar import MAX_JSON_TOKENS, SCHEMA, json_grammar

    generator = with_eagle(llama_dir, checkpoints["echo"], mode="adaptive")
    cheap_drafts(generator)
    settings = {0: {"max_new_tokens": 32}, 1: {"max_new_tokens": MAX_JSON_TOKENS, "grammar": json_grammar(SCHEMA)},
                2: {"max_new_tokens": 32, "speculative_tokens": 0}}
    prompts = {0: PROMPTS[0], 1: PROMPTS[3], 2: PROMPTS[1]}
    expected = {i: token_ids(run(plain, prompts[i], **settings[i])) for i in settings}
    calls = [0]

    def chain(r, k):
        calls[0] += 1
        nexts = expected[r.id][r.num_generated : r.num_generated + k]
        return [(t if (calls[0] + j) % 3 else (t + 1) % 64, 0.9) for j, t in enumerate(nexts)]

    rated_drafter(generator, monkeypatch, chain)
    pool = BlockPool(256, 16)
    specs = [make_spec(i, prompts[i], pool, lookahead=8, **settings[i]) for i in settings]
    got: dict[int, list[int]] = {i: [] for i in settings}
    methods: dict[int, set[str]] = {i: set() for i in settings}
    accepted = rejected = 0
    for out in run_steps(generator, specs):
        got[out.request_id] += [t.id for t in out.tokens]
        if out.num_drafted:
            methods[out.request_id].add(out.draft_method)
            accepted += out.num_accepted
            rejected += out.num_accepted < out.num_drafted
    assert got == expected
    assert methods[0] == {"eagle3"} and methods[1] >= {"eagle3", "grammar"} and not methods[2], methods
    assert accepted > 0 and rejected > 0


@pytest.mark.parametrize("seconds", [0.001, 0.020])
def test_rated_drafting_backs_off_where_its_steps_are_slower_than_plain_ones(llama_dir, checkpoints, plain,
                                                                               monkeypatch, seconds):
    """Drafting a rated chain is spent before its length is chosen, so the choice cannot weigh it; steps that
    drafted are judged by their expected tokens over their expected time, drafting as it took, against a plain
    step (4.4 ms here; 3 drafts verified in 1.2 ms more). Chains of 3 always right, about 4 tokens a step: where
    drafting takes 1 ms every step drafts; where it takes 20 ms (0.7x a plain step's rate) the controller backs
    off as after declines, drafting at steps 1, 2, 4, 8 and then one in 8. Output is the plain one."""
    generator = with_eagle(llama_dir, checkpoints["echo"], mode="adaptive")
    cheap_drafts(generator)
    generator.speculator.agreed_seconds = lambda nanoseconds: seconds
    prompt = PROMPTS[3]
    expected = token_ids(run(plain, prompt, max_new_tokens=64))
    rated_drafter(generator, monkeypatch,
                  lambda r, k: [(t, 0.95) for t in expected[r.num_generated : r.num_generated + k]])
    outputs = run(generator, prompt, max_new_tokens=64)
    assert token_ids(outputs) == expected
    drafting = [i for i, o in enumerate(outputs) if o.num_drafted]
    plain_steps = len(outputs) - len(drafting)
    if seconds < 0.004:
        assert plain_steps <= 2, drafting  # the prompt's step, and maybe the last
    else:
        assert len(drafting) <= len(outputs) // 4 and plain_steps >= 20, drafting


def test_could_draft_follows_the_controllers_bar(llama_dir, checkpoints):
    """`Speculator.could_draft`: in adaptive mode a request could be granted drafts at the bar of the batch's
    size (`S * c / P(S)`) when its own acceptance estimate clears it (trees) or, for chains (whose tokens carry
    the draft layer's probabilities), while tokens of some probability have lately been accepted above it and
    drafting chains has paid at this load; in fixed mode always."""
    from specula_server.speculation.controller import AcceptanceEstimate

    likely, unlikely = (SimpleNamespace(acceptance=AcceptanceEstimate(successes=s, failures=f),
                                        spec=SimpleNamespace(adapter_id="")) for s, f in
                        ((9.0, 1.0), (1.0, 9.0)))  # estimates 0.82 and 0.18 (the prior weighs two trials)
    trees = with_eagle(llama_dir, checkpoints["echo"], mode="adaptive", draft_tree_width=3).speculator
    chains = with_eagle(llama_dir, checkpoints["echo"], mode="adaptive").speculator
    for speculator in (trees, chains):
        speculator.step_cost.verification_cost = lambda s=speculator: (0.0, 0.5 * s.step_cost.plain(2) / 2)  # 0.5
    assert trees.could_draft([likely, unlikely], 2) == [True, False]
    assert chains.could_draft([likely, unlikely], 2) == [True, True]  # nothing known of its tokens yet
    for _ in range(50):  # tokens the draft layer gave 0.3 and 0.9 were accepted at 20% and 40%
        for q, accepted in ((0.3, 0), (0.3, 0), (0.3, 0), (0.3, 0), (0.3, 1), (0.9, 0), (0.9, 1), (0.9, 0)):
            chains.calibration.observe("eagle3", q, 1, accepted)
    assert chains.could_draft([likely, unlikely], 2) == [False, False]  # whatever their own estimates
    chains.step_cost.verification_cost = lambda: (0.0, 0.3 * chains.step_cost.plain(2) / 2)  # bar 0.3
    assert chains.could_draft([likely, unlikely], 2) == [True, True]
    for _ in range(5):  # steps that drafted chains were expected at 0.8 of a plain step's rate
        chains.rated_speedup.observe(0.8)
    assert chains.could_draft([likely, unlikely], 2) == [False, False]
    assert with_eagle(llama_dir, checkpoints["echo"]).speculator.could_draft([unlikely], 1) == [True]


def test_rows_of_requests_that_could_not_draft_are_dropped_not_run_over(llama_dir, checkpoints, plain, monkeypatch):
    """While the controller could not grant a request drafts at the batch's load (`Speculator.could_draft`), the
    rows it keeps past `MAX_KEPT_ROWS`, its prompt's included, are dropped (entries zeroed), never run over by the
    draft layer; once it could, it drafts again over what it keeps, and its output is plain decoding's."""
    monkeypatch.setattr(eagle3_drafter, "MAX_KEPT_ROWS", 4)
    generator = with_eagle(llama_dir, checkpoints["echo"])
    speculator, steps = generator.speculator, []
    plan, could_draft = speculator.plan, speculator.could_draft

    def no_plan_at_first(reqs):  # decode steps 1-8 plan nothing
        steps.append(None)
        return plan(reqs) if len(steps) > 8 else None

    def could_not_at_first(reqs, batch_size):
        return [False] * len(reqs) if len(steps) <= 8 else could_draft(reqs, batch_size)

    monkeypatch.setattr(speculator, "plan", no_plan_at_first)

    monkeypatch.setattr(speculator, "could_draft", could_not_at_first)
    run_over, skipped = [], []
    catch_up, skip = Eagle3Drafter._catch_up, Eagle3Drafter._skip
    monkeypatch.setattr(Eagle3Drafter, "_catch_up", lambda self, requests, counts: run_over.append(
        (len(steps), requests[0].draft_cached)) or catch_up(self, requests, counts))
    monkeypatch.setattr(Eagle3Drafter, "_skip", lambda self, requests, counts: skipped.append(
        (requests[0].draft_cached, counts[0], requests[0].slots[requests[0].draft_cached:][: counts[0]].clone()))
        or skip(self, requests, counts))
    outputs = run(generator, PROMPTS[1], max_new_tokens=24)
    assert token_ids(outputs) == token_ids(run(plain, PROMPTS[1], max_new_tokens=24))
    assert skipped and skipped[0][0] == 0 and skipped[0][1] >= 4  # the prompt's rows, from its first
    assert all(step > 8 for step, _ in run_over), "run over while it could not draft"
    assert sum(o.num_drafted for o in outputs) > 0, "no drafts once it could"
    for keys, values in generator.draft_model.kv_cache.layers:
        for _, _, slots in skipped:
            assert not keys[slots].any() and not values[slots].any()


@pytest.mark.parametrize("width", [1, 3])
def test_seeded_sampling_matches_no_speculation(llama_dir, checkpoints, width):
    plain_gen = load_test_generator(llama_dir)
    generator = with_eagle(llama_dir, checkpoints["echo"], draft_tree_width=width)
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, do_sample=True)
    accepted = 0
    for prompt in PROMPTS:
        expected = token_ids(run(plain_gen, prompt, max_new_tokens=16, sampling=params))
        got = run(generator, prompt, max_new_tokens=16, sampling=params)
        assert token_ids(got) == expected
        accepted += sum(o.num_accepted for o in got)
    assert accepted > 0


def test_adaptive_mode_and_kv_budget(llama_dir, checkpoints, plain):
    generator = with_eagle(llama_dir, checkpoints["two-layers"], mode="adaptive", tokens=4)
    assert_same_greedy_output(plain, generator, PROMPTS[:2], run, max_new_tokens=16)
    # The draft layers' KV (2 layers, 2 KV heads of 16) in every block, beside the target's (the same shape).
    assert generator.bytes_per_block() == 2 * plain.bytes_per_block()


def test_greedy_output_is_identical_under_lora(llama_dir, checkpoints, tmp_path):
    """A request with a LoRA adapter: the target's states the draft layer reads are the adapted model's."""
    from specula_testing.adapters import build_lora_adapter

    build_lora_adapter(llama_dir, tmp_path / "lora")
    plain_gen = load_test_generator(llama_dir, adapter_dirs=(tmp_path,))
    generator = with_eagle(llama_dir, checkpoints["echo"], adapter_dirs=(tmp_path,))
    for g in (plain_gen, generator):
        g.adapters.load("lora", "local")
    drafted = accepted = 0
    for got in assert_same_greedy_output(plain_gen, generator, PROMPTS, run, max_new_tokens=24, adapter_id="lora"):
        drafted += sum(o.num_drafted for o in got)
        accepted += sum(o.num_accepted for o in got)
    assert drafted > 0 and accepted > 0


def test_constrained_greedy_output_is_identical(llama_dir, checkpoints, plain):
    """JSON-schema and regex requests: EAGLE-3's chains end before a token the grammar forbids, forced tokens
    still draft as the grammar's."""
    from test_grammar import MAX_JSON_TOKENS, REGEX, SCHEMA, json_grammar, regex_grammar

    generator = with_eagle(llama_dir, checkpoints["echo"])
    methods = set()
    for grammar in (json_grammar(SCHEMA), regex_grammar(REGEX)):
        for prompt in (PROMPTS[3], PROMPTS[0]):
            spec = {"max_new_tokens": MAX_JSON_TOKENS, "grammar": grammar, "lookahead": 8}
            got = run(generator, prompt, **spec)
            assert token_ids(got) == token_ids(run(plain, prompt, **spec))
            methods |= {o.draft_method for o in got if o.num_drafted}
    assert methods == {"eagle3", "grammar"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_two_ranks_draft_and_accept_the_same_tokens(llama_dir, checkpoints, tmp_path, mode):
    """Tensor parallel: the draft layer whole on every rank, the target's states the full ones, the verifier's
    embedding (a checkpoint without its own) sharded: greedy and seeded sampled requests give the same tokens on
    both ranks as on one rank. Adaptive: rated chains drafted before their lengths are chosen, and the choices
    (from each rank's own draft probabilities and the agreed timings) the same on both ranks."""
    from test_tensor_parallel import run_requests, run_two_ranks

    no_embedding = rewrite(checkpoints["echo"], tmp_path / "echo", drop=("embed_tokens.weight",))
    settings = {"speculative_tokens": K, "speculation_mode": mode, "speculator": str(no_embedding)}
    expected = run_requests(llama_dir, **settings)
    results = run_two_ranks(llama_dir, settings)
    assert results[0] == results[1] == expected


# --- the original EAGLE-3 layout ----------------------------------------------------------------------------


def to_original_layout(checkpoint: Path, target: Path) -> Path:
    """A one-layer speculators checkpoint written as the original EAGLE-3 repository (and SpecForge) write theirs:
    a flat Llama config with `LlamaForCausalLMEagle3`, the draft layer under `midlayer.`."""
    config = json.loads((checkpoint / "config.json").read_text())
    flat = {**LLAMA_DEFAULTS, **config["transformer_layer_config"], "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": config["draft_vocab_size"], "norm_before_residual": config["norm_before_residual"],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"]}}
    target.mkdir()
    (target / "config.json").write_text(json.dumps(flat))
    weights = load_file(checkpoint / "model.safetensors")
    save_file({k.replace("layers.0.", "midlayer.", 1): v for k, v in weights.items()}, target / "model.safetensors")
    return target


@pytest.mark.parametrize("variant", ["reduced-vocab", "norm-before-residual"])
def test_the_original_layout_drafts_as_its_speculators_conversion(variant, checkpoints, llama_dir, model_config,
                                                                  tmp_path):
    original = to_original_layout(checkpoints[variant], tmp_path / "original")
    drafters = [drafter_for(path, llama_dir, model_config) for path in (checkpoints[variant], original)]
    tokens = torch.randint(0, model_config.vocab_size, (11,), generator=torch.Generator().manual_seed(4))
    aux = torch.randn(10, drafters[0].model.aux_size, generator=torch.Generator().manual_seed(5))
    results = [recorded_logits(drafter, [fake_request(tokens, aux)], [K]) for drafter in drafters]
    (drafts, logits), (original_drafts, original_logits) = results
    assert drafts[0].tokens.tolist() == original_drafts[0].tokens.tolist()
    assert all(torch.equal(a, b) for a, b in zip(logits, original_logits))


def test_the_original_layout_decodes_exactly(llama_dir, checkpoints, plain, tmp_path):
    original = to_original_layout(checkpoints["plain"], tmp_path / "original")
    got = assert_same_greedy_output(plain, with_eagle(llama_dir, original), PROMPTS[:2], run, max_new_tokens=16)
    assert sum(o.num_drafted for outputs in got for o in outputs) > 0


def test_original_weights_in_a_pickle_are_refused_with_what_to_do(checkpoints, llama_dir, model_config, tmp_path):
    original = to_original_layout(checkpoints["plain"], tmp_path / "original")
    torch.save(load_file(original / "model.safetensors"), original / "pytorch_model.bin")
    (original / "model.safetensors").unlink()
    with pytest.raises(Eagle3Error, match=r"a PyTorch pickle \(\.bin\), and Specula reads safetensors only"):
        load_eagle3(original, str(llama_dir), model_config, None)


# --- the `speculators` package itself ---------------------------------------------------------------------


def speculators(*args: str) -> None:
    subprocess.run([SPECULATORS_PYTHON, str(SPECULATORS_SCRIPT), *args], check=True, capture_output=True,
                   timeout=600)


@pytest.fixture(scope="module")
def package_checkpoint(llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("speculators") / "eagle3"
    speculators("save", str(llama_dir), str(out), json.dumps(
        {"draft_vocab_size": 300, "layer_ids": [0, 1, 2], "fc_norm": True, "norm_output": True}))
    return out


def test_the_written_layer_config_is_whole_as_the_package_writes_it():
    """A verifier config written from a GGUF file's metadata lacks `hidden_act` and the other fields vLLM's EAGLE-3
    layer reads; the checkpoint's layer config carries LlamaConfig's values for them."""
    from specula_server.training.eagle3 import eagle3_config

    layer = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 512, "rope_theta": 1e4}
    written = eagle3_config(layer, "LlamaForCausalLM", "verifier", 100, [0, 1, 2])["transformer_layer_config"]
    assert written["hidden_act"] == "silu" and written["attention_bias"] is False and written["mlp_bias"] is False
    assert {k: written[k] for k in layer} == layer and written["num_hidden_layers"] == 1


@pytest.mark.slow
@needs_speculators
def test_the_test_writer_writes_what_speculators_writes(package_checkpoint, llama_dir, tmp_path):
    ours = build_eagle3(tmp_path / "ours", llama_dir, draft_vocab_size=300, layer_ids=[0, 1, 2], fc_norm=True,
                        norm_output=True)
    theirs_config = json.loads((package_checkpoint / "config.json").read_text())
    ours_config = json.loads((ours / "config.json").read_text())
    ignored = {"auto_map", "transformers_version", "architectures"}
    assert {k: v for k, v in ours_config.items() if k not in ignored | {"transformer_layer_config"}} == \
        {k: v for k, v in theirs_config.items() if k not in ignored | {"transformer_layer_config"}}
    layer_keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "vocab_size", "rms_norm_eps", "rope_parameters", "model_type", "hidden_act",
                  "attention_bias", "mlp_bias")
    assert {k: ours_config["transformer_layer_config"].get(k) for k in layer_keys} == \
        {k: theirs_config["transformer_layer_config"].get(k) for k in layer_keys}
    theirs, mine = load_file(package_checkpoint / "model.safetensors"), load_file(ours / "model.safetensors")
    assert {k: (list(v.shape), v.dtype) for k, v in mine.items()} == \
        {k: (list(v.shape), v.dtype) for k, v in theirs.items()}


@pytest.mark.slow
@needs_speculators
@pytest.mark.parametrize("written_by", ["speculators", "specula-train"])
def test_draft_logits_match_speculators_forward(package_checkpoint, llama_dir, model_config, plain, tmp_path,
                                                written_by):
    """The package's training forward, run on our drafted chain (teacher forcing): at the last context row,
    step s reads token index T - 1 + s, so appending the drafts makes its steps our chain's. On a checkpoint
    the package saved, and on one `specula-train eagle3` saves (no embedding: the verifier's)."""
    from specula_server.training.eagle3 import Eagle3Trainee

    checkpoint = package_checkpoint
    if written_by == "specula-train":
        checkpoint = tmp_path / "trainee"
        lm_head = plain.model.lm_head(torch.eye(64)).T.contiguous()
        Eagle3Trainee(plain.model, lm_head, torch.arange(1, 512, 3), (0, 1, 2), init_std=0.1).save(
            checkpoint, llama_dir, str(llama_dir), torch.float32)
    torch.manual_seed(2)
    drafter = drafter_for(checkpoint, llama_dir, model_config) if written_by == "speculators" else \
        Eagle3Drafter(load_eagle3(checkpoint, str(llama_dir), model_config, plain.model.embed_tokens),
                      torch.device("cpu"))
    drafter.allocate_kv_cache(16, 16)
    tokens = torch.randint(0, model_config.vocab_size, (13,))
    aux = torch.randn(12, drafter.model.aux_size)
    drafts, seen = recorded_logits(drafter, [fake_request(tokens, aux)], [K])
    ours = torch.stack([seen[0][-1]] + [logits[0] for logits in seen[1:]])
    chain = drafts[0].tokens[:-1]
    inputs = {
        "input_ids": torch.cat([tokens[1:], chain])[None],
        "hidden_states": torch.cat([aux, torch.zeros(len(chain), aux.shape[1])])[None],
        "position_ids": torch.arange(1, 13 + len(chain))[None],
    }
    save_file(inputs, tmp_path / "inputs.safetensors")
    speculators("forward", str(checkpoint), str(tmp_path / "inputs.safetensors"),
                str(tmp_path / "outputs.safetensors"), str(K))
    theirs = load_file(tmp_path / "outputs.safetensors")["logits"][:, 11]  # [steps, draft_vocab] at the last row
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@needs_speculators
def test_a_speculators_checkpoint_loads_and_decodes_exactly(package_checkpoint, llama_dir, plain):
    generator = with_eagle(llama_dir, package_checkpoint)
    got = assert_same_greedy_output(plain, generator, PROMPTS[:2], run, max_new_tokens=16)
    assert sum(o.num_drafted for outputs in got for o in outputs) > 0


# --- training: `specula-train eagle3` ---------------------------------------------------------------------


def test_the_training_forward_is_the_served_forward(llama_dir, plain, tmp_path):
    """The trainee's step s at position t (teacher-forced tokens) equals the chain drafted after t, fed the
    same tokens, as the reference computes it on the checkpoint the trainee saves: in a batch of samples of
    different lengths whose learned positions start at different places (the prompt's last token), where the
    steps run over a window of positions, not the whole padded batch."""
    from specula_server.training.data import TrainingBatch
    from specula_server.training.eagle3 import Eagle3Trainee

    model = plain.model
    lm_head = model.lm_head(torch.eye(64)).T.contiguous()  # [vocab, hidden]
    trainee = Eagle3Trainee(model, lm_head, torch.arange(0, 512, 2), (0, 1, 2), steps=3, init_std=0.1)
    with torch.no_grad():
        for weight in trainee.norms.values():
            weight.add_(0.2 * torch.randn_like(weight))
    trainee.save(tmp_path / "trainee", llama_dir, str(llama_dir), torch.float32)
    reference = ReferenceDraft(tmp_path / "trainee", embed=model.embed_tokens.weight.detach().clone())
    torch.manual_seed(3)
    n, lengths, firsts = 16, [16, 11, 14], [0, 6, 3]
    tokens, aux = torch.randint(0, 512, (3, n)), torch.randn(3, n, 192)
    valid = torch.zeros(3, n, dtype=torch.bool)
    for i, (length, first) in enumerate(zip(lengths, firsts)):
        tokens[i, length:], aux[i, length:] = 0, 0
        valid[i, first:length] = True
    batch = TrainingBatch(aux, tokens, valid, torch.tensor(lengths))
    with torch.no_grad():
        window, logits = trainee.step_logits(aux, batch)
    assert window.shape == (3, 16) and window[1, 0] == 6 and window[2, 0] == 3
    for i, t in [(0, 10), (0, 2), (1, 6), (1, 7), (2, 3), (2, 10)]:
        got = torch.stack([step[i, t - firsts[i]] for step in logits])
        expected = reference.chain(aux[i, : t + 1], tokens[i, 1 : t + 2], torch.arange(t + 1), 3,
                                   fed=tokens[i, t + 2 : lengths[i]])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def write_prompts(path: Path, count: int) -> Path:
    words = ["def", "return", "class", "import", "value", "self", "for", "in", "range", "print", "if", "else"]
    with path.open("w") as f:
        for i in range(count):
            f.write(json.dumps({"prompt": " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(4 + i % 5))})
                    + "\n")
    return path


@pytest.mark.slow
def test_specula_train_eagle3_learns_what_the_server_accepts(llama_dir, plain, tmp_path):
    from typer.testing import CliRunner

    from specula_server.training.cli import app
    from specula_server.training.data import read_prompts

    prompts = write_prompts(tmp_path / "prompts.jsonl", 96)
    out = tmp_path / "eagle3"
    result = CliRunner().invoke(app, [
        "eagle3", "--model-id", str(llama_dir), "--prompts", str(prompts), "--output", str(out),
        "--draft-vocab-size", "256", "--max-new-tokens", "24", "--epochs", "20", "--batch-size", "8",
        "--lr", "1e-2", "--eval-fraction", "0.25",
    ])
    assert result.exit_code == 0, result.output
    held = json.loads((out / "training.json").read_text())["held_out"]
    assert held["mean_accepted_after"] > held["mean_accepted_before"] + 0.8, held
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 256 and config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    # Served: identical greedy output, and most drafts accepted (an untrained drafter gets almost none).
    generator = with_eagle(llama_dir, out)
    texts = read_prompts(prompts)[:12]
    drafted = accepted = 0
    for got in assert_same_greedy_output(plain, generator, [generator.tokenizer.encode(p).ids for p in texts], run,
                                         max_new_tokens=24, lookahead=4):
        drafted += sum(o.num_drafted for o in got)
        accepted += sum(o.num_accepted for o in got)
    assert accepted > 0.5 * drafted, (accepted, drafted)


def reference_tree(reference: ReferenceDraft, aux, pairs, width: int, budget: int) -> tuple[list, list]:
    """SGLang's top-W expansion computed from scratch: every path's logits from the reference's chain fed that
    path; at each depth the W best nodes so far expand; the `budget` best of all nodes, parents first."""
    nodes, frontier = [], [(-1, [])]  # nodes: (score, depth, token, parent); frontier: (node, its path)
    positions = torch.arange(len(pairs))
    for depth in range(1, budget + 1):
        candidates = []
        for parent, path in frontier:
            logits = reference.chain(aux, pairs, positions, len(path) + 1, fed=path)[-1]
            top = torch.log_softmax(logits, -1).topk(width)
            base = nodes[parent][0] if parent >= 0 else 0.0
            candidates += [(base + float(v), int(d + reference.d2t[d]), parent, path)
                           for v, d in zip(top.values, top.indices)]
        candidates.sort(key=lambda c: -c[0])
        frontier = []
        for rank, (score, token, parent, path) in enumerate(candidates):
            nodes.append((score, depth, token, parent))
            if rank < width and depth < budget:
                frontier.append((len(nodes) - 1, path + [token]))
        if not frontier:
            break
    best = sorted(range(len(nodes)), key=lambda n: (-nodes[n][0], nodes[n][1], n))[:budget]
    where = {n: p for p, n in enumerate(best)}
    return [nodes[n][2] for n in best], [where[nodes[n][3]] if nodes[n][3] >= 0 else -1 for n in best]


@pytest.mark.parametrize("budget", [1, 3, 6])
def test_tree_drafts_are_the_top_w_expansion(checkpoints, llama_dir, model_config, budget):
    """Width 3, batched with a request of another length: each request's tree is the expansion from scratch
    (the expanded nodes' draft entries in scratch slots, seeing the context and their own ancestors only)."""
    torch.manual_seed(4)
    model = drafter_for(checkpoints["two-layers"], llama_dir, model_config).model
    tree = Eagle3Drafter(model, torch.device("cpu"), tree_width=3)
    tree.allocate_kv_cache(16, 16)
    reference = ReferenceDraft(checkpoints["two-layers"])
    specs = [(torch.randint(0, 512, (n,)), torch.randn(n - 1, model.aux_size)) for n in (9, 5)]
    drafts = tree.draft([fake_request(t, a, b) for (t, a), b in zip(specs, ([0, 1], [2, 3]))], [budget, 2])
    for (tokens, aux), draft, k in zip(specs, drafts, (budget, 2)):
        expected_tokens, expected_parents = reference_tree(reference, aux, tokens[1:], 3, k)
        assert draft.tokens.tolist() == expected_tokens
        assert draft.node_parents() == expected_parents


def test_leaves_only_trees_when_scratch_runs_out(checkpoints, llama_dir, model_config, monkeypatch):
    """Without scratch slots for the step: the top-1 chain with the other top-W tokens of every depth as
    leaves, the best `k` nodes, parents first."""
    monkeypatch.setattr(eagle3_drafter, "SCRATCH_SLOTS", 0)
    torch.manual_seed(4)
    chain = drafter_for(checkpoints["two-layers"], llama_dir, model_config)
    tree = Eagle3Drafter(chain.model, torch.device("cpu"), tree_width=3)
    tree.allocate_kv_cache(16, 16)
    tokens, aux = torch.randint(0, 512, (9,)), torch.randn(8, chain.model.aux_size)
    line = chain.draft([fake_request(tokens, aux)], [8])[0].tokens.tolist()
    for budget in (1, 4, 8):
        draft = tree.draft([fake_request(tokens, aux)], [budget])[0]
        assert len(draft) == budget
        parents = draft.node_parents()
        assert all(p < i for i, p in enumerate(parents))
        paths = []
        for token, parent in zip(draft.tokens.tolist(), parents):
            paths.append((paths[parent] if parent >= 0 else []) + [token])
        assert all(path[:-1] == line[: len(path) - 1] for path in paths)  # every inner node is on the chain
        assert paths[0] == line[:1]
    assert not draft.is_chain  # at 8 nodes, some leaf beat the chain's depth


@pytest.mark.slow
@needs_speculators
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_the_original_layout_reads_as_the_speculators_converter_converts_it(package_checkpoint, llama_dir,
                                                                           model_config, tmp_path,
                                                                           norm_before_residual):
    """The package's converter (`speculators convert`) on an original-layout checkpoint, against reading that
    checkpoint directly: the same drafts and logits."""
    config = json.loads((package_checkpoint / "config.json").read_text())
    source = rewrite(package_checkpoint, tmp_path / "source", {"norm_before_residual": norm_before_residual,
                                                               "fc_norm": False, "norm_output": False},
                     drop=[k for k in load_file(package_checkpoint / "model.safetensors") if k.startswith("fc_norm")])
    original = to_original_layout(source, tmp_path / "original")
    speculators("convert", str(original), str(tmp_path / "converted"), str(llama_dir), json.dumps(
        {"norm_before_residual": norm_before_residual,
         "eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"]}))
    drafters = [drafter_for(path, llama_dir, model_config) for path in (tmp_path / "converted", original)]
    tokens = torch.randint(0, model_config.vocab_size, (11,), generator=torch.Generator().manual_seed(6))
    aux = torch.randn(10, drafters[0].model.aux_size, generator=torch.Generator().manual_seed(7))
    (drafts, logits), (original_drafts, original_logits) = [
        recorded_logits(drafter, [fake_request(tokens, aux)], [K]) for drafter in drafters]
    assert drafts[0].tokens.tolist() == original_drafts[0].tokens.tolist()
    assert all(torch.equal(a, b) for a, b in zip(logits, original_logits))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("width", [1, 3])
def test_greedy_output_is_identical_on_cuda(llama_dir, checkpoints, width):
    """The draft layer, its KV and the verification of its chains (and trees) on the GPU."""
    plain = load_test_generator(llama_dir, device="cuda")
    drafted = with_eagle(llama_dir, checkpoints["echo"], device="cuda", draft_tree_width=width)
    got = assert_same_greedy_output(plain, drafted, PROMPTS, run, max_new_tokens=24)
    assert sum(o.num_accepted for outputs in got for o in outputs) > 0  # on CPU: 13 of 221 drafts at width 1
