"""Text side of generation: the test tokenizers, incremental detokenization, stop checks, model-dir helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from specula_server.params import FinishReason, StoppingParams
from specula_server.tokens import IncrementalDetokenizer, StopChecker, eos_token_ids, load_tokenizer
from specula_testing import build_tokenizer
from specula_testing.tokenizer import BOS_ID, EOS_ID, KINDS, MULTILINGUAL_TEXT

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module", params=KINDS)
def tokenizer_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp(request.param)
    build_tokenizer(out_dir, kind=request.param)
    return out_dir


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return load_tokenizer(tokenizer_dir)


def detokenize(tokenizer: Tokenizer, prompt_ids: list[int], generated_ids: list[int]) -> list[str]:
    """Every piece the detokenizer returns, `finish()`'s last."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detokenizer.push(token_id) for token_id in generated_ids] + [detokenizer.finish()]
    assert "".join(pieces) == detokenizer.text
    return pieces


def split_encoding(tokenizer: Tokenizer, prompt: str, continuation: str) -> tuple[list[int], list[int]]:
    """Ids of prompt + continuation encoded together, split where the prompt's own ids end."""
    prompt_ids = tokenizer.encode(prompt).ids
    all_ids = tokenizer.encode(prompt + continuation).ids
    assert all_ids[: len(prompt_ids)] == prompt_ids, "test texts must split on a token boundary"
    return prompt_ids, all_ids[len(prompt_ids) :]


# --- the test tokenizers -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_build_tokenizer_is_deterministic_and_loads_with_transformers(kind: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    sizes = [build_tokenizer(tmp_path / name, vocab_size=400, kind=kind) for name in ("a", "b")]
    assert sizes == [400, 400]
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    tokenizer = load_tokenizer(tmp_path / "a")
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (BOS_ID, EOS_ID)
    assert len(hf_tokenizer) == tokenizer.get_vocab_size() == 400
    ids = tokenizer.encode(MULTILINGUAL_TEXT).ids
    assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
    assert hf_tokenizer(MULTILINGUAL_TEXT).input_ids == ids
    assert tokenizer.decode(ids) == MULTILINGUAL_TEXT


def test_build_tokenizer_rejects_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind"):
        build_tokenizer(tmp_path, kind="wordpiece")


def test_multibyte_characters_span_several_tokens(tokenizer: Tokenizer) -> None:
    # Without this the detokenizer tests below would not exercise held-back bytes.
    ids = tokenizer.encode("🚀 日本").ids[1:]
    assert any(REPLACEMENT in tokenizer.decode([token_id]) for token_id in ids)


# --- IncrementalDetokenizer ------------------------------------------------------------------------------


def test_pieces_reassemble_multibyte_text_and_never_hold_a_broken_character(tokenizer: Tokenizer) -> None:
    prompt_ids, generated_ids = split_encoding(tokenizer, "Translate:", " " + MULTILINGUAL_TEXT)
    pieces = detokenize(tokenizer, prompt_ids, generated_ids)
    assert "".join(pieces) == " " + MULTILINGUAL_TEXT
    assert not any(REPLACEMENT in piece for piece in pieces)
    assert "" in pieces[:-1]  # some token completed no character, so a piece was held back


