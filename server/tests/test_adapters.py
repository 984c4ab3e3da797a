"""Adapter sources, PEFT LoRA loading (against peft's own modules) and Medusa heads (against hand computation)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specula_server.adapters import (
    AdapterError,
    LoraConfig,
    detect_adapter_kind,
    load_lora,
    load_medusa,
    resolve_adapter,
)
from specula_server.adapters.lora import COLUMN_PARALLEL, PROJECTIONS
from specula_server.models.config import ModelConfig
from specula_testing.adapters import medusa_tensors as random_medusa_tensors

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
SECRET = "hf_secret_token_never_shown"


def build_peft_adapter(model_dir, out_dir, *, rank, alpha, targets, use_rslora=False, seed=0, safe=True):
    """Saves a PEFT LoRA with random A and B (`init_lora_weights=False`; PEFT's default B is zero) and returns
    the PeftModel, whose modules are the reference."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                             init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(out_dir, safe_serialization=safe)
    return model


def peft_delta(model, layer: int, projection: str, x: torch.Tensor) -> torch.Tensor:
    block = model.base_model.model.model.layers[layer]
    module = getattr(block.self_attn if projection in ATTENTION else block.mlp, projection)
    with torch.no_grad():
        return module(x) - module.base_layer(x)


@pytest.fixture(scope="module")
def base_config(llama_dir) -> ModelConfig:
    return ModelConfig.from_dir(llama_dir)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, llama_dir):
    """root and {name: PeftModel}: every projection; q and v only; rslora on o/gate/down; a pickled copy."""
    root = tmp_path_factory.mktemp("adapters")
    models = {
        "all": build_peft_adapter(llama_dir, root / "all", rank=8, alpha=16, targets=PROJECTIONS, seed=1),
        "qv": build_peft_adapter(llama_dir, root / "qv", rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=2),
        "rslora": build_peft_adapter(llama_dir, root / "rslora", rank=16, alpha=32, use_rslora=True, seed=3,
                                     targets=("o_proj", "gate_proj", "down_proj")),
    }
    models["pickled"] = build_peft_adapter(llama_dir, root / "pickled", rank=4, alpha=4, targets=("k_proj",),
                                           seed=4, safe=False)
    return root, models


def full_dims(config: ModelConfig, projection: str) -> int:
    q, i = config.num_heads * config.head_dim, config.intermediate_size
    return {"q_proj": config.hidden_size, "k_proj": config.hidden_size, "v_proj": config.hidden_size,
            "o_proj": q, "gate_proj": config.hidden_size, "up_proj": config.hidden_size, "down_proj": i}[projection]


@contextlib.contextmanager
def raises(status: int, *words: str):
    """An AdapterError with this status whose message holds every one of `words`."""
    with pytest.raises(AdapterError) as info:
        yield info
    assert info.value.status == status, str(info.value)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# --- LoRA config --------------------------------------------------------------------------------------------------


def test_config_of_saved_adapters(adapters, base_config, llama_dir):
    root, _ = adapters
    weights = {name: load_lora(root / name, base_config) for name in ("all", "qv", "rslora")}
    assert (weights["all"].config.rank, weights["all"].config.alpha) == (8, 16)
    assert weights["all"].config.scaling == 2.0 and weights["qv"].config.scaling == 2.0
    assert weights["rslora"].config.use_rslora and weights["rslora"].config.scaling == pytest.approx(32 / 4)
    assert weights["qv"].config.target_modules == {"q_proj", "v_proj"} == weights["qv"].projections
    assert weights["all"].projections == set(PROJECTIONS)
    assert weights["qv"].config.base_model_name == str(llama_dir)


