"""GGUF checkpoints: tensors, config, tokenizer and served output against transformers reading the same file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from test_model_parity import PROMPTS, reference_greedy
from test_tensor_parallel import run_two_ranks
from tokenizers import Tokenizer

from specula_server import hub
from specula_server.gguf_checkpoint import GGUFCheckpoint, GGUFError, GGUFTensors
from specula_server.gguf_metadata import model_directory
from specula_server.models.config import ModelConfig
from specula_testing.gguf_files import BLOCK_TYPES, K_TYPES, write_gguf
from specula_testing.models import build_tiny_model
from specula_testing.tokenizer import MULTILINGUAL_TEXT, training_corpus
from specula_testing.worker import BlockPool, generate_alone, load_test_generator, make_spec, token_ids


def transformers_state_dict(gguf_file: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                              dtype=torch.float32)
    return model.state_dict()


@pytest.mark.parametrize("kind", BLOCK_TYPES + K_TYPES)
def test_every_tensor_reads_as_transformers_reads_it(gguf_files, kind):
    ours = GGUFTensors(gguf_files[kind])
    reference = transformers_state_dict(gguf_files[kind])
    names = list(ours.keys())
    assert set(reference) - set(names) <= {"lm_head.weight"}  # a tied head is the embedding
    assert set(names) <= set(reference)
    for name in names:
        assert torch.equal(ours.get_tensor(name), reference[name]), name


def test_an_f32_file_gives_back_the_original_weights_with_q_and_k_rows_in_place(gguf_files, llama_dir):
    """llama.cpp's converter permutes q/k rows; reading undoes it exactly (float32 keeps every bit)."""
    original = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).state_dict()
    ours = GGUFTensors(gguf_files["F32"])
    for name in ours.keys():
        assert torch.equal(ours.get_tensor(name), original[name]), name


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K", "F16"])
def test_a_slice_is_the_same_part_of_the_whole_tensor(gguf_files, kind):
    """Tensor-parallel reads: whole heads of q/k, rows, and columns on and off block boundaries."""
    ours = GGUFTensors(gguf_files[kind])
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"):
        whole = ours.get_tensor(name)
        rows, columns = whole.shape
        part = ours.get_slice(name)
        assert part.get_shape() == [rows, columns]
        head = 16 if kind != "Q6_K" else 64
        for index in [(slice(0, rows // 2),), (slice(rows // 2, rows),), (slice(head, 2 * head),), (slice(3, 7),),
                      (slice(None), slice(0, columns // 2)), (slice(None), slice(columns // 2, columns)),
                      (slice(None), slice(5, 40))]:
            assert torch.equal(part[index], whole[index]), (name, index)


def test_the_config_is_the_models_own(gguf_files, llama_dir, tmp_path):
    directory = model_directory(gguf_files["Q8_0"], tmp_path)
    served, original = ModelConfig.from_dir(directory), ModelConfig.from_dir(llama_dir)
    assert served == original
    assert hub.weight_files(directory) == [gguf_files["Q8_0"]]


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_1", "Q4_K"])
def test_served_greedy_tokens_and_logprobs_match_transformers_on_the_same_file(gguf_files, kind):
    file = gguf_files[kind]
    reference = transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                                  dtype=torch.float32).eval()
    generator = load_test_generator(file)
    for i, prompt in enumerate(PROMPTS):
        outputs = generate_alone(generator, make_spec(i, prompt, BlockPool(256, 16), max_new_tokens=16))
        expected_tokens, expected_logprobs = reference_greedy(reference, prompt, 16)
        assert token_ids(outputs) == expected_tokens
        assert [t.logprob for o in outputs for t in o.tokens] == pytest.approx(expected_logprobs, abs=1e-4)


def test_two_ranks_serve_a_quantized_file_as_one_does(gguf_files):
    expected = [token_ids(generate_alone(load_test_generator(gguf_files["Q4_1"]),
                                         make_spec(0, PROMPTS[0], BlockPool(256, 16), max_new_tokens=24)))]
    results = run_two_ranks(gguf_files["Q4_1"], {})
    assert results[0][0] == expected[0] and results[1][0] == expected[0]


def test_the_tokenizer_encodes_and_decodes_as_the_original_and_as_transformers(gguf_files, llama_dir, tmp_path):
    directory = model_directory(gguf_files["Q8_0"], tmp_path)
    ours = Tokenizer.from_file(str(directory / "tokenizer.json"))
    original = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    reference = transformers.AutoTokenizer.from_pretrained(gguf_files["Q8_0"].parent,
                                                           gguf_file=gguf_files["Q8_0"].name)
    texts = [MULTILINGUAL_TEXT, "  two  spaces\t\ttab\r\n 2024 numbers 12345", "<s>special</s> text"]
    texts += [text[:3000] for text in training_corpus()]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == original.encode(text).ids
        assert ids == reference(text)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=False) == original.decode(ids, skip_special_tokens=False)


def test_special_tokens_chat_template_and_end_ids_come_from_the_metadata(tmp_path, llama_dir):
    file = write_gguf(llama_dir, tmp_path / "chat.gguf", "Q8_0")
    directory = model_directory(file, tmp_path / "cache")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<s>", "</s>", True)
    assert json.loads((directory / "generation_config.json").read_text())["eos_token_id"] == [2]
    assert Tokenizer.from_file(str(directory / "tokenizer.json")).encode("x").ids[0] == 1  # BOS added


def test_the_model_directory_is_written_once_and_again_when_the_file_changes(gguf_files, tmp_path, monkeypatch):
    file = tmp_path / "model.gguf"
    file.write_bytes(gguf_files["Q8_0"].read_bytes())
    first = model_directory(file, tmp_path / "cache")

    def refuse(path):
        raise AssertionError("a cached directory must not reopen the file")

    monkeypatch.setattr(GGUFCheckpoint, "open", refuse)
    assert model_directory(file, tmp_path / "cache") == first
    monkeypatch.undo()
    os.utime(file, ns=(1, 1))
    second = model_directory(file, tmp_path / "cache")
    assert second != first and (second / "tokenizer.json").is_file()


def test_a_hub_file_is_downloaded_and_served_from_its_metadata(gguf_files, monkeypatch):
    calls = []

    def fake_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs["revision"]))
        return str(gguf_files["Q4_0"])

    monkeypatch.setattr(hub, "hf_hub_download", fake_download)
    directory = hub.resolve_model_dir("org/model-GGUF:model-Q4_0.gguf", revision="v1")
    assert calls == [("org/model-GGUF", "model-Q4_0.gguf", "v1")]
    assert hub.weight_files(directory) == [gguf_files["Q4_0"]]


