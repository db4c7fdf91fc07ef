"""Train a SentencePiece BPE tokenizer on a Pile-format corpus.

    python -m data.train_tokenizer --input corpus_dir --model-prefix out/spm32k --vocab-size 32000

``--input`` is a .jsonl / .jsonl.zst file or a directory of them (one ``{"text": ...}`` object
a line, as written by ``data.sample_corpus``). Every line of every document is one training
sentence, read in file order until ``--max-sentences`` or ``--max-bytes`` is reached.

The model is made for exact round trips of arbitrary documents, which pretraining data needs:
no text normalization, whitespace runs and indentation kept, unseen characters spelled as
UTF-8 byte pieces (byte fallback), digits split one per piece. Ids 0, 1, 2 are ``<unk>``,
``<s>`` and ``</s>``; ``</s>`` is the end-of-document id that ``SentencePieceTokenizer``
reports as ``eod``. Newlines are never inside training sentences, so they encode as the byte
piece ``<0x0A>``.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import zstandard

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
EOD_PIECE = "</s>"
PILE_SUFFIXES = (".jsonl", ".jsonl.zst")
# SentencePiece drops longer sentences; minified lines and long paragraphs are cut to this.
MAX_SENTENCE_BYTES = 8192


def pile_files(input_path: str | Path) -> list[Path]:
    """The .jsonl / .jsonl.zst files named by ``input_path`` (a file, or a directory searched recursively)."""
    path = Path(input_path).expanduser()
    if path.is_file():
        if not path.name.endswith(PILE_SUFFIXES):
            raise ValueError(f"--input {path} is neither .jsonl nor .jsonl.zst")
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"--input not found: {path}")
    files = sorted(
        file for file in path.rglob("*") if file.is_file() and file.name.endswith(PILE_SUFFIXES)
    )
    if not files:
        raise FileNotFoundError(f"--input directory {path} holds no .jsonl or .jsonl.zst file")
    return files


def _open_text_lines(path: Path) -> Iterator[str]:
    with path.open("rb") as raw:
        if path.name.endswith(".zst"):
            # Streaming, a window at a time; read_across_frames because some writers append
            # one zstd frame per batch of lines.
            with zstandard.ZstdDecompressor().stream_reader(
                raw, read_across_frames=True
            ) as decompressed:
                yield from io.TextIOWrapper(decompressed, encoding="utf-8")
        else:
            yield from io.TextIOWrapper(raw, encoding="utf-8")


def iter_pile_texts(input_path: str | Path) -> Iterator[str]:
    """The ``text`` field of every document, file by file, line by line."""
    for path in pile_files(input_path):
        for line_number, line in enumerate(_open_text_lines(path), start=1):
            if not line.strip():
                continue
            try:
                document = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({error.msg})") from None
            if not isinstance(document, dict) or not isinstance(document.get("text"), str):
                raise ValueError(
                    f"{path}:{line_number}: expected an object with a string 'text' field"
                )
            yield document["text"]


def _cut_to_bytes(sentence: str, limit: int) -> Iterator[str]:
    encoded = sentence.encode("utf-8")
    for start in range(0, len(encoded), limit):
        # errors="ignore" drops only a multi-byte character split at a cut.
        yield encoded[start : start + limit].decode("utf-8", errors="ignore")


@dataclass
class SentenceBudget:
    """Caps on the training sample, and what was taken so far."""

    max_sentences: int
    max_bytes: int
    sentences: int = 0
    bytes: int = 0

    def exhausted(self) -> bool:
        return self.sentences >= self.max_sentences or self.bytes >= self.max_bytes


def iter_training_sentences(texts: Iterator[str], budget: SentenceBudget) -> Iterator[str]:
    """Non-blank lines of the documents, each at most MAX_SENTENCE_BYTES, until the budget is spent."""
    for text in texts:
        for line in text.split("\n"):
            if not line.strip():
                continue
            for sentence in _cut_to_bytes(line, MAX_SENTENCE_BYTES):
                if budget.exhausted():
                    return
                budget.sentences += 1
                budget.bytes += len(sentence.encode("utf-8"))
                yield sentence


def train_sentencepiece(
    input_path: str | Path,
    model_prefix: str | Path,
    vocab_size: int = 32000,
    max_sentences: int = 10_000_000,
    max_bytes: int = 1 << 30,
    num_threads: int = 2,
    verbose: bool = False,
) -> tuple[Path, SentenceBudget]:
    """Train a BPE model; returns the ``.model`` path and how much text went into it."""
    import sentencepiece

    for name, value in (
        ("vocab_size", vocab_size),
        ("max_sentences", max_sentences),
        ("max_bytes", max_bytes),
        ("num_threads", num_threads),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    prefix = Path(model_prefix).expanduser()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    budget = SentenceBudget(max_sentences=max_sentences, max_bytes=max_bytes)
    sentences = iter_training_sentences(iter_pile_texts(input_path), budget)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=sentences,
            model_prefix=str(prefix),
            model_type="bpe",
            vocab_size=vocab_size,
            num_threads=num_threads,
            character_coverage=0.9995,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            max_sentence_length=MAX_SENTENCE_BYTES,
            input_sentence_size=0,  # the budget above already bounds the sample
            shuffle_input_sentence=False,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=-1,
            eos_piece=EOD_PIECE,
            minloglevel=0 if verbose else 2,
        )
    except RuntimeError as error:
        raise ValueError(f"SentencePiece training on {input_path} failed: {error}") from None
    return prefix.with_name(prefix.name + ".model"), budget


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input", required=True, help=".jsonl/.jsonl.zst file or directory of them"
    )
    parser.add_argument(
        "--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab"
    )
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument(
        "--max-sentences", type=int, default=10_000_000, help="cap on training lines"
    )
    parser.add_argument(
        "--max-bytes", type=int, default=1 << 30, help="cap on training text in bytes"
    )
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--verbose", action="store_true", help="show SentencePiece's training log")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model_path, budget = train_sentencepiece(
        args.input,
        args.model_prefix,
        vocab_size=args.vocab_size,
        max_sentences=args.max_sentences,
        max_bytes=args.max_bytes,
        num_threads=args.num_threads,
        verbose=args.verbose,
    )
    print(
        f"trained {model_path}: vocab {args.vocab_size}, eod {EOD_PIECE}={EOS_ID}, "
        f"{budget.sentences:,} sentences, {budget.bytes / 1e6:.1f} MB, {time.perf_counter() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
