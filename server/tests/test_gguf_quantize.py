"""`--quantize gguf`: a GGUF file's Q8_0, Q4_0 and Q4_1 tensors served as the file holds them.

The blocks each layer holds are the file's (their values are what the float path reads: the same reference
dequantizers), so served output matches transformers reading the same file; two ranks serve as one; the native
stack runs them with the layers' bits (test_native_stack.py); the flag is refused for a file it cannot apply to.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from test_model_parity import PROMPTS, reference_greedy
from test_tensor_parallel import run_two_ranks

from specula_kernels import native
from specula_server.gguf_checkpoint import GGUFTensors
from specula_server.layers.quantization import DenseLinear, GGUFLinear
from specula_server.server import ServerConfig
from specula_server.weights import Weights
from specula_testing.gguf_files import write_gguf
from specula_testing.worker import BlockPool, generate_alone, load_test_generator, make_spec, token_ids

pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")

SERVED = ["Q8_0", "Q4_0", "Q4_1"]


@pytest.mark.parametrize("kind", SERVED)
def test_every_linear_holds_the_files_blocks_with_the_values_the_float_path_reads(gguf_files, kind):
    generator = load_test_generator(gguf_files[kind], quantize="gguf")
    linears = [m for m in generator.model.modules() if isinstance(m, (GGUFLinear, DenseLinear))]
    assert linears and all(isinstance(m, GGUFLinear) and m.type_name == kind for m in linears)
    tensors = GGUFTensors(gguf_files[kind])
    for name in tensors.keys():
        rows = tensors.get_slice(name).get_shape()
        if len(rows) == 2:  # q/k rows unpermuted; whole tensors and each half (a rank's rows)
            for start, stop in ((0, rows[0]), (0, rows[0] // 2), (rows[0] // 2, rows[0])):
                blocks = tensors.get_blocks(name, start, stop)
                assert torch.equal(blocks.dequantize(), tensors.get_tensor(name)[start:stop]), (name, start)


@pytest.mark.parametrize("kind", SERVED)
def test_served_greedy_tokens_and_logprobs_match_transformers_on_the_same_file(gguf_files, kind):
    file = gguf_files[kind]
    reference = transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                                  dtype=torch.float32).eval()
    generator = load_test_generator(file, quantize="gguf")
    for i, prompt in enumerate(PROMPTS):
        outputs = generate_alone(generator, make_spec(i, prompt, BlockPool(256, 16), max_new_tokens=16))
        expected_tokens, expected_logprobs = reference_greedy(reference, prompt, 16)
        assert token_ids(outputs) == expected_tokens
        assert [t.logprob for o in outputs for t in o.tokens] == pytest.approx(expected_logprobs, abs=1e-4)


def test_two_ranks_serve_the_blocks_as_one_does(gguf_files):
    """Each rank holds whole rows (the row-parallel layers split their outputs), so its dot products are one
    rank's, bit for bit."""
    file = gguf_files["Q4_1"]
    expected = token_ids(generate_alone(load_test_generator(file, quantize="gguf"),
                                        make_spec(0, PROMPTS[0], BlockPool(256, 16), max_new_tokens=24)))
    results = run_two_ranks(file, {"quantize": "gguf"})
    assert results[0][0] == expected and results[1][0] == expected


def test_types_without_native_blocks_and_mixed_fusions_are_served_as_float(gguf_files, llama_dir, tmp_path):
    """A K-quant file's tensors are dequantized as without the flag; so is a fused q/k/v whose parts differ."""
    k_quant = load_test_generator(gguf_files["Q4_K"], quantize="gguf")
    assert not any(isinstance(m, GGUFLinear) for m in k_quant.model.modules())
    mixed = write_gguf(llama_dir, tmp_path / "mixed.gguf", "Q4_1", types={"blk.0.attn_v.weight": "Q8_0"})
    generator = load_test_generator(mixed, quantize="gguf")
    first = generator.model.layers[0]
    assert isinstance(first.self_attn.qkv_proj.linear, DenseLinear)
    assert isinstance(first.mlp.gate_up_proj.linear, GGUFLinear)
    reference = transformers.AutoModelForCausalLM.from_pretrained(mixed.parent, gguf_file=mixed.name,
                                                                  dtype=torch.float32).eval()
    outputs = generate_alone(generator, make_spec(0, PROMPTS[0], BlockPool(256, 16), max_new_tokens=12))
    assert token_ids(outputs) == reference_greedy(reference, PROMPTS[0], 12)[0]


def test_the_flag_is_refused_for_a_checkpoint_that_is_not_a_gguf_file(llama_dir):
    from specula_launcher.defaults import build_config

    with pytest.raises(ValueError, match=r"--quantize gguf serves a GGUF file's own blocks; --model-id \S+ is not"):
        ServerConfig(model_id=str(llama_dir), uds_path="/tmp/unused", quantize="gguf")
    with pytest.raises(ValueError, match=r"--quantize gguf serves a GGUF file's own blocks; --model-id org/model is"):
        build_config(model_id="org/model", quantize="gguf", count_cuda_devices=lambda: 0, shard_uds_path="/run/s")


def test_without_the_flag_the_reader_hands_out_float(gguf_files):
    weights = Weights([gguf_files["Q4_1"]], torch.device("cpu"), torch.float32)
    weight = weights.get_linear(["model.layers.0.mlp.down_proj.weight"], dim=1)
    assert isinstance(weight, torch.Tensor) and weight.dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_files_values_are_served_as_float(gguf_files):
    from test_cuda_worker import agree_up_to_a_near_tie

    file = gguf_files["Q4_1"]
    cuda = load_test_generator(file, quantize="gguf", device="cuda")
    assert not any(isinstance(m, GGUFLinear) for m in cuda.model.modules())
    cpu = load_test_generator(file, quantize="gguf")
    for i, prompt in enumerate(PROMPTS):
        spec = {"max_new_tokens": 16, "top_n_tokens": 2}
        got = generate_alone(cuda, make_spec(i, prompt, BlockPool(256, 16), **spec))
        expected = generate_alone(cpu, make_spec(i, prompt, BlockPool(256, 16), **spec))
        assert agree_up_to_a_near_tie(got, expected, 1e-3) >= 8
