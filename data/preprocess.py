"""Tokenize a text corpus into Megatron indexed datasets: ``python -m data.preprocess``.

Same flags and output names as Megatron-LM's ``tools/preprocess_data.py``::

    python -m data.preprocess --input pile/train/ --output-prefix data/pile \\
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 8

writes ``data/pile_text_document.bin/.idx`` (one pair per ``--json-keys`` entry). Inputs are
jsonl / jsonl.zst files, directories of shards, or ``hf:NAME[:SPLIT]`` (see data.readers).
Every document becomes one sequence (its tokens, then ``eod`` with ``--append-eod``), so the
dataset has exactly one sequence per input document, in input order.

Parallelism: the main process reads and parses lines, packs documents into chunks of about
1 MB of text, and hands them to a ``multiprocessing.Pool`` whose initializer builds the
tokenizer once per worker. Results are written strictly in submission order, so the output
is byte-identical for any ``--workers``. Output goes through ``IndexedDatasetBuilder``: an
error or Ctrl-C leaves no ``.bin``/``.idx`` under the final names.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import multiprocessing.pool
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from data.indexed_dataset import IndexedDatasetBuilder, as_token_array, best_token_dtype
from data.readers import BadInputError, Document, ReadStats, iter_documents
from data.tokenizers import Tokenizer, build_tokenizer

DEFAULT_TOKENIZER_TYPE = "GPT2BPETokenizer"
DEFAULT_LOG_INTERVAL = 10_000
# A chunk is the unit of work sent to a worker: large enough that pickling and queueing cost
# little next to tokenizing it, small enough that a few per worker keep all of them busy.
CHUNK_TEXT_BYTES = 1 << 20
CHUNK_MAX_DOCUMENTS = 2048
# Chunks in flight per worker: enough to hide the main process's reading behind tokenizing,
# bounded so that memory does not grow with the corpus.
CHUNKS_IN_FLIGHT_PER_WORKER = 3

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizerSpec:
    """The arguments of ``build_tokenizer``: cheap to send to workers, each builds its own."""

    tokenizer_type: str = DEFAULT_TOKENIZER_TYPE
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None

    def build(self) -> Tokenizer:
        return build_tokenizer(self.tokenizer_type, vocab_file=self.vocab_file,
                               merge_file=self.merge_file, tokenizer_model=self.tokenizer_model)


@dataclass
class _Chunk:
    """Texts of consecutive documents, one list per JSON key, and their size for progress."""

    texts_by_key: tuple[list[str], ...]
    documents: int
    text_bytes: int


# (flat tokens, tokens per document) for each JSON key of a chunk
EncodedChunk = list[tuple[np.ndarray, np.ndarray]]


class _ChunkEncoder:
    """Turns a chunk's texts into flat token arrays of the output dtype, eod appended."""

    def __init__(self, tokenizer: Tokenizer, append_eod: bool, dtype: np.dtype) -> None:
        self.tokenizer = tokenizer
        self.append_eod = append_eod
        self.dtype = dtype

    def __call__(self, texts_by_key: tuple[list[str], ...]) -> EncodedChunk:
        return [self._encode(texts) for texts in texts_by_key]

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        token_lists = self.tokenizer.tokenize_batch(texts)
        if len(token_lists) != len(texts):
            raise ValueError(f"tokenize_batch returned {len(token_lists)} results for "
                             f"{len(texts)} texts")
        eod = self.tokenizer.eod
        flat: list[int] = []
        for token_ids in token_lists:
            flat.extend(token_ids)
            if self.append_eod:
                flat.append(eod)
        lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
        if self.append_eod:
            lengths += 1
        tokens = np.array(flat, dtype=np.int64)
        if tokens.size:
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.tokenizer.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(f"the tokenizer produced id {bad}, outside its vocabulary "
                                 f"of {self.tokenizer.vocab_size}")
        return as_token_array(tokens, self.dtype), lengths


# The encoder of a Pool worker process, set once by the pool initializer: a Pool task is a
# plain function, so per-process state has to live at module level.
_worker_encoder: _ChunkEncoder | None = None


def _init_worker(tokenizer: Tokenizer | TokenizerSpec, append_eod: bool, dtype: np.dtype) -> None:
    global _worker_encoder
    built = tokenizer.build() if isinstance(tokenizer, TokenizerSpec) else tokenizer
    _worker_encoder = _ChunkEncoder(built, append_eod, dtype)


def _encode_in_worker(texts_by_key: tuple[list[str], ...]) -> EncodedChunk:
    assert _worker_encoder is not None, "worker used before its initializer ran"
    return _worker_encoder(texts_by_key)