@pytest.mark.parametrize("targets, expected", [
    (["q_proj", "v_proj"], {"q_proj", "v_proj"}),
    (["model.layers.0.self_attn.k_proj", "mlp.down_proj"], {"k_proj", "down_proj"}),
    ("all-linear", set(PROJECTIONS)),
    (r".*\.(q_proj|up_proj)", {"q_proj", "up_proj"}),
    (r"model\.layers\.1\.self_attn\.o_proj", {"o_proj"}),
])
def test_target_modules_forms(targets, expected):
    config = LoraConfig.from_dict({"r": 8, "lora_alpha": 4, "target_modules": targets}, "a", num_layers=2)
    assert config.target_modules == expected
    assert config.scaling == 0.5


@pytest.mark.parametrize("change, reason", [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "bias"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"target_modules": ["lm_head"]}, "lm_head"),
    ({"target_modules": r".*(lm_head|q_proj)"}, "lm_head"),
    ({"target_modules": ["c_attn"]}, "c_attn"),
    ({"target_modules": r"nothing\.matches"}, "selects none"),
    ({"target_modules": []}, "target_modules"),
    ({"rank_pattern": {"q_proj": 16}}, "rank_pattern"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "IA3"),
    ({"r": None}, "rank"),
    ({"r": 0}, "positive"),
])
def test_unsupported_configs_are_refused(change, reason):
    raw = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "bias": "none", "rank_pattern": {}} | change
    with raises(424, "adapter `bad`", reason):
        LoraConfig.from_dict(raw, "bad", num_layers=2)


# --- LoRA weights -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["all", "qv", "rslora", "pickled"])
def test_lora_delta_matches_peft(adapters, base_config, name):
    root, models = adapters
    weights = load_lora(root / name, base_config)
    generator = torch.Generator().manual_seed(0)
    targets = models[name].peft_config["default"].target_modules
    for layer in range(base_config.num_layers):
        assert set(weights.layers[layer]) == set(targets)
        for projection in targets:
            a, b = weights.layers[layer][projection]
            x = torch.randn(5, full_dims(base_config, projection), generator=generator)
            expected = peft_delta(models[name], layer, projection, x)
            assert expected.abs().max() > 0.1  # a zero delta would make the comparison vacuous
            torch.testing.assert_close(x @ a @ b, expected, rtol=1e-4, atol=1e-5)


