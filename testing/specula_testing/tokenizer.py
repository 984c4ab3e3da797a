"""Small real tokenizers for tests, trained offline in about a second.

Tests and benchmarks need a tokenizer with the same moving parts as the real ones (byte-level BPE like
GPT-2/Llama-3, or Metaspace + byte-fallback BPE like Llama-2) without a model hub download. This module
trains one with the `tokenizers` library on Python standard-library sources plus a few embedded non-ASCII
sentences, so accented letters, CJK and emoji are split over several byte tokens, which is exactly what the
incremental detokenizer (`specula_server.tokens`) must get right.

The output directory loads with both `tokenizers.Tokenizer.from_file(out_dir / "tokenizer.json")` and
`transformers.AutoTokenizer.from_pretrained(out_dir)`. Special tokens follow Llama-2's layout:

    <unk> = 0, <s> = 1 (BOS, added in front of every encoding), </s> = 2 (EOS)
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
KINDS = ("bytelevel", "metaspace")

# Fixed files and a fixed budget keep training fast (< 1 s) and the result identical from run to run on one
# Python installation. Missing files are skipped: the embedded text alone still trains a usable tokenizer.
_STDLIB_FILES = ("textwrap.py", "string.py", "dataclasses.py", "json/decoder.py", "json/encoder.py", "csv.py")
_MAX_CHARS_PER_FILE = 40_000

# Each sentence appears once, so byte-pair merges rarely reach these characters: they stay several tokens long.
MULTILINGUAL_TEXT = (
    "Café crème, naïve façade, São Paulo, Zürich, smørrebrød, Dvořák, Łódź.\n"
    "Ελληνικά: καλημέρα κόσμε. Русский: привет, мир!\n"
    "日本語のテキスト、東京で会いましょう。中文：你好，世界！한국어: 안녕하세요.\n"
    "Emoji: 🚀 launch, 🎉 party, 👩‍💻 coder, 🇫🇷 flag, ❤️ heart.\n"
    "Math: ∀x ∈ ℝ, x² ≥ 0; ∑ 1/n² = π²/6 ≈ 1.645.\n"
)


def training_corpus() -> list[str]:
    """The texts the tokenizers are trained on, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in _STDLIB_FILES:
        path = stdlib / name
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8")[:_MAX_CHARS_PER_FILE])
    texts.append(MULTILINGUAL_TEXT)
    return texts


def build_tokenizer(
    out_dir: Path, vocab_size: int = 512, kind: str = "bytelevel", corpus: Sequence[str] | None = None
) -> int:
    """Train a `kind` tokenizer with about `vocab_size` entries, write it to `out_dir`, return its vocab size.

    `corpus` replaces the default training texts (`training_corpus()`).

    The returned size counts every id the tokenizer can produce (special tokens included), so a model config
    can use it as `vocab_size` directly. It may be slightly below the request if the corpus runs out of merges.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    texts = list(corpus) if corpus is not None else training_corpus()
    if kind == "bytelevel":
        tokenizer = _train_bytelevel(vocab_size, texts)
    else:
        tokenizer = _train_metaspace(vocab_size, texts)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    _write(tokenizer, Path(out_dir))
    return tokenizer.get_vocab_size(with_added_tokens=True)


def _train_bytelevel(vocab_size: int, texts: list[str]) -> Tokenizer:
    """GPT-2 / Llama-3 style: text is mapped to bytes first, so every string is representable."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _train_metaspace(vocab_size: int, texts: list[str]) -> Tokenizer:
    """Llama-2 style: spaces become "▁", characters outside the vocab fall back to `<0xNN>` byte tokens.

    The trainer cannot place byte tokens the way SentencePiece does (right after the special tokens, as
    ordinary vocab entries rather than added tokens), so we train the merges first and then lay out the
    vocab ourselves: specials 0-2, `<0x00>`..`<0xFF>` at 3-258, learned pieces after.
    """
    num_bytes = 256
    # A small alphabet keeps rare characters (accents, CJK, emoji) out of the vocab: they use byte fallback.
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size - num_bytes, len(SPECIAL_TOKENS) + 1),
        special_tokens=list(SPECIAL_TOKENS),
        limit_alphabet=80,
        show_progress=False,
    )
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    draft = Tokenizer(models.BPE(unk_token="<unk>"))
    draft.pre_tokenizer = metaspace
    draft.train_from_iterator(texts, trainer=trainer)
    trained = json.loads(draft.to_str())["model"]

    learned = sorted(trained["vocab"].items(), key=lambda item: item[1])
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"<0x{b:02X}>": len(SPECIAL_TOKENS) + b for b in range(num_bytes)})
    for token, _ in learned:
        if token not in vocab:
            vocab[token] = len(vocab)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = metaspace
    # The decoder Llama-2's converted tokenizer.json carries: the leading space of the decoded string is
    # stripped, which is why detokenizing one token at a time needs a window of preceding tokens.
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def _write(tokenizer: Tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special_map = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