def preprocess(
    inputs: str | Sequence[str],
    output_prefix: str,
    tokenizer: Tokenizer | TokenizerSpec,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = True,
    workers: int = 1,
    skip_bad_lines: bool = False,
    log_interval: int = DEFAULT_LOG_INTERVAL,
) -> dict[str, str]:
    """Tokenize ``inputs`` into ``{output_prefix}_{key}_document`` datasets; return key -> prefix.

    ``tokenizer`` is a built tokenizer or a ``TokenizerSpec``; with ``workers > 1`` a spec lets
    each worker build its own, while a built tokenizer is handed to the workers as is.
    Progress is logged (logger ``data.preprocess``, INFO) every ``log_interval`` documents.
    """
    json_keys = _checked_json_keys(json_keys)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if log_interval < 1:
        raise ValueError(f"log_interval must be >= 1, got {log_interval}")
    built = tokenizer.build() if isinstance(tokenizer, TokenizerSpec) else tokenizer
    _check_eod(built, append_eod)
    dtype = best_token_dtype(built.vocab_size)
    stats = ReadStats()
    documents = iter_documents(inputs, json_keys, skip_bad_lines, stats)
    prefixes = {key: f"{output_prefix}_{key}_document" for key in json_keys}
    meter = _ThroughputMeter(log_interval)

    encoder = _ChunkEncoder(built, append_eod, dtype)
    builders: list[IndexedDatasetBuilder] = []
    try:
        builders.extend(IndexedDatasetBuilder(prefixes[key], dtype) for key in json_keys)
        chunks = _chunk_documents(documents, json_keys, stats)
        # closing(): on an error the pool is torn down here, not whenever the GC gets to it.
        with contextlib.closing(_encode_in_order(chunks, encoder, tokenizer, workers)) as encoded:
            for chunk, encoded_chunk in encoded:
                for builder, (tokens, lengths) in zip(builders, encoded_chunk, strict=True):
                    builder.add_documents(tokens, lengths)
                meter.add(chunk.documents, chunk.text_bytes)
        for builder in builders:
            builder.finalize()
    except BaseException:
        for builder in builders:
            builder.discard()
        raise
    meter.finish(stats)
    return prefixes


def _checked_json_keys(json_keys: Sequence[str]) -> tuple[str, ...]:
    if isinstance(json_keys, str):
        json_keys = (json_keys,)
    keys = tuple(json_keys)
    if not keys or not all(isinstance(key, str) and key for key in keys):
        raise ValueError(f"json_keys must be non-empty key names, got {list(keys)}")
    if len(set(keys)) != len(keys):
        raise ValueError(f"json_keys has duplicates: {list(keys)}")
    return keys


def _check_eod(tokenizer: Tokenizer, append_eod: bool) -> None:
    if append_eod and not 0 <= tokenizer.eod < tokenizer.vocab_size:
        raise ValueError(f"the tokenizer's eod id {tokenizer.eod} is outside its vocabulary "
                         f"[0, {tokenizer.vocab_size})")


def _chunk_documents(documents: Iterator[Document], json_keys: tuple[str, ...],
                     stats: ReadStats) -> Iterator[_Chunk]:
    """Group documents into chunks of about ``CHUNK_TEXT_BYTES`` of text."""
    texts_by_key: tuple[list[str], ...] = tuple([] for _ in json_keys)
    bytes_at_chunk_start = stats.bytes
    for document in documents:
        for texts, key in zip(texts_by_key, json_keys, strict=True):
            texts.append(document.text_by_key[key])
        # stats.bytes already holds each document's UTF-8 size, so it is not measured twice.
        chunk_bytes = stats.bytes - bytes_at_chunk_start
        if chunk_bytes >= CHUNK_TEXT_BYTES or len(texts_by_key[0]) >= CHUNK_MAX_DOCUMENTS:
            yield _Chunk(texts_by_key, len(texts_by_key[0]), chunk_bytes)
            texts_by_key = tuple([] for _ in json_keys)
            bytes_at_chunk_start = stats.bytes
    if texts_by_key[0]:
        yield _Chunk(texts_by_key, len(texts_by_key[0]), stats.bytes - bytes_at_chunk_start)


