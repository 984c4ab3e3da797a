"""`--quantize int8|int4` in the worker: the quantized model against transformers on the same quantized
weights, tensor parallelism, speculation and LoRA on a quantized base, and the checkpoints and flags refused."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from test_model_parity import reference_greedy
from test_tensor_parallel import free_port, run_two_ranks
from typer.testing import CliRunner

from specula_kernels import native, triton_int8_linear
from specula_kernels.quantized_linear import (
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    w8a8_linear_reference,
)
from specula_kernels.sgmv import triton_available
from specula_proto import generate_pb2 as pb
from specula_server.cli import app
from specula_server.layers import quantization
from specula_server.layers.quantization import (
    Int4Linear,
    Int8Linear,
    Quantization,
    W8A8Linear,
    build_linear,
)
from specula_server.server import ServerConfig
from specula_server.service import TextGenerationService, WorkerInfo
from specula_testing.adapters import (
    build_lora_adapter,
    build_medusa_adapter,
    load_peft_reference,
)
from specula_testing.worker import (
    BlockPool,
    assert_same_greedy_output,
    generate_alone,
    load_test_generator,
    make_spec,
    token_ids,
)

PROMPTS = [[1, 50, 60, 70, 80, 90, 100], [1, 7, 8, 7, 8, 7], [1] + list(range(100, 140))]
NUM_NEW = 16
SETTINGS = {"int8": {"quantize": "int8"}, "int4": {"quantize": "int4", "quantize_group_size": 32},
            "w8a8": {"quantize": "w8a8"}}
# The references round each product's input and output to bfloat16 as the kernels do, but sum in another order:
# now and then an output lands one bfloat16 step (2^-8 of it) apart, which 16 tokens of a small random model can
# grow to a hundredth of a logprob (measured: up to 0.015 with a LoRA adapter, 2e-6 without).
LOGPROB_TOLERANCE = 3e-2
TGI_ONLY = ["eetq", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "gptq", "awq", "marlin", "fp8", "exl2"]


@pytest.fixture(scope="module")
def model_dir(llama_dir) -> Path:
    # The shared tiny Llama: with larger random weights (init_std 0.2 and up) the model turns chaotic and a
    # one-ulp difference in a bfloat16 output grows to a few hundredths of a logprob within 16 tokens.
    return llama_dir


def fake_quantized_copy(model_dir: Path, out_dir: Path, method: str) -> Path:
    """`model_dir` with every linear weight replaced by its quantized values, dequantized: a float checkpoint
    that transformers runs as the quantized worker should."""
    shutil.copytree(model_dir, out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    for name, weight in tensors.items():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            if method == "int8":
                tensors[name] = dequantize_int8(*quantize_int8(weight))
            else:
                tensors[name] = dequantize_int4(*quantize_int4(weight, SETTINGS["int4"]["quantize_group_size"]))
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def round_products_to_bfloat16(model: torch.nn.Module, outputs: bool = True) -> torch.nn.Module:
    """Makes every base-model linear of a transformers (or peft) model take and return bfloat16-rounded values,
    as the quantized kernels do (LoRA's own products stay float32, as in the worker); with `outputs` False, only
    take them (the Triton int8 kernel returns float32 sums)."""
    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lora_" not in name:
            module.register_forward_pre_hook(lambda _, args: (rounded(args[0]),))
            if outputs:
                module.register_forward_hook(lambda _, args, out: rounded(out))
    return model.eval()


@pytest.fixture(params=["native", "pytorch"])
def kernels(request, monkeypatch) -> str:
    """Which products the quantized layers run on: the native kernels (skipped where they are not built) or
    PyTorch's packed ones, which round a product's input and output to bfloat16."""
    if request.param == "native":
        if native.library() is None:
            pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    else:
        monkeypatch.setattr(quantization, "_native_kernels", lambda device: None)
    return request.param


def reference_for(model: torch.nn.Module, kernels: str) -> torch.nn.Module:
    """transformers (or peft) on the dequantized weights, rounded as the worker's kernels round."""
    return model.eval() if kernels == "native" else round_products_to_bfloat16(model)


@pytest.fixture(scope="module")
def fake_quantized(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fake-quantized")
    return {method: fake_quantized_copy(model_dir, root / method, method) for method in SETTINGS}


def run_prompts(generator, **kwargs) -> list[list]:
    pool = BlockPool(generator.kv_cache.num_blocks, 16)
    results = []
    for i, prompt in enumerate(PROMPTS):
        spec = make_spec(i, prompt, pool, max_new_tokens=NUM_NEW, **kwargs)
        results.append(generate_alone(generator, spec))
        pool.give(spec.blocks)
    return results


def assert_matches_reference(outputs: list[list], reference) -> None:
    for prompt, got in zip(PROMPTS, outputs):
        tokens, logprobs = reference_greedy(reference, prompt, NUM_NEW)
        assert token_ids(got) == tokens, prompt
        assert [t.logprob for o in got for t in o.tokens] == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_worker_matches_transformers_on_the_quantized_weights(model_dir, fake_quantized, method, kernels):
    import transformers

    generator = load_test_generator(model_dir, **SETTINGS[method])
    assert all(getattr(m, "native", None) == (None if kernels == "pytorch" else native.library())
               for m in generator.model.modules() if isinstance(m, (Int8Linear, Int4Linear)))
    reference = transformers.AutoModelForCausalLM.from_pretrained(fake_quantized[method], dtype=torch.float32)
    assert_matches_reference(run_prompts(generator), reference_for(reference, kernels))


def w8a8_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A transformers model whose linear layers multiply as `--quantize w8a8` defines it: int8 weights with a scale
    per output row, by activations quantized per row and block of 32 inputs (`w8a8_linear_reference`)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            q, scale = quantize_int8(module.weight.detach())
            module.forward = lambda x, q=q, scale=scale: w8a8_linear_reference(
                x.reshape(-1, x.shape[-1]), q, scale).reshape(*x.shape[:-1], q.shape[0])
    return model.eval()


def test_w8a8_worker_matches_transformers_with_w8a8_products(model_dir, kernels):
    """The whole model (attention, norms, rotary, sampling) as transformers runs it, every product replaced by the
    W8A8 definition: the native kernel equals that definition bit for bit, and without the kernels the worker runs
    the definition itself."""
    import transformers

    generator = load_test_generator(model_dir, **SETTINGS["w8a8"])
    layers = [m for m in generator.model.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == 4 * generator.model.config.num_layers + 1
    assert all(m.native == (None if kernels == "pytorch" else native.library()) for m in layers)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert_matches_reference(run_prompts(generator), w8a8_reference(reference))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
def test_int8_on_cuda_runs_the_triton_kernel_and_matches_transformers(model_dir, fake_quantized, monkeypatch):
    import transformers

    calls = []
    real = triton_int8_linear.int8_linear_triton
    monkeypatch.setattr(triton_int8_linear, "int8_linear_triton", lambda *args: calls.append(1) or real(*args))
    generator = load_test_generator(model_dir, device="cuda", **SETTINGS["int8"])
    outputs = run_prompts(generator)
    assert calls
    reference = transformers.AutoModelForCausalLM.from_pretrained(fake_quantized["int8"], dtype=torch.float32)
    assert_matches_reference(outputs, round_products_to_bfloat16(reference, outputs=False))


@pytest.mark.parametrize("method,layer_type,weight_dtype", [("int8", Int8Linear, torch.int8),
                                                            ("int4", Int4Linear, torch.uint8),
                                                            ("w8a8", W8A8Linear, torch.int8)])
def test_every_linear_holds_quantized_weights(model_dir, method, layer_type, weight_dtype):
    model = load_test_generator(model_dir, num_blocks=4, **SETTINGS[method]).model
    layers = [m for m in model.modules() if hasattr(m, "linear")]
    assert len(layers) == 4 * model.config.num_layers + 1  # qkv, o, gate_up, down per layer; the LM head
    assert all(isinstance(m.linear, layer_type) for m in layers)
    float_names = {n for n, p in model.named_parameters() if p.is_floating_point()}
    assert all("norm" in n or "embed_tokens" in n or n.endswith(".bias") for n in float_names), float_names
    weights = {n: b for n, b in model.named_buffers() if n.endswith((".linear.qweight", ".linear.packed",
                                                                      ".linear.tiles"))}
    if method in ("int8", "w8a8") and native.library():  # native: bytes of tiles, each with its rows' scales
        weight_dtype = torch.uint8
    assert len(weights) == len(layers) and all(b.dtype == weight_dtype for b in weights.values())
    scales = [b for n, b in model.named_buffers() if ".linear." in n and n not in weights]
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    assert nbytes(scales) * 4 <= nbytes(weights.values())  # scales and zeros: at most a fifth of the bytes


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8"])
def test_two_ranks_match_one_rank_quantized(model_dir, method):
    """Each rank quantizes its own rows to the values one rank holds, and computes whole dot products: greedy and
    seeded sampled output are one rank's."""
    from test_tensor_parallel import run_requests

    expected = run_requests(model_dir, **SETTINGS[method])
    results = run_two_ranks(model_dir, SETTINGS[method])
    assert results[0] == expected
    assert results[1] == expected


@pytest.mark.parametrize("method,drafter", [("int8", "prompt lookup"), ("int4", "prompt lookup"),
                                            ("w8a8", "prompt lookup"), ("int4", "medusa on the base LM head")])
def test_greedy_output_is_identical_with_speculation_on_a_quantized_base(model_dir, tmp_path, method, drafter,
                                                                       kernels):
    plain = load_test_generator(model_dir, **SETTINGS[method])
    speculator = None
    if drafter.startswith("medusa"):  # the LoRAX v2 layout: its heads end in the (quantized) base LM head
        speculator = str(build_medusa_adapter(model_dir, tmp_path / "medusa", num_heads=3, own_heads=False))
    drafted = load_test_generator(model_dir, speculative_tokens=4, speculation_mode="fixed", speculator=speculator,
                                  **SETTINGS[method])
    prompts = [[1] + [50, 60, 70, 80, 90] * 4, [1, 7, 8, 9, 7, 8, 9, 7, 8]]  # repetitive: drafts get accepted

    def run(generator, prompt):
        return generate_alone(generator, make_spec(0, prompt, BlockPool(256, 16), max_new_tokens=32))

    outputs = assert_same_greedy_output(plain, drafted, prompts, run)
    assert sum(o.num_drafted for got in outputs for o in got) > 0  # speculation really ran


@pytest.fixture(scope="module")
def adapter_root(model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    build_lora_adapter(model_dir, root / "lora", rank=8, alpha=16, seed=3)
    return root


def lora_outputs(model_dir: Path, adapter_root: Path, group=None, **settings) -> tuple[list[list], list[list]]:
    """Every prompt's outputs with the adapter, and without it, from one generator."""
    generator = load_test_generator(model_dir, group=group, adapter_dirs=(adapter_root,), **settings)
    generator.adapters.load("lora", "local")
    return run_prompts(generator, adapter_id="lora"), run_prompts(generator)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_lora_on_a_quantized_base_matches_peft_on_the_quantized_weights(model_dir, fake_quantized, adapter_root,
                                                                        method, kernels):
    with_adapter, without = lora_outputs(model_dir, adapter_root, **SETTINGS[method])
    assert any(token_ids(a) != token_ids(b) for a, b in zip(with_adapter, without))  # the delta is applied
    reference = reference_for(load_peft_reference(fake_quantized[method], adapter_root / "lora"), kernels)
    assert_matches_reference(with_adapter, reference)


def _lora_rank_main(rank: int, port: int, model_dir: Path, adapter_root: Path, settings: dict, queue) -> None:
    from specula_server.distributed import init_distributed

    torch.set_num_threads(1)
    group = init_distributed(rank, 2, "127.0.0.1", port, torch.device("cpu"))
    try:
        outputs, _ = lora_outputs(model_dir, adapter_root, group, **settings)
        queue.put((rank, [token_ids(o) for o in outputs]))
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_apply_lora_on_a_quantized_base_as_one_rank(model_dir, adapter_root):
    """A quantized row-parallel layer gathers its outputs; the shards' partial LoRA deltas are summed apart."""
    expected = [token_ids(o) for o in lora_outputs(model_dir, adapter_root, **SETTINGS["int8"])[0]]
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_lora_rank_main, args=(r, port, model_dir, adapter_root, SETTINGS["int8"], queue))
             for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert results[0] == expected and results[1] == expected


@pytest.mark.parametrize("value", TGI_ONLY)
def test_unsupported_quantize_values_list_the_supported_ones(llama_dir, value):
    with pytest.raises(ValueError, match=f"--quantize {value} is not supported; supported: int8, int4"):
        ServerConfig(model_id=str(llama_dir), uds_path="/tmp/unused", quantize=value)


def test_the_command_line_refuses_them_too(llama_dir):
    result = CliRunner().invoke(app, ["serve", str(llama_dir), "--quantize", "bitsandbytes-nf4"])
    assert result.exit_code == 2
    assert "supported: int8, int4" in " ".join(result.output.replace("│", " ").split())  # unwrap the error box


def test_group_sizes_the_kernels_do_not_take_are_refused(llama_dir):
    with pytest.raises(ValueError, match="--quantize-group-size must be one of 32, 64, 128, 256; got 48"):
        ServerConfig(model_id=str(llama_dir), uds_path="/tmp/unused", quantize="int4", quantize_group_size=48)
    assert Quantization.parse("INT8 ") == Quantization("int8") and Quantization.parse("") is None


def test_layers_that_do_not_fit_the_format_are_named():
    with pytest.raises(ValueError, match="--quantize int4 with --quantize-group-size 64 needs every linear's "
                                         "inputs to be whole groups; model.x.o_proj has 96"):
        build_linear(torch.zeros(32, 96), Quantization("int4", 64), "model.x.o_proj")
    with pytest.raises(ValueError, match="--quantize int8 needs every linear's inputs to be a multiple of 16"):
        build_linear(torch.zeros(32, 40), Quantization("int8"), "lm_head")


@pytest.mark.parametrize("how", ["config", "tensors"])
def test_prequantized_checkpoints_are_refused_naming_quantize(llama_dir, tmp_path, how):
    model = shutil.copytree(llama_dir, tmp_path / "gptq")
    if how == "config":
        config = json.loads((model / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
        (model / "config.json").write_text(json.dumps(config))
        expected = r"already quantized \(gptq\)"
    else:  # an AWQ-style layout without a quantization_config
        tensors = load_file(model / "model.safetensors")
        tensors["model.layers.0.mlp.down_proj.qweight"] = torch.zeros(16, 8, dtype=torch.int32)
        save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
        expected = r"already quantized \(a quantized format \(tensor model.layers.0.mlp.down_proj.qweight\)\)"
    for quantize in (None, "int4"):
        with pytest.raises(ValueError, match=expected + ".*with --quantize int8\\|int4"):
            load_test_generator(model, num_blocks=4, quantize=quantize)


def test_info_reports_quantize(model_dir):
    generator = load_test_generator(model_dir, num_blocks=4, quantize="int8")
    info = WorkerInfo(str(model_dir), "", torch.device("cpu"), 1, ("unix:///tmp/unused-0",), None, quantize="int8")
    assert asyncio.run(TextGenerationService(generator, info).Info(pb.InfoRequest(), None)).quantize == "int8"
    assert pb.InfoResponse().quantize == ""  # float weights


@pytest.mark.parametrize("quantize,expected", [("int4", "int4"), ("", None)])
def test_router_info_reports_quantize(quantize, expected):
    from specula_router.config import RouterConfig
    from specula_router.startup import Limits, info_body

    config = RouterConfig(model_id="fake", master_shard_uds_path="/tmp/unused-0")
    info = pb.InfoResponse(model_id="fake", dtype="float32", device_type="cpu", block_size=16, world_size=1,
                           max_position_embeddings=512, quantize=quantize)
    body = info_body(config, info, Limits(100, 200, 512), num_blocks=8)
    assert body["quantize"] == expected


def test_the_launcher_passes_quantize_to_every_shard_and_refuses_the_rest():
    from specula_launcher.commands import shard_command
    from specula_launcher.defaults import build_config

    no_gpu = {"count_cuda_devices": lambda: 0, "shard_uds_path": "/run/s"}
    config = build_config(model_id="org/model", quantize="int4", quantize_group_size=32, **no_gpu)
    argv = shard_command(config)
    assert argv[argv.index("--quantize") + 1] == "int4" and argv[argv.index("--quantize-group-size") + 1] == "32"
    assert "--quantize" not in shard_command(build_config(model_id="org/model", **no_gpu))
    with pytest.raises(ValueError, match="--quantize gptq is not supported; supported: int8, int4"):
        build_config(model_id="org/model", quantize="gptq", **no_gpu)
    with pytest.raises(ValueError, match="--quantize-group-size must be one of 32, 64, 128, 256; got 16"):
        build_config(model_id="org/model", quantize="int4", quantize_group_size=16, **no_gpu)