def test_a_file_we_cannot_serve_is_refused_naming_the_file_and_the_reason(tmp_path, llama_dir, gguf_files):
    other = write_gguf(llama_dir, tmp_path / "gpt2.gguf", "F32", architecture="gpt2")
    with pytest.raises(GGUFError, match=r"gpt2\.gguf: architecture 'gpt2' is not supported \(supported: llama\)"):
        GGUFCheckpoint.open(other)

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_files["Q4_1"].read_bytes()[:-1000])
    with pytest.raises(GGUFError, match=r"truncated\.gguf: (truncated|not a readable GGUF file)"):
        GGUFCheckpoint.open(truncated)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(gguf_files["Q4_1"].read_bytes()[:100])
    with pytest.raises(GGUFError, match=r"header\.gguf: not a readable GGUF file"):
        GGUFCheckpoint.open(header_only)

    unread = write_gguf(llama_dir, tmp_path / "iq.gguf", "Q8_0")
    _retype_first_matrix(unread, "IQ4_NL")
    with pytest.raises(GGUFError, match=r"iq\.gguf: tensor \S+ is of type IQ4_NL, which Specula does not read"):
        GGUFCheckpoint.open(unread)


def test_a_file_without_a_pre_tokenizer_name_splits_as_gpt2(tmp_path, llama_dir):
    """Older files have no `tokenizer.ggml.pre`; llama.cpp then splits as GPT-2 does."""
    file = write_gguf(llama_dir, tmp_path / "old.gguf", "F32", drop=("tokenizer.ggml.pre",))
    assert GGUFCheckpoint.open(file).metadata.get("tokenizer.ggml.pre") is None
    ours = Tokenizer.from_file(str(model_directory(file, tmp_path / "cache") / "tokenizer.json"))
    original = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    assert ours.encode(MULTILINGUAL_TEXT).ids == original.encode(MULTILINGUAL_TEXT).ids