def test_tensor_parallel_shards_reproduce_the_full_delta(adapters, base_config):
    root, models = adapters
    world = 2
    shards = [load_lora(root / "all", base_config, rank=r, world_size=world) for r in range(world)]
    generator = torch.Generator().manual_seed(1)
    for layer in range(base_config.num_layers):
        for projection in PROJECTIONS:
            x = torch.randn(3, full_dims(base_config, projection), generator=generator)
            expected = peft_delta(models["all"], layer, projection, x)
            pairs = [s.layers[layer][projection] for s in shards]
            if projection in COLUMN_PARALLEL:  # whole A, this rank's output columns of B
                assert all(a.shape[0] == x.shape[1] for a, _ in pairs)
                got = torch.cat([x @ a @ b for a, b in pairs], dim=1)
            else:  # this rank's input rows of A, whole B; the layer's all-reduce sums the partials
                xs = x.chunk(world, dim=1)
                got = sum(xs[r] @ a @ b for r, (a, b) in enumerate(pairs))
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    q_cols = base_config.num_heads * base_config.head_dim // world
    kv_cols = base_config.num_kv_heads * base_config.head_dim // world
    assert shards[1].layers[0]["q_proj"][1].shape == (8, q_cols)
    assert shards[1].layers[0]["k_proj"][1].shape == (8, kv_cols)
    assert shards[1].layers[0]["down_proj"][0].shape == (base_config.intermediate_size // world, 8)


def test_dtype_and_device(adapters, base_config):
    root, _ = adapters
    weights = load_lora(root / "qv", base_config, dtype=torch.bfloat16, device="cpu")
    a, b = weights.layers[0]["q_proj"]
    assert a.dtype == b.dtype == torch.bfloat16 and a.is_contiguous() and b.is_contiguous()


def test_adapter_for_another_base_model_is_refused(adapters, model_dirs, base_config):
    root, _ = adapters
    qwen = ModelConfig.from_dir(model_dirs["qwen2"])  # same hidden size, intermediate 160 instead of 128
    with raises(424, "adapter `x`", "layers.0.mlp.down_proj.lora_A.weight", "[8, 128]", "needs [8, 160]"):
        load_lora(root / "all", qwen, adapter_id="x")
    with raises(424, "layer 1", "1 layers"):
        load_lora(root / "qv", dataclasses.replace(base_config, num_layers=1), adapter_id="x")
    with raises(424, "q_proj.lora_A.weight"):
        load_lora(root / "qv", dataclasses.replace(base_config, hidden_size=32), adapter_id="x")


def copy_adapter(adapters, tmp_path, name="qv"):
    root, _ = adapters
    return shutil.copytree(root / name, tmp_path / name)


def test_damaged_or_missing_weights(adapters, base_config, tmp_path):
    path = copy_adapter(adapters, tmp_path)
    weights_file = path / "adapter_model.safetensors"
    good = weights_file.read_bytes()
    weights_file.write_bytes(b"\x00not a safetensors file at all")
    with raises(424, "adapter `qv`", "cannot read adapter_model.safetensors"):
        load_lora(path, base_config, adapter_id="qv")
    weights_file.write_bytes(good[: len(good) // 2])
    with raises(424, "adapter_model.safetensors"):
        load_lora(path, base_config, adapter_id="qv")
    weights_file.unlink()
    with raises(424, "no weights"):
        load_lora(path, base_config, adapter_id="qv")
    (path / "adapter_config.json").write_text("{not json")
    with raises(424, "adapter_config.json"):
        load_lora(path, base_config, adapter_id="qv")


def test_incomplete_or_foreign_tensors(adapters, base_config, tmp_path):
    path = copy_adapter(adapters, tmp_path)
    tensors = load_file(path / "adapter_model.safetensors")
    dropped = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    without_b = {k: v for k, v in tensors.items() if k != dropped}
    save_file(without_b, path / "adapter_model.safetensors")
    with raises(424, "layer 1 v_proj has lora_A but no lora_B"):
        load_lora(path, base_config, adapter_id="qv")
    head = {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, base_config.hidden_size)}
    save_file(tensors | head, path / "adapter_model.safetensors")
    with raises(424, "lm_head.lora_A.weight"):
        load_lora(path, base_config, adapter_id="qv")


# --- sources ------------------------------------------------------------------------------------------------------


def test_local_adapters_resolve_inside_the_roots(adapters, tmp_path):
    root, _ = adapters
    empty_root = tmp_path / "empty"
    empty_root.mkdir()
    assert resolve_adapter("qv", "local", local_roots=[empty_root, root]) == (root / "qv").resolve()
    assert resolve_adapter(str(root / "all"), "local", local_roots=[root]) == (root / "all").resolve()
    linked = tmp_path / "linked"
    shutil.copytree(root / "qv", linked / "real")
    (linked / "nested").mkdir()
    (linked / "nested" / "alias").symlink_to(linked / "real")  # a symlink that stays inside the root is fine
    assert resolve_adapter("nested/alias", "local", local_roots=[linked]) == (linked / "real").resolve()
    assert detect_adapter_kind(root / "qv") == "lora"


def test_local_paths_leaving_the_roots_are_refused(adapters, tmp_path):
    root, _ = adapters
    outside = shutil.copytree(root / "qv", tmp_path / "outside")
    inner = tmp_path / "inner"
    shutil.copytree(root / "qv", inner / "ok")
    (inner / "escape").symlink_to(outside)
    (inner / "ok" / "adapter_model.safetensors").unlink()
    (inner / "ok" / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    for adapter_id in ("../outside", "ok/../../outside", str(outside), "/etc", "escape", "ok"):
        with raises(400, f"adapter `{adapter_id}`"):
            resolve_adapter(adapter_id, "local", local_roots=[inner])
    with raises(400, "disabled"):
        resolve_adapter("qv", "local", local_roots=[])
    with raises(400, "unknown adapter source"):
        resolve_adapter("qv", "s3", local_roots=[root])


def test_missing_or_non_adapter_directories(adapters, tmp_path):
    root, _ = adapters
    with raises(424, "adapter `nope`", "no such adapter"):
        resolve_adapter("nope", "local", local_roots=[root])
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with raises(424, "adapter `plain`", "not an adapter"):
        resolve_adapter("plain", "local", local_roots=[tmp_path])


def test_hub_offline_and_bad_ids(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", SECRET)
    for token in (None, SECRET):
        with raises(424, "adapter `org/some-adapter`", "offline") as info:
            resolve_adapter("org/some-adapter", "hub", local_roots=[], api_token=token, cache_dir=tmp_path)
        assert SECRET not in str(info.value)
    for adapter_id in ("/etc", "../x", "a/b/c", "./a", ""):
        with raises(400, "Hub repository id"):
            resolve_adapter(adapter_id, "hub", local_roots=[tmp_path], cache_dir=tmp_path)


def test_hub_unreachable(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with raises(424, "adapter `org/some-adapter`", "could not be reached") as info:
        resolve_adapter("org/some-adapter", "hub", local_roots=[], api_token=SECRET, cache_dir=tmp_path)
    assert SECRET not in str(info.value)


def test_hub_adapter_from_the_cache(adapters, monkeypatch, tmp_path):
    root, _ = adapters
    repo = tmp_path / "models--org--cached-adapter"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(root / "qv", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = resolve_adapter("org/cached-adapter", "hub", local_roots=[], cache_dir=tmp_path)
    assert path == repo / "snapshots" / commit and detect_adapter_kind(path) == "lora"


# --- Medusa -------------------------------------------------------------------------------------------------------


def medusa_tensors(config: ModelConfig, num_heads: int, num_layers: int, own_heads: bool, seed: int = 0):
    return random_medusa_tensors(config.hidden_size, config.vocab_size, num_heads, num_layers, own_heads, seed)


def write_medusa(path, tensors, *, num_heads, num_layers, fmt="safetensors", version=None):
    path.mkdir(parents=True, exist_ok=True)
    config = {"base_model_name_or_path": "tiny", "medusa_num_heads": num_heads, "medusa_num_layers": num_layers}
    if version is not None:
        config["version"] = version
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(tensors, path / "medusa_lm_head.safetensors")
    else:
        torch.save(tensors, path / "medusa_lm_head.pt")
    return path


def hand_logits(tensors, num_heads, num_layers, hidden, lm_head=None):
    rows = []
    for h in range(num_heads):
        x = hidden.double()
        for j in range(num_layers):
            w, b = tensors[f"{h}.{j}.linear.weight"].double(), tensors[f"{h}.{j}.linear.bias"].double()
            z = x @ w.T + b
            x = x + z * torch.sigmoid(z)
        rows.append(lm_head(x) if lm_head is not None else x @ tensors[f"{h}.{num_layers}.weight"].double().T)
    return torch.stack(rows).float()


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_medusa_own_heads_match_hand_computation(base_config, tmp_path, fmt):
    tensors = medusa_tensors(base_config, num_heads=3, num_layers=2, own_heads=True)
    path = write_medusa(tmp_path / "medusa", tensors, num_heads=3, num_layers=2, fmt=fmt)
    assert detect_adapter_kind(path) == "medusa"
    heads = load_medusa(path, base_config)
    assert (heads.num_heads, heads.config.num_layers, heads.config.uses_base_lm_head) == (3, 2, False)
    hidden = torch.randn(4, base_config.hidden_size)
    logits = heads(hidden)
    assert logits.shape == (3, 4, base_config.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hand_logits(tensors, 3, 2, hidden), rtol=1e-4, atol=1e-4)


def test_medusa_v2_reuses_the_base_lm_head(base_config, tmp_path):
    tensors = medusa_tensors(base_config, num_heads=4, num_layers=1, own_heads=False)
    path = write_medusa(tmp_path / "v2", tensors, num_heads=4, num_layers=1, version="2")
    heads = load_medusa(path, base_config)
    assert heads.config.uses_base_lm_head and heads.config.version == 2
    lm_weight = torch.randn(base_config.vocab_size, base_config.hidden_size).double()
    hidden = torch.randn(3, base_config.hidden_size)
    logits = heads(hidden, lambda x: (x.double() @ lm_weight.T).float())
    torch.testing.assert_close(logits, hand_logits(tensors, 4, 1, hidden, lambda x: x @ lm_weight.T),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="lm_head"):
        heads(hidden)


def test_medusa_legacy_config_head_count_trusts_the_weights(base_config, tmp_path, caplog):
    tensors = medusa_tensors(base_config, num_heads=5, num_layers=1, own_heads=True)
    path = write_medusa(tmp_path / "legacy", tensors, num_heads=2, num_layers=1)
    heads = load_medusa(path, base_config)
    assert heads.num_heads == 5 and "declares 2 Medusa heads" in caplog.text
    hidden = torch.randn(2, base_config.hidden_size)
    torch.testing.assert_close(heads(hidden), hand_logits(tensors, 5, 1, hidden), rtol=1e-4, atol=1e-4)


def test_medusa_shapes_are_checked(base_config, tmp_path):
    narrow = dataclasses.replace(base_config, hidden_size=32)
    path = write_medusa(tmp_path / "a", medusa_tensors(narrow, 2, 1, True), num_heads=2, num_layers=1)
    with raises(424, "adapter `m`", "0.0.linear.weight", "[32, 32]", "[64, 64]"):
        load_medusa(path, base_config, adapter_id="m")
    small_vocab = dataclasses.replace(base_config, vocab_size=100)
    path = write_medusa(tmp_path / "b", medusa_tensors(small_vocab, 2, 1, True), num_heads=2, num_layers=1)
    with raises(424, "0.1.weight", "[100, 64]"):
        load_medusa(path, base_config, adapter_id="m")
    gapped = {k: v for k, v in medusa_tensors(base_config, 3, 1, True).items() if not k.startswith("1.")}
    path = write_medusa(tmp_path / "c", gapped, num_heads=3, num_layers=1)
    with raises(424, "numbered [0, 2]"):
        load_medusa(path, base_config, adapter_id="m")
    (tmp_path / "c" / "medusa_lm_head.safetensors").unlink()
    with raises(424, "without weights"):
        detect_adapter_kind(tmp_path / "c", "m")


@pytest.mark.parametrize("heads_in_adapter_file", [False, True])
def test_lora_plus_medusa(adapters, base_config, tmp_path, heads_in_adapter_file):
    path = copy_adapter(adapters, tmp_path)
    tensors = medusa_tensors(base_config, num_heads=2, num_layers=1, own_heads=False)
    if heads_in_adapter_file:  # LoRAX reads the heads from any safetensors file of the adapter
        lora = load_file(path / "adapter_model.safetensors")
        save_file(lora | tensors, path / "adapter_model.safetensors")
        (path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1, "version": 2}))
    else:
        write_medusa(path, tensors, num_heads=2, num_layers=1, version=2)
    assert resolve_adapter("qv", "local", local_roots=[tmp_path]) == path.resolve()
    assert detect_adapter_kind(path) == "lora+medusa"
    assert load_lora(path, base_config).projections == {"q_proj", "v_proj"}
    heads = load_medusa(path, base_config)
    assert heads.num_heads == 2 and heads.config.uses_base_lm_head
