"""Per-request adapters through the whole stack: local LoRA and Medusa adapters loaded on first use, served
beside the base model, their failures answered per request, and the speculation metrics per drafter."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from wire import generate, metric

from specula_testing.adapters import build_lora_adapter, build_medusa_adapter

PROMPT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def adapter_server(model_dir, tmp_path_factory):
    from conftest import _start, _stop

    adapters = tmp_path_factory.mktemp("adapters")
    build_lora_adapter(model_dir, adapters / "code-lora", rank=8, std=0.2)
    build_medusa_adapter(model_dir, adapters / "heads", num_heads=3)
    _poison(build_lora_adapter(model_dir, adapters / "nan-lora", rank=8, std=0.2))
    launcher = _start(model_dir, tmp_path_factory.mktemp("adapters-run"),
                      ["--speculative-tokens", "4", "--speculation-mode", "fixed",  # drafts every step:
                       # random heads accept almost nothing, and the adaptive controller may never try them
                       "--adapter-dir", str(adapters), "--adapter-source", "local",
                       "--draft-tree-width", "2", "--max-active-adapters", "2"], "adapters")
    yield launcher
    _stop(launcher)
    launcher.close()


def test_lora_and_medusa_adapters_beside_the_base_model(base_url, adapter_server):
    url = adapter_server.url
    base = generate(base_url, PROMPT, max_new_tokens=24).json()["generated_text"]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(generate, url, PROMPT, max_new_tokens=24, adapter_id=adapter)
                   for adapter in ("", "code-lora", "heads") * 2]
        responses = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in responses), ([r.text for r in responses], adapter_server.output())
    texts = [r.json()["generated_text"] for r in responses]
    assert texts[0] == texts[3] == base
    assert texts[1] == texts[4] != base  # the LoRA changes the model
    assert texts[2] == texts[5] == base  # Medusa heads only draft: greedy text is the base model's
    assert metric(url, "specula_spec_decode_num_draft_tokens_total", method="medusa", adapter="heads") > 0
    assert metric(url, "specula_request_success_total", adapter="code-lora") == 2


def _poison(adapter_dir):
    """One NaN in a LoRA B matrix: loaded, it would turn its requests' logits (and, before the worker kept
    padding to each request's own KV slots, its neighbours') into NaN."""
    from safetensors.torch import load_file, save_file

    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if "lora_B" in n)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, path)
    return adapter_dir


def test_an_adapter_with_nan_weights_is_refused_naming_the_tensor_and_others_are_untouched(adapter_server):
    url = adapter_server.url
    base = generate(url, PROMPT, max_new_tokens=16).json()["generated_text"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate, url, PROMPT, max_new_tokens=16, adapter_id=adapter, details=True)
                   for adapter in ("", "nan-lora", "", "nan-lora")]
        responses = [f.result() for f in futures]
    for r in responses[1::2]:
        assert r.status_code == 424, (r.text, adapter_server.output())
        assert "nan-lora" in r.json()["error"] and "non-finite" in r.json()["error"]
        assert "lora_B" in r.json()["error"]  # the tensor is named
    for r in responses[0::2]:
        assert r.status_code == 200 and r.json()["generated_text"] == base, r.text
    assert "nan-lora" not in httpx.get(f"{url}/metrics", timeout=30).text  # never loaded: never a label


@pytest.mark.parametrize("adapter_id,status", [("../outside", 400), ("missing", 424)])
def test_bad_adapters_fail_their_own_requests(adapter_server, adapter_id, status):
    r = httpx.post(f"{adapter_server.url}/generate", timeout=60,
                   json={"inputs": PROMPT, "parameters": {"adapter_id": adapter_id, "max_new_tokens": 2}})
    assert r.status_code == status, (r.text, adapter_server.output())
    assert adapter_id in r.json()["error"]
    assert generate(adapter_server.url, PROMPT, max_new_tokens=2).status_code == 200