def test_pieces_concatenate_to_what_the_tokens_add_to_the_decoded_prompt(tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("def main(x):").ids
    generated_ids = tokenizer.encode("\n    return x  # done 🎉 ok", add_special_tokens=False).ids
    full = tokenizer.decode(prompt_ids + generated_ids)
    prompt_text = tokenizer.decode(prompt_ids)
    assert full.startswith(prompt_text)
    assert "".join(detokenize(tokenizer, prompt_ids, generated_ids)) == full[len(prompt_text) :]


def test_bytelevel_pieces_concatenate_to_decode_and_special_tokens_add_nothing(tmp_path: Path) -> None:
    build_tokenizer(tmp_path, kind="bytelevel")
    tokenizer = load_tokenizer(tmp_path)
    generated_ids = tokenizer.encode("Ünïcödé 🚀 text", add_special_tokens=False).ids
    generated_ids = generated_ids[:3] + [BOS_ID] + generated_ids[3:] + [EOS_ID]
    detokenizer = IncrementalDetokenizer(tokenizer, [BOS_ID])
    pieces = [detokenizer.push(token_id) for token_id in generated_ids]
    assert pieces[3] == "" and pieces[-1] == ""
    assert detokenizer.is_special(EOS_ID) and not detokenizer.is_special(generated_ids[0])
    assert detokenizer.text == tokenizer.decode(generated_ids, skip_special_tokens=True) == "Ünïcödé 🚀 text"
    with_specials = tokenizer.decode(generated_ids, skip_special_tokens=False)  # what we chose not to emit
    assert with_specials.count("<s>") == 1 and with_specials.endswith("🚀 text</s>")


def test_metaspace_keeps_the_leading_space_a_lone_decode_would_strip(tmp_path: Path) -> None:
    build_tokenizer(tmp_path, kind="metaspace")
    tokenizer = load_tokenizer(tmp_path)
    prompt_ids, generated_ids = split_encoding(tokenizer, "Hello", " world")
    assert tokenizer.decode(generated_ids) == "world"  # why the window of prompt tokens is needed
    assert "".join(detokenize(tokenizer, prompt_ids, generated_ids)) == " world"
    # With no prompt text (BOS only), the first generated space is stripped, as decode(generated) does.
    assert "".join(detokenize(tokenizer, [BOS_ID], generated_ids)) == "world"


def test_finish_flushes_bytes_of_an_unfinished_character(tokenizer: Tokenizer) -> None:
    prompt_ids, generated_ids = split_encoding(tokenizer, "Launch", " 🚀")
    cut = generated_ids[:-1]  # stop before the emoji's last byte
    pieces = detokenize(tokenizer, prompt_ids, cut)
    assert REPLACEMENT not in "".join(pieces[:-1])
    assert pieces[-1].endswith(REPLACEMENT)  # finish() reports the broken tail as decode would
    full = tokenizer.decode(prompt_ids + cut)
    assert "".join(pieces) == full[len(tokenizer.decode(prompt_ids)) :]
    assert detokenize(tokenizer, prompt_ids, generated_ids)[-1] == ""  # nothing pending after a whole one


def test_prompt_window_starting_inside_a_character_does_not_corrupt_output(tokenizer: Tokenizer) -> None:
    # The five-token window of "x日日日" starts inside a character; with byte fallback a naive window
    # turns the whole byte run, including the generated bytes of "本", into U+FFFD.
    prompt_ids, generated_ids = split_encoding(tokenizer, "x日日日", "本!")
    assert REPLACEMENT in tokenizer.decode(prompt_ids[-IncrementalDetokenizer.PREFIX_TOKENS :])
    pieces = detokenize(tokenizer, prompt_ids, generated_ids)
    assert "".join(pieces) == "本!"
    assert not any(REPLACEMENT in piece for piece in pieces)


# --- StopChecker --------------------------------------------------------------------------------------------


def run_checker(checker: StopChecker, pieces: list[str], token_ids: list[int] | None = None) -> list:
    text = ""
    reasons = []
    for i, piece in enumerate(pieces):
        text += piece
        reasons.append(checker.check(token_ids[i] if token_ids else 10 + i, text))
    return reasons


def test_eos_stops_unless_ignored() -> None:
    eos = frozenset({EOS_ID, 7})
    checker = StopChecker(StoppingParams(max_new_tokens=10), eos)
    assert run_checker(checker, ["a", "b", ""], [5, 6, 7]) == [None, None, FinishReason.EOS_TOKEN]
    ignoring = StopChecker(StoppingParams(max_new_tokens=3, ignore_eos_token=True), eos)
    assert run_checker(ignoring, ["", "", ""], [EOS_ID, 7, EOS_ID]) == [None, None, FinishReason.LENGTH]


def test_max_new_tokens_counts_every_token() -> None:
    checker = StopChecker(StoppingParams(max_new_tokens=3), frozenset({EOS_ID}))
    assert run_checker(checker, ["a", "", "c"]) == [None, None, FinishReason.LENGTH]
    assert checker.num_generated == 3


def test_eos_on_the_last_allowed_token_reports_eos() -> None:
    checker = StopChecker(StoppingParams(max_new_tokens=2), frozenset({EOS_ID}))
    assert run_checker(checker, ["a", ""], [5, EOS_ID]) == [None, FinishReason.EOS_TOKEN]


def test_stop_sequence_spanning_tokens() -> None:
    checker = StopChecker(StoppingParams(max_new_tokens=50, stop_sequences=("never", "</answer>")), frozenset())
    pieces = ["The answer is 42", " <", "/ans", "wer", ">", "more"]
    assert run_checker(checker, pieces) == [None] * 4 + [FinishReason.STOP_SEQUENCE, None]


def test_stop_sequence_inside_one_piece_and_after_long_text() -> None:
    checker = StopChecker(StoppingParams(max_new_tokens=500, stop_sequences=("\n\n",)), frozenset())
    pieces = ["word "] * 100 + ["\n", "\nnext"]
    reasons = run_checker(checker, pieces)
    assert reasons[-1] == FinishReason.STOP_SEQUENCE and reasons[:-1] == [None] * 101
    single = StopChecker(StoppingParams(max_new_tokens=5, stop_sequences=("STOP",)), frozenset())
    assert run_checker(single, ["xxSTOPyy"]) == [FinishReason.STOP_SEQUENCE]
    assert single.stop_end == len("xxSTOP")


def test_stop_end_is_where_the_text_ends() -> None:
    inside = StopChecker(StoppingParams(max_new_tokens=50, stop_sequences=("terv",)), frozenset())
    assert run_checker(inside, ["I", "ter", "viron"]) == [None, None, FinishReason.STOP_SEQUENCE]
    assert inside.stop_end == len("Iterv")  # inside the last piece, not at its end
    spanning = StopChecker(StoppingParams(max_new_tokens=50, stop_sequences=("never", "</answer>")), frozenset())
    run_checker(spanning, ["The answer is 42", " <", "/ans", "wer", ">", "more"])
    assert spanning.stop_end == len("The answer is 42 </answer>")


def test_the_match_that_ends_first_sets_the_end() -> None:
    # "abcd" starts first but "bc" ends first: the text was complete, and stoppable, at "abc".
    checker = StopChecker(StoppingParams(max_new_tokens=5, stop_sequences=("abcd", "bc")), frozenset())
    assert run_checker(checker, ["xabcdy"]) == [FinishReason.STOP_SEQUENCE]
    assert checker.stop_end == len("xabc")


def test_no_stop_end_unless_a_stop_sequence_ended_the_text() -> None:
    checker = StopChecker(StoppingParams(max_new_tokens=2, stop_sequences=("zz",)), frozenset({EOS_ID}))
    assert run_checker(checker, ["z", "z"], [5, EOS_ID]) == [None, FinishReason.EOS_TOKEN]
    assert checker.stop_end is None
    length = StopChecker(StoppingParams(max_new_tokens=2, stop_sequences=("zz",)), frozenset())
    assert run_checker(length, ["a", "b"]) == [None, FinishReason.LENGTH] and length.stop_end is None


def test_detokenizer_and_stop_checker_end_a_generation_on_a_multibyte_stop(tokenizer: Tokenizer) -> None:
    prompt_ids, generated_ids = split_encoding(tokenizer, "Q:", " 東京で会いましょう。 more text")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    checker = StopChecker(StoppingParams(max_new_tokens=100, stop_sequences=("しょう",)), frozenset({EOS_ID}))
    for token_id in generated_ids:
        detokenizer.push(token_id)
        reason = checker.check(token_id, detokenizer.text)
        if reason is not None:
            break
    assert reason == FinishReason.STOP_SEQUENCE
    assert detokenizer.text.endswith("しょう") and detokenizer.text.startswith(" 東京で会いま")
    assert detokenizer.text[: checker.stop_end] == " 東京で会いましょう"


# --- model directory helpers ----------------------------------------------------------------------------


def test_eos_token_ids_unions_config_and_generation_config(tmp_path: Path) -> None:
    assert eos_token_ids(tmp_path, {"eos_token_id": 2}) == {2}
    assert eos_token_ids(tmp_path, {}) == frozenset()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert eos_token_ids(tmp_path, {"eos_token_id": 128001}) == {128001, 128009}
    assert eos_token_ids(tmp_path, {"eos_token_id": [5, 6]}) == {5, 6, 128001, 128009}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9, "temperature": 0.6}))
    assert eos_token_ids(tmp_path, {"eos_token_id": None}) == {9}


def test_load_tokenizer_needs_tokenizer_json_and_never_truncates(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    build_tokenizer(tmp_path)
    saved = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    saved.enable_truncation(max_length=4)
    saved.save(str(tmp_path / "tokenizer.json"))
    assert len(load_tokenizer(tmp_path).encode("a fairly long sentence to encode").ids) > 4