def _encode_in_order(
    chunks: Iterator[_Chunk],
    encoder: _ChunkEncoder,
    worker_tokenizer: Tokenizer | TokenizerSpec,
    workers: int,
) -> Iterator[tuple[_Chunk, EncodedChunk]]:
    """Encode chunks, in parallel when ``workers > 1``, yielding them in input order.

    With one worker the chunks are encoded in this process by ``encoder``; otherwise each
    pool worker builds its own encoder from ``worker_tokenizer``.

    ``Pool.imap`` would also keep the order, but its feeder thread drains the whole input
    into the task queue as fast as it can read it, so memory would grow with the corpus. A
    bounded window of ``apply_async`` results keeps the order with constant memory, and
    reading stays on the main thread where its errors surface directly.
    """
    if workers == 1:
        for chunk in chunks:
            yield chunk, encoder(chunk.texts_by_key)
        return
    max_in_flight = CHUNKS_IN_FLIGHT_PER_WORKER * workers
    with multiprocessing.Pool(workers, initializer=_init_worker,
                              initargs=(worker_tokenizer, encoder.append_eod,
                                        encoder.dtype)) as pool:
        pending: deque[tuple[_Chunk, multiprocessing.pool.AsyncResult]] = deque()
        for chunk in chunks:
            pending.append((chunk, pool.apply_async(_encode_in_worker, (chunk.texts_by_key,))))
            if len(pending) >= max_in_flight:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()


class _ThroughputMeter:
    """Progress lines with documents/s and MB/s of text, and the closing summary."""

    def __init__(self, log_interval: int) -> None:
        self.log_interval = log_interval
        self.start = time.perf_counter()
        self.documents = 0
        self.text_bytes = 0
        self.next_report = log_interval

    def add(self, documents: int, text_bytes: int) -> None:
        self.documents += documents
        self.text_bytes += text_bytes
        if self.documents >= self.next_report:
            elapsed = self._elapsed()
            logger.info("processed %s docs (%s docs/s, %.1f MB/s)", f"{self.documents:,}",
                        f"{self.documents / elapsed:,.0f}", self.text_bytes / 1e6 / elapsed)
            self.next_report = (self.documents // self.log_interval + 1) * self.log_interval

    def finish(self, stats: ReadStats) -> None:
        elapsed = self._elapsed()
        logger.info("processed %s docs, %.1f MB in %.1f s: %.1f MB/s", f"{self.documents:,}",
                    self.text_bytes / 1e6, elapsed, self.text_bytes / 1e6 / elapsed)
        if stats.skipped_lines:
            logger.warning("%s", stats.summary())

    def _elapsed(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data.preprocess",
        description="Tokenize jsonl / jsonl.zst / Hugging Face text into Megatron indexed "
                    "datasets ({output-prefix}_{key}_document.bin/.idx).",
    )
    group = parser.add_argument_group("input")
    group.add_argument("--input", nargs="+", required=True,
                       help="jsonl or jsonl.zst files, directories of shards (read recursively "
                            "in sorted order), or hf:NAME[:SPLIT] for a datasets dataset")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys of each JSON object to tokenize, one output dataset per key")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip and count unreadable lines instead of stopping at the first")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", default=DEFAULT_TOKENIZER_TYPE,
                       help="GPT2BPETokenizer, SentencePieceTokenizer, "
                       "GPTSentencePieceTokenizer, Llama2Tokenizer (BOS before every document) "
                       "or HFTokenizer")
    group.add_argument("--vocab-file", help="GPT-2 encoder.json (default: the built-in GPT-2)")
    group.add_argument("--merge-file", help="GPT-2 vocab.bpe (default: the built-in GPT-2)")
    group.add_argument("--tokenizer-model",
                       help="SentencePiece model file or Hugging Face tokenizer directory")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to every document")
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True,
                       help="path prefix; writes {prefix}_{key}_document.bin/.idx")
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap"],
                       help="accepted for Megatron-DeepSpeed command lines; only mmap exists")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="tokenizer processes (output is identical for any value)")
    group.add_argument("--log-interval", type=int, default=DEFAULT_LOG_INTERVAL,
                       help="print progress every this many documents")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Progress goes to stderr so that stdout stays clean for shell pipelines.
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    spec = TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file,
                         args.tokenizer_model)
    try:
        prefixes = preprocess(args.input, args.output_prefix, spec, json_keys=args.json_keys,
                              append_eod=args.append_eod, workers=args.workers,
                              skip_bad_lines=args.skip_bad_lines,
                              log_interval=args.log_interval)
    except (BadInputError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: no output written", file=sys.stderr)
        return 130
    for key, prefix in prefixes.items():
        logger.info("wrote %s: %s.bin, %s.idx", key, prefix, prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
