"""Readers for Pile-format text corpora: jsonl, jsonl.zst, and Hugging Face datasets.

An input is one of:

- a ``.jsonl`` file (any file whose name does not end in ``.zst`` is read as plain JSON lines);
- a ``.jsonl.zst`` / ``.zst`` file, zstd-compressed JSON lines (one or several frames, as
  the Pile shards are);
- a directory: every ``.jsonl`` and ``.jsonl.zst`` file below it, recursively, in sorted
  order of relative path;
- ``hf:NAME[:SPLIT]``: a ``datasets`` dataset, streamed with ``datasets.load_dataset(NAME,
  split=SPLIT, streaming=True)`` (SPLIT defaults to ``train``). NAME is a hub id (needs the
  network) or a local folder of data files, e.g. ``hf:corpus/:train`` for a folder of
  ``.jsonl`` files, which ``datasets`` reads offline. A ``datasets.Dataset`` or
  ``IterableDataset`` object may also be passed directly from Python.

Each line is a JSON object with the text under ``text`` (or the keys given) and, in the Pile,
the subset name under ``meta.pile_set_name``. Bad input raises ``BadInputError`` naming file
and line (``corpus/00.jsonl.zst:1234: invalid JSON (...)``); with ``skip_bad_lines=True`` the
line is skipped and counted in ``ReadStats`` instead. Blank lines are ignored.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import zstandard

logger = logging.getLogger(__name__)

HF_PREFIX = "hf:"
HF_DEFAULT_SPLIT = "train"
CORPUS_FILE_SUFFIXES = (".jsonl", ".jsonl.zst")
_ZSTD_READ_SIZE = 1 << 20
_LOGGED_SKIPS = 10  # individual skipped lines logged before only counting
_BLANK_LINE = object()  # sentinel: a JSON "null" line must not pass for a blank one


class BadInputError(ValueError):
    """A line (or a whole input) that cannot be read; the message names file and line.

    ``kind`` is the short class of problem ("invalid JSON", "missing key", ...) that
    ``ReadStats`` counts skipped lines by.
    """

    def __init__(self, source: str, line: int, kind: str, detail: str = "") -> None:
        reason = f"{kind} {detail}" if detail else kind
        super().__init__(f"{source}:{line}: {reason}")
        self.source = source
        self.line = line
        self.kind = kind
        self.reason = reason


class _StreamError(BadInputError):
    """The compressed stream cannot be read past this point (truncated or corrupt)."""


@dataclass
class Document:
    """One input record: the text under each requested key and where it came from."""

    text_by_key: dict[str, str]
    source: str
    line: int
    set_name: str | None


@dataclass
class ReadStats:
    """What a read consumed: documents yielded, their text bytes, and skipped lines.

    ``bytes`` counts the UTF-8 size of the texts under the requested keys, so throughput
    figures compare across jsonl, zst and Hugging Face inputs. ``skip_reasons`` counts skipped
    lines per kind of problem; ``skip_examples`` keeps the first full messages.
    """

    documents: int = 0
    bytes: int = 0
    skipped_lines: int = 0
    skip_reasons: Counter[str] = field(default_factory=Counter)
    skip_examples: list[str] = field(default_factory=list)

    def record_skip(self, error: BadInputError) -> None:
        self.skipped_lines += 1
        self.skip_reasons[error.kind] += 1
        if len(self.skip_examples) < _LOGGED_SKIPS:
            self.skip_examples.append(str(error))
            logger.warning("skipping %s", error)

    def summary(self) -> str:
        if not self.skipped_lines:
            return "no lines skipped"
        reasons = ", ".join(f"{count:,} {kind}" for kind, count in self.skip_reasons.most_common())
        return f"skipped {self.skipped_lines:,} lines ({reasons})"


def iter_documents(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Any,
    json_keys: Sequence[str] = ("text",),
    skip_bad_lines: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[Document]:
    """Yield the documents of every input in order (see the module docstring for inputs).

    Every path is checked before the first document is read, so a typo in the last of many
    inputs fails at once rather than after hours of reading.
    """
    if isinstance(json_keys, str) or not json_keys:
        raise ValueError(f"json_keys must be a non-empty sequence of key names, got {json_keys!r}")
    stats = stats if stats is not None else ReadStats()
    sources = _resolve_inputs(inputs)  # eager: this function is not itself a generator
    return _iter_sources(sources, tuple(json_keys), skip_bad_lines, stats)


def _iter_sources(sources: list[Any], json_keys: tuple[str, ...], skip_bad_lines: bool,
                  stats: ReadStats) -> Iterator[Document]:
    for source in sources:
        if isinstance(source, str) and not source.startswith(HF_PREFIX):
            records = _iter_file_records(source, skip_bad_lines, stats)
        else:
            records = _iter_hf_records(source)
        yield from _documents_from_records(records, json_keys, skip_bad_lines, stats)


def _documents_from_records(
    records: Iterable[tuple[str, int, Any]],
    json_keys: tuple[str, ...],
    skip_bad_lines: bool,
    stats: ReadStats,
) -> Iterator[Document]:
    for source, line, record in records:
        try:
            document = _document_from_record(source, line, record, json_keys)
        except BadInputError as error:
            if not skip_bad_lines:
                raise
            stats.record_skip(error)
            continue
        stats.documents += 1
        stats.bytes += sum(_utf8_size(text) for text in document.text_by_key.values())
        yield document


def _document_from_record(source: str, line: int, record: Any,
                          json_keys: tuple[str, ...]) -> Document:
    if not isinstance(record, dict):
        raise BadInputError(source, line, "expected a JSON object",
                            f"(got {type(record).__name__})")
    text_by_key = {}
    for key in json_keys:
        if key not in record:
            present = ", ".join(repr(k) for k in record) or "none"
            raise BadInputError(source, line, "missing key", f"{key!r} (keys present: {present})")
        text = record[key]
        if not isinstance(text, str):
            raise BadInputError(source, line, "text is not a string",
                                f"(key {key!r} holds {type(text).__name__})")
        text_by_key[key] = text
    meta = record.get("meta")
    set_name = meta.get("pile_set_name") if isinstance(meta, dict) else None
    return Document(text_by_key, source, line, set_name if isinstance(set_name, str) else None)


def _utf8_size(text: str) -> int:
    # isascii() is a flag check in CPython, so the common case avoids encoding the text.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


# -- inputs ------------------------------------------------------------------------------------


def _resolve_inputs(inputs: Any) -> list[Any]:
    """Expand directories into sorted shard lists; check that every path exists."""
    if isinstance(inputs, (str, os.PathLike)):
        entries: list[Any] = [inputs]
    elif _is_hf_dataset(inputs):
        entries = [inputs]
    else:
        entries = list(inputs)
        if not entries:
            raise ValueError("no inputs given")
    sources: list[Any] = []
    for entry in entries:
        if _is_hf_dataset(entry):
            sources.append(entry)
            continue
        path = os.fspath(entry)
        if path.startswith(HF_PREFIX):
            parse_hf_input(path)
            sources.append(path)
        elif os.path.isdir(path):
            sources.extend(_corpus_files_under(path))
        elif os.path.isfile(path):
            sources.append(path)
        else:
            raise FileNotFoundError(f"input path does not exist: {path}")
    return sources


def _corpus_files_under(directory: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found.extend(os.path.join(root, name) for name in files
                     if name.endswith(CORPUS_FILE_SUFFIXES) and not name.startswith("."))
    if not found:
        raise FileNotFoundError(
            f"input directory {directory} contains no {' or '.join(CORPUS_FILE_SUFFIXES)} files"
        )
    return sorted(found, key=lambda path: os.path.relpath(path, directory).split(os.sep))


# -- files -------------------------------------------------------------------------------------


def _iter_file_records(path: str, skip_bad_lines: bool,
                       stats: ReadStats) -> Iterator[tuple[str, int, Any]]:
    """Parse each non-blank line of a jsonl(.zst) file into ``(path, line, value)``."""
    with open(path, "rb") as raw_file:
        lines = _zstd_lines(path, raw_file) if path.endswith(".zst") else iter(raw_file)
        line_number = 0
        file_offset = 0
        while True:
            try:
                raw_line = next(lines)
            except StopIteration:
                return
            except _StreamError as error:
                # Nothing after a broken frame can be decoded: the file ends here.
                if not skip_bad_lines:
                    raise
                stats.record_skip(error)
                return
            line_number += 1
            try:
                value = _parse_line(path, line_number, file_offset, raw_line)
            except BadInputError as error:
                if not skip_bad_lines:
                    raise
                stats.record_skip(error)
                value = _BLANK_LINE
            file_offset += len(raw_line)
            if value is not _BLANK_LINE:
                yield path, line_number, value


def _parse_line(path: str, line_number: int, file_offset: int, raw_line: bytes) -> Any:
    """The JSON value on a line, or ``_BLANK_LINE``."""
    try:
        text = raw_line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadInputError(
            path, line_number, "invalid UTF-8",
            f"byte 0x{raw_line[error.start]:02x} at byte {error.start} of the line (byte "
            f"{file_offset + error.start} of the {'decompressed ' if path.endswith('.zst') else ''}"
            "file)",
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        if not text.strip():  # checked only on failure: stripping every line costs a copy
            return _BLANK_LINE
        # error.pos, not error.colno: the line still ends in its newline, which json would
        # count as a second line when the object is cut short.
        content_length = len(text.rstrip("\r\n"))
        where = f"column {error.pos + 1}" if error.pos < content_length else "end of line"
        raise BadInputError(path, line_number, "invalid JSON",
                            f"({error.msg} at {where})") from None


def _zstd_lines(path: str, raw_file: BinaryIO) -> Iterator[bytes]:
    """Lines (with their newline) of a zstd file; raises at a truncated or corrupt frame.

    zstandard's stream_reader returns a truncated stream as if it had ended cleanly, which
    would silently cut the last document; decoding frame by frame lets the end of input be
    checked against the frame state.
    """
    pending = b""
    complete_lines = 0
    try:
        for chunk in _zstd_chunks(raw_file):
            pieces = (pending + chunk).split(b"\n")
            pending = pieces.pop()
            for piece in pieces:
                complete_lines += 1
                yield piece + b"\n"
    except _ZstdStreamBroken as broken:
        kind, detail = broken.args
        raise _StreamError(path, complete_lines + 1, kind,
                           f"{detail}, reading stopped after {complete_lines:,} complete lines"
                           ) from None
    if pending:
        yield pending


class _ZstdStreamBroken(Exception):
    """``(kind, detail)`` raised by ``_zstd_chunks``; ``_zstd_lines`` adds file and line."""


def _zstd_chunks(raw_file: BinaryIO) -> Iterator[bytes]:
    """Decompressed pieces of a (possibly multi-frame) zstd file."""
    decompressor = zstandard.ZstdDecompressor()
    frame = decompressor.decompressobj()
    frame_has_input = False
    while compressed := raw_file.read(_ZSTD_READ_SIZE):
        while compressed:
            try:
                output = frame.decompress(compressed)
            except zstandard.ZstdError as error:
                raise _ZstdStreamBroken("corrupt zstd data", f"({error})") from None
            frame_has_input = True
            if output:
                yield output
            if not frame.eof:
                break
            # A frame ended; the rest of this read belongs to the next frame.
            compressed = frame.unused_data
            frame = decompressor.decompressobj()
            frame_has_input = False
    if frame_has_input:
        raise _ZstdStreamBroken("truncated zstd stream", "(the file ends inside a frame)")


# -- Hugging Face datasets ---------------------------------------------------------------------


def _is_hf_dataset(value: Any) -> bool:
    return type(value).__module__.startswith("datasets.") and hasattr(value, "__iter__")


def parse_hf_input(spec: str) -> tuple[str, str]:
    """``hf:NAME[:SPLIT]`` -> (NAME, SPLIT)."""
    body = spec[len(HF_PREFIX):].removeprefix("//")
    name, separator, split = body.rpartition(":")
    if not separator or "/" in split or os.sep in split:
        name, split = body, HF_DEFAULT_SPLIT
    if not name:
        raise ValueError(f"{spec}: expected hf:NAME[:SPLIT], e.g. hf:monology/pile-uncopyrighted:train")
    return name, split or HF_DEFAULT_SPLIT


def _iter_hf_records(source: Any) -> Iterator[tuple[str, int, Any]]:
    if isinstance(source, str):
        import datasets  # imported here: it is slow to import and only this input needs it

        name, split = parse_hf_input(source)
        dataset = datasets.load_dataset(name, split=split, streaming=True)
        label = f"{HF_PREFIX}{name}:{split}"
    else:
        dataset, label = source, f"{HF_PREFIX}<{type(source).__name__}>"
    for row_number, row in enumerate(dataset, start=1):
        yield label, row_number, row
