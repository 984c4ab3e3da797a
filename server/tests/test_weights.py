"""Tests for `specula_server.weights.Weights`: routing, tensor-parallel slicing, dtype handling, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from specula_server import weights as weights_module
from specula_server.hub import weight_files
from specula_server.weights import WeightNotFoundError, Weights

CPU = torch.device("cpu")


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "layer.q.weight": torch.randn(8, 6, generator=generator),  # [q_out, hidden]
        "layer.k.weight": torch.randn(4, 6, generator=generator),  # [kv_out, hidden]
        "layer.v.weight": torch.randn(4, 6, generator=generator),  # [kv_out, hidden]
        "layer.o.weight": torch.randn(6, 8, generator=generator),  # [hidden, q_out]
        "layer.norm.weight": torch.randn(6, generator=generator),  # [hidden]
        "layer.odd.weight": torch.randn(5, 6, generator=generator),  # 5 rows: not divisible by 2
        "layer.qweight": torch.randint(-128, 127, (8, 6), dtype=torch.int8, generator=generator),
        "adapter.lora_A.weight": torch.randn(2, 6, generator=generator),  # [rank, hidden]
    }


@pytest.fixture
def single_file(tmp_path: Path) -> list[Path]:
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), str(path))
    return weight_files(tmp_path)


@pytest.fixture
def two_shards(tmp_path: Path) -> list[Path]:
    tensors = _tensors()
    names = sorted(tensors)
    split = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    weight_map = {}
    for shard, shard_names in split.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / shard))
        weight_map.update({n: shard for n in shard_names})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_files(tmp_path)


@pytest.fixture(params=["single_file", "two_shards"])
def files(request: pytest.FixtureRequest) -> list[Path]:
    return request.getfixturevalue(request.param)


def test_get_tensor_and_names_round_trip(files: list[Path]) -> None:
    expected = _tensors()
    weights = Weights(files, CPU, torch.float32)
    assert weights.names() == sorted(expected)
    for name, tensor in expected.items():
        assert weights.has(name)
        assert torch.equal(weights.get_tensor(name), tensor)
    assert not weights.has("layer.missing")


def test_two_shards_are_routed_to_their_files(two_shards: list[Path]) -> None:
    assert [p.name for p in two_shards] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weights = Weights(two_shards, CPU, torch.float32)
    # One name from each shard (names are split alphabetically across the two files).
    assert torch.equal(weights.get_tensor("adapter.lora_A.weight"), _tensors()["adapter.lora_A.weight"])
    assert torch.equal(weights.get_tensor("layer.v.weight"), _tensors()["layer.v.weight"])


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_rank_shards_concatenate_to_full_tensor(files: list[Path], dim: int) -> None:
    full = _tensors()["layer.q.weight"]  # [8, 6]
    ranks = [Weights(files, CPU, torch.float32, rank=r, world_size=2) for r in (0, 1)]
    shards = [weights.get_sharded("layer.q.weight", dim) for weights in ranks]
    expected_shape = list(full.shape)
    expected_shape[dim] //= 2
    assert all(list(s.shape) == expected_shape for s in shards)
    assert not torch.equal(shards[0], shards[1])
    assert torch.equal(torch.cat(shards, dim=dim), full)


def test_world_size_one_shard_is_whole_tensor(single_file: list[Path]) -> None:
    weights = Weights(single_file, CPU, torch.float32)
    assert torch.equal(weights.get_sharded("layer.o.weight", 1), _tensors()["layer.o.weight"])


def test_packed_sharded_is_per_tensor_shards_concatenated(files: list[Path]) -> None:
    tensors = _tensors()
    qkv = ["layer.q.weight", "layer.k.weight", "layer.v.weight"]
    for rank in (0, 1):
        weights = Weights(files, CPU, torch.float32, rank=rank, world_size=2)
        packed = weights.get_packed_sharded(qkv, dim=0)  # [(8 + 4 + 4) / 2, hidden]
        q, k, v = (tensors[n] for n in qkv)
        expected = torch.cat([q[rank * 4 : rank * 4 + 4], k[rank * 2 : rank * 2 + 2], v[rank * 2 : rank * 2 + 2]])
        assert packed.shape == (8, 6)
        assert torch.equal(packed, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_floating_tensors_converted_integer_tensors_kept(single_file: list[Path], dtype: torch.dtype) -> None:
    tensors = _tensors()
    weights = Weights(single_file, CPU, dtype, rank=1, world_size=2)
    norm = weights.get_tensor("layer.norm.weight")
    assert norm.dtype == dtype
    assert torch.equal(norm, tensors["layer.norm.weight"].to(dtype))
    assert weights.get_sharded("layer.o.weight", 1).dtype == dtype
    assert weights.get_tensor("layer.norm.weight", to_dtype=False).dtype == torch.float32
    qweight = weights.get_sharded("layer.qweight", 0)
    assert qweight.dtype == torch.int8
    assert torch.equal(qweight, tensors["layer.qweight"][4:])


def test_missing_name_error_names_tensor_and_files(files: list[Path]) -> None:
    weights = Weights(files, CPU, torch.float32, prefix="model.")
    with pytest.raises(KeyError) as info:
        weights.get_sharded("layer.nope", 0)
    assert isinstance(info.value, WeightNotFoundError)
    message = str(info.value)
    assert "'model.layer.nope'" in message
    assert all(str(f) in message for f in files)


def test_non_divisible_shard_error_names_tensor(single_file: list[Path]) -> None:
    weights = Weights(single_file, CPU, torch.float32, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"layer\.odd\.weight.*\[5, 6\].*not divisible by world_size 2"):
        weights.get_sharded("layer.odd.weight", 0)
    with pytest.raises(ValueError, match="layer.odd.weight"):
        weights.get_packed_sharded(["layer.q.weight", "layer.odd.weight"], 0)
    assert weights.get_sharded("layer.odd.weight", 1).shape == (5, 3)  # the other dim divides


def test_prefix_is_prepended(files: list[Path]) -> None:
    weights = Weights(files, CPU, torch.float32, prefix="adapter.")
    assert weights.names() == ["lora_A.weight"]
    assert weights.has("lora_A.weight") and not weights.has("adapter.lora_A.weight")
    assert torch.equal(weights.get_tensor("lora_A.weight"), _tensors()["adapter.lora_A.weight"])


def test_invalid_rank_rejected(single_file: list[Path]) -> None:
    with pytest.raises(ValueError, match="rank 2"):
        Weights(single_file, CPU, torch.float32, rank=2, world_size=2)


def test_duplicate_tensor_across_files_rejected(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"x": torch.zeros(2)}, str(a))
    save_file({"x": torch.ones(2)}, str(b))
    with pytest.raises(ValueError, match="'x' is in both"):
        Weights([a, b], CPU, torch.float32)


class _SpyHandle:
    """Wraps a real safe_open handle and records which read methods are called."""

    def __init__(self, handle: Any, calls: list[str]) -> None:
        self._handle = handle
        self._calls = calls

    def __getattr__(self, attr: str) -> Any:
        self._calls.append(attr)
        return getattr(self._handle, attr)


@pytest.mark.parametrize("dim", [0, 1])
def test_sharded_read_goes_through_get_slice(
    single_file: list[Path], monkeypatch: pytest.MonkeyPatch, dim: int
) -> None:
    calls: list[str] = []
    real_safe_open = weights_module.safe_open
    monkeypatch.setattr(weights_module, "safe_open", lambda *a, **k: _SpyHandle(real_safe_open(*a, **k), calls))
    weights = Weights(single_file, CPU, torch.float32, rank=1, world_size=2)
    calls.clear()

    shard = weights.get_sharded("layer.q.weight", dim)  # [4, 6] or [8, 3] out of [8, 6]
    assert calls == ["get_slice"]
    assert torch.equal(shard, _tensors()["layer.q.weight"].chunk(2, dim=dim)[1])
    # Only the slice is materialised: the result is contiguous and owns a storage of exactly its own size,
    # not a view into the full [8, 6] tensor (or into the file's mmap).
    assert shard.is_contiguous()
    assert shard.untyped_storage().nbytes() == shard.numel() * shard.element_size()


def test_returned_tensors_do_not_alias_each_other(single_file: list[Path]) -> None:
    # Tied embeddings read one tensor twice; an in-place edit of the first read must not show in the second.
    weights = Weights(single_file, CPU, torch.float32)
    first = weights.get_tensor("layer.norm.weight")
    first.add_(100.0)
    assert torch.equal(weights.get_tensor("layer.norm.weight"), _tensors()["layer.norm.weight"])
    shard = weights.get_sharded("layer.o.weight", 0)
    shard.zero_()
    assert torch.equal(weights.get_sharded("layer.o.weight", 0), _tensors()["layer.o.weight"])