def test_an_unknown_pre_tokenizer_is_refused_by_name(tmp_path, llama_dir):
    file = write_gguf(llama_dir, tmp_path / "odd.gguf", "F32", pre_tokenizer="made-up")
    with pytest.raises(GGUFError, match=r"odd\.gguf: pre-tokenizer 'made-up' \(tokenizer.ggml.pre\) is not supported"):
        model_directory(file, tmp_path / "cache")


def test_the_launcher_refuses_a_bad_file_before_any_shard_starts(tmp_path, llama_dir):
    from specula_launcher.defaults import build_config

    other = write_gguf(llama_dir, tmp_path / "gpt2.gguf", "F32", architecture="gpt2")
    with pytest.raises(ValueError, match=r"--model-id: GGUF file \S+gpt2\.gguf: architecture 'gpt2'"):
        build_config(model_id=str(other), device="cpu")
    with pytest.raises(ValueError, match=r"--model-id /no/such/model\.gguf: no such file"):
        build_config(model_id="/no/such/model.gguf", device="cpu")


def test_the_launcher_takes_the_position_limit_from_the_file(gguf_files):
    from specula_launcher.defaults import build_config

    config = build_config(model_id=str(gguf_files["Q8_0"]), device="cpu")
    assert config.max_total_tokens == 512  # the tiny model's max_position_embeddings


def _retype_first_matrix(path: Path, type_name: str) -> None:
    """Rewrites the type of the file's first 2-D tensor in its header (same block size, so the file stays whole)."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if len(t.shape) == 2)
    type_field = tensor.field.parts[-2]  # the tensor info's type, before its offset
    data = bytearray(path.read_bytes())
    offset = reader.data.ctypes.data
    start = type_field.ctypes.data - offset
    data[start:start + 4] = int(gguf.GGMLQuantizationType[type_name]).to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_a_sentencepiece_vocabulary_encodes_as_transformers_and_keeps_sentencepieces_prefix(tmp_path):
    """Llama 2's kind of tokenizer (`tokenizer.ggml.model = llama`): scores, byte tokens, no merges in the file.

    Text that starts with a space is where the references part: SentencePiece and llama.cpp always add the dummy
    prefix (" x" -> "▁▁x"), as Llama 2's own tokenizer.json does with its Prepend normalizer; transformers' GGUF
    tokenizer does not add one before a space. Specula follows SentencePiece."""
    model_dir = build_tiny_model(tmp_path / "spm", "llama", tokenizer_kind="metaspace")
    file = write_gguf(model_dir, tmp_path / "spm.gguf", "Q8_0")
    ours = Tokenizer.from_file(str(model_directory(file, tmp_path / "cache") / "tokenizer.json"))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    for text in [MULTILINGUAL_TEXT, "Hello world", "tabs\t\tand\r\nnewlines 2024"] + [
            text[:3000] for text in training_corpus()]:
        ids = ours.encode(text).ids
        assert ids == reference(text)["input_ids"]
        assert ours.decode(ids) == text
    spaced, plain = ours.encode(" leading").ids, ours.encode("leading").ids
    assert spaced == [1, ours.token_to_id("▁")] + plain[1:]
    assert ours.decode(spaced) == " leading"


@pytest.mark.parametrize("factor,served", [(8.0, True), (4.0, False)])
def test_llama3_rotary_factors_are_read_back_as_their_scaling_or_refused(tmp_path, factor, served):
    """llama.cpp keeps Llama 3.1's scaling only as per-frequency divisors; the published settings that give them
    are served (checked against transformers on the original directory), others refused."""
    scaling = dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    model_dir = build_tiny_model(tmp_path / "llama31", "llama31", rope_scaling=scaling, max_position_embeddings=16384)
    file = write_gguf(model_dir, tmp_path / "llama31.gguf", "F32")
    if not served:
        with pytest.raises(GGUFError, match=r"llama31\.gguf: its rotary frequency factors \(rope_freqs.weight\) "
                                            r"match no Llama 3 scaling"):
            model_directory(file, tmp_path / "cache")
        return
    assert ModelConfig.from_dir(model_directory(file, tmp_path / "cache")) == ModelConfig.from_dir(model_dir)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = load_test_generator(file)
    prompt = [1] + list(range(100, 160))
    outputs = generate_alone(generator, make_spec(0, prompt, BlockPool(256, 16), max_new_tokens=8))
    assert token_ids(outputs) == reference_greedy(reference, prompt, 8)[0]
