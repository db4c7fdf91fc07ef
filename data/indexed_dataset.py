"""Megatron-LM's memory-mapped indexed dataset (``.bin`` + ``.idx``), byte-compatible.

A dataset is a pair of files sharing a prefix. ``{prefix}.bin`` is the raw token array of
every sequence, back to back. ``{prefix}.idx`` describes it (all integers little-endian)::

    offset  size      field
    0       9         magic b"MMIDIDX\\x00\\x00"
    9       8         uint64 version, always 1
    17      1         uint8 token dtype code (1 uint8, 2 int8, 3 int16, 4 int32,
                      5 int64, 6 float64, 7 float32, 8 uint16)
    18      8         uint64 S, number of sequences
    26      8         uint64 D, number of entries in the document index
    34      4*S       int32 token count of each sequence
            8*S       int64 byte offset of each sequence in the .bin
            8*D       int64 document index: 0, then the number of sequences seen at the
                      end of each document (so D = documents + 1, last entry = S)

This is the layout written by Megatron-LM's ``IndexedDatasetBuilder`` (and read by its
``IndexedDataset`` and by Megatron-DeepSpeed's ``MMapIndexedDataset``), so files move freely
between those tools and this project. ``tests/test_indexed_dataset.py`` checks the layout with
an independent ``struct`` reader.

The builder writes to temporary names next to the final ones and renames on ``finalize``:
the ``.bin`` first, the ``.idx`` last, so the ``.idx`` acts as the commit marker and a reader
never sees a half-written pair under the final names.
"""

from __future__ import annotations

import array
import os
import struct
import tempfile
from collections.abc import Sequence
from types import TracebackType

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, doc count

DTYPE_BY_CODE: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_BY_DTYPE: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}

# Megatron switches to int32 a little below 2**16 (its historical threshold); keeping the same
# cut-off means a vocabulary gets the same .bin dtype here as in Megatron's own preprocessing.
_UINT16_VOCAB_LIMIT = 65500
_INT32_MAX = np.iinfo(np.int32).max


def best_token_dtype(vocab_size: int) -> np.dtype:
    """Smallest token dtype Megatron uses for ``vocab_size``: uint16 below 65500, else int32."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
        raise ValueError(f"vocab_size must be an integer, got {vocab_size!r}")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size > _INT32_MAX:
        raise ValueError(f"vocab_size {vocab_size} does not fit the int32 token dtype")
    return np.dtype(np.uint16) if vocab_size < _UINT16_VOCAB_LIMIT else np.dtype(np.int32)


def data_file_path(prefix: str | os.PathLike[str]) -> str:
    """Path of the token file (``.bin``) of the dataset at ``prefix``."""
    return os.fspath(prefix) + ".bin"


def index_file_path(prefix: str | os.PathLike[str]) -> str:
    """Path of the index file (``.idx``) of the dataset at ``prefix``."""
    return os.fspath(prefix) + ".idx"


def dataset_exists(prefix: str | os.PathLike[str]) -> bool:
    """Whether both files of the dataset at ``prefix`` exist."""
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def _checked_token_dtype(dtype: np.dtype | type) -> np.dtype:
    resolved = np.dtype(dtype)
    if resolved not in CODE_BY_DTYPE:
        supported = ", ".join(str(d) for d in DTYPE_BY_CODE.values())
        raise ValueError(f"token dtype {resolved} has no Megatron code; supported: {supported}")
    return resolved


def as_token_array(tokens: Sequence[int] | np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``tokens`` as a 1-D little-endian array of ``dtype``, refusing values that would wrap.

    A plain ``astype`` would silently wrap an id of 70000 into a uint16; that corruption would
    only surface as a bad loss curve much later, so the range is checked here instead.
    """
    values = np.asarray(tokens)
    if values.ndim != 1:
        raise ValueError(f"a sequence must be 1-D, got an array of shape {values.shape}")
    if values.size == 0:
        return np.empty(0, dtype=dtype.newbyteorder("<"))
    if dtype.kind in "iu":
        if values.dtype.kind not in "iub":
            raise ValueError(f"token ids must be integers, got values of dtype {values.dtype}")
        bounds = np.iinfo(dtype)
        low, high = int(values.min()), int(values.max())
        if low < bounds.min or high > bounds.max:
            raise ValueError(
                f"token id out of range for dtype {dtype}: values span [{low}, {high}], "
                f"allowed [{bounds.min}, {bounds.max}]"
            )
    return values.astype(dtype.newbyteorder("<"), copy=False)


class IndexedDatasetBuilder:
    """Writes a Megatron indexed dataset at ``prefix``; use as a context manager.

    Two ways to add data, matching Megatron's builder:

    - ``add_document(tokens)``: one document made of one sequence (what GPT pretraining uses);
    - ``add_item(tokens)`` for each sequence of a document, then ``end_document()``.

    ``finalize()`` (called by a clean exit from ``with``) writes the index and renames both
    files into place. An exception inside ``with``, or ``discard()``, removes the temporary
    files and leaves nothing under the final names.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: np.dtype | type) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = _checked_token_dtype(dtype)
        directory = os.path.dirname(os.path.abspath(self.prefix))
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"output directory does not exist: {directory} (for dataset prefix {self.prefix})"
            )
        base = os.path.basename(self.prefix)
        # Temporaries live in the destination directory so the final rename stays on one
        # file system and is atomic.
        bin_fd, self._tmp_bin_path = tempfile.mkstemp(prefix=f".{base}.", suffix=".bin.partial",
                                                      dir=directory)
        self._tmp_idx_path = self._tmp_bin_path[: -len(".bin.partial")] + ".idx.partial"
        # mkstemp creates the file 0600; a dataset is shared data, so use the umask's mode.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self._tmp_bin_path, 0o666 & ~umask)
        self._bin_file = os.fdopen(bin_fd, "wb", buffering=1 << 20)
        # array.array keeps 8 bytes per entry; a Python list of ints would use ~36 and a
        # Pile-sized corpus has hundreds of millions of sequences.
        self._sequence_lengths = array.array("q")
        self._document_indices = array.array("q", [0])
        self._closed = False

    @property
    def sequence_count(self) -> int:
        """Number of sequences added so far."""
        return len(self._sequence_lengths)

    @property
    def document_count(self) -> int:
        """Number of documents ended so far."""
        return len(self._document_indices) - 1

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence to the current document."""
        self._check_open()
        values = as_token_array(tokens, self.dtype)
        if values.size > _INT32_MAX:
            raise ValueError(f"a sequence of {values.size} tokens exceeds the int32 length field")
        self._bin_file.write(values.tobytes())
        self._sequence_lengths.append(values.size)

    def end_document(self) -> None:
        """Close the current document after one or more ``add_item`` calls."""
        self._check_open()
        self._document_indices.append(len(self._sequence_lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append a document made of a single sequence."""
        self.add_item(tokens)
        self.end_document()

    def add_documents(self, tokens: np.ndarray, lengths: Sequence[int] | np.ndarray) -> None:
        """Append many single-sequence documents given as one flat array and their lengths.

        Equivalent to ``add_document`` on each slice, with one write instead of thousands.
        """
        self._check_open()
        values = as_token_array(tokens, self.dtype)
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or (lengths.size and int(lengths.min()) < 0):
            raise ValueError("document lengths must be a 1-D sequence of non-negative integers")
        if int(lengths.sum()) != values.size:
            raise ValueError(
                f"document lengths add up to {int(lengths.sum())} tokens but {values.size} "
                "tokens were given"
            )
        if lengths.size and int(lengths.max()) > _INT32_MAX:
            raise ValueError(f"a document of {int(lengths.max())} tokens exceeds the int32 "
                             "length field")
        self._bin_file.write(values.tobytes())
        first = len(self._sequence_lengths)
        self._sequence_lengths.extend(lengths.tolist())
        self._document_indices.extend(range(first + 1, first + lengths.size + 1))

    def finalize(self) -> None:
        """Write the index and move both files to their final names."""
        self._check_open()
        pending = len(self._sequence_lengths) - self._document_indices[-1]
        if pending:
            self.discard()
            raise ValueError(
                f"{pending} sequence(s) added after the last end_document() call for "
                f"{self.prefix}; every sequence must belong to a document"
            )
        try:
            # fsync before the renames: otherwise a crash soon after could leave the final
            # names pointing at files whose data never reached the disk.
            self._bin_file.flush()
            os.fsync(self._bin_file.fileno())
            self._bin_file.close()
            self._write_index(self._tmp_idx_path)
            self._move_into_place()
        except BaseException:
            self.discard()
            raise
        self._closed = True

    def discard(self) -> None:
        """Abandon the dataset: close and delete the temporary files."""
        if self._closed:
            return
        self._closed = True
        self._bin_file.close()
        for path in (self._tmp_bin_path, self._tmp_idx_path):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            if not self._closed:
                self.finalize()
        else:
            self.discard()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the builder for {self.prefix} is already finalized or discarded")

    def _write_index(self, path: str) -> None:
        lengths = np.frombuffer(self._sequence_lengths, dtype=np.int64)
        pointers = np.zeros(lengths.size, dtype="<i8")
        if lengths.size > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        document_indices = np.frombuffer(self._document_indices, dtype=np.int64)
        with open(path, "wb") as index_file:
            index_file.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, CODE_BY_DTYPE[self.dtype],
                                          lengths.size, document_indices.size))
            index_file.write(lengths.astype("<i4").tobytes())
            index_file.write(pointers.tobytes())
            index_file.write(document_indices.astype("<i8").tobytes())
            index_file.flush()
            os.fsync(index_file.fileno())

    def _move_into_place(self) -> None:
        final_index = index_file_path(self.prefix)
        # Removing the old index first means that, between the two renames, the prefix reads
        # as "no dataset" rather than as a new .bin paired with a stale .idx.
        if os.path.exists(final_index):
            os.remove(final_index)
        os.replace(self._tmp_bin_path, data_file_path(self.prefix))
        os.replace(self._tmp_idx_path, final_index)


class IndexedDataset:
    """Read-only, memory-mapped view of a Megatron indexed dataset.

    ``dataset[i]`` is sequence ``i`` as a read-only numpy array backed by the ``.bin`` map;
    ``get(i, offset, length)`` is a slice of it. Pickling carries only the prefix, so worker
    processes re-open the maps instead of receiving a copy of the tokens.
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = os.fspath(prefix)
        self._max_token_id: int | None = None
        self._open()

    def _open(self) -> None:
        index_path, data_path = index_file_path(self.prefix), data_file_path(self.prefix)
        missing = [path for path in (index_path, data_path) if not os.path.isfile(path)]
        if missing:
            raise FileNotFoundError(f"indexed dataset file(s) not found: {', '.join(missing)}")
        self.dtype, sequence_count, document_count = _read_index_header(index_path)
        index_map = np.memmap(index_path, dtype=np.uint8, mode="r")
        pointers_offset = _HEADER.size + 4 * sequence_count
        document_offset = pointers_offset + 8 * sequence_count
        self.sequence_lengths: np.ndarray = np.frombuffer(
            index_map, dtype="<i4", count=sequence_count, offset=_HEADER.size)
        self.sequence_pointers: np.ndarray = np.frombuffer(
            index_map, dtype="<i8", count=sequence_count, offset=pointers_offset)
        self.document_indices: np.ndarray = np.frombuffer(
            index_map, dtype="<i8", count=document_count, offset=document_offset)
        _check_document_indices(index_path, self.document_indices, sequence_count)
        self._tokens = self._map_tokens(data_path, index_path)

    def _map_tokens(self, data_path: str, index_path: str) -> np.ndarray:
        token_count = int(self.sequence_lengths.sum(dtype=np.int64))
        expected_bytes = token_count * self.dtype.itemsize
        actual_bytes = os.path.getsize(data_path)
        if actual_bytes != expected_bytes:
            raise ValueError(
                f"{data_path} is {actual_bytes} bytes but {index_path} describes {token_count} "
                f"tokens of {self.dtype} ({expected_bytes} bytes): the pair is truncated or "
                "mismatched"
            )
        if len(self.sequence_pointers):
            last_end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * \
                self.dtype.itemsize
            if last_end != expected_bytes:
                raise ValueError(
                    f"{index_path}: sequence pointers end at byte {last_end} but the lengths "
                    f"add up to {expected_bytes} bytes; the index is corrupt"
                )
        if token_count == 0:
            return np.empty(0, dtype=self.dtype.newbyteorder("<"))
        data_map = np.memmap(data_path, dtype=np.uint8, mode="r")
        return np.frombuffer(data_map, dtype=self.dtype.newbyteorder("<"))

    def __getstate__(self) -> dict[str, object]:
        return {"prefix": self.prefix, "max_token_id": self._max_token_id}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.prefix = str(state["prefix"])
        self._max_token_id = state["max_token_id"]  # type: ignore[assignment]
        self._open()

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """Number of documents (``len(document_indices) - 1``)."""
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        """Total number of tokens in the ``.bin``."""
        return len(self._tokens)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``index`` (to its end if no length)."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"sequence index must be an integer, got {type(index).__name__}")
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"sequence index {index} out of range for {count} sequences")
        index = int(index) % count
        sequence_length = int(self.sequence_lengths[index])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise ValueError(
                f"tokens [{offset}, {offset + length}) are outside sequence {index} of "
                f"{sequence_length} tokens"
            )
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self._tokens[start:start + length]

    def max_token_id(self) -> int:
        """Largest token id in the ``.bin`` (-1 when empty); scanned once, then cached."""
        if self._max_token_id is None:
            self._max_token_id = int(self._tokens.max()) if len(self._tokens) else -1
        return self._max_token_id

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, sequences={len(self)}, "
                f"documents={self.num_documents}, tokens={self.num_tokens}, dtype={self.dtype})")


def _read_index_header(index_path: str) -> tuple[np.dtype, int, int]:
    """Validate the header and the file size of an ``.idx``; return dtype and counts."""
    file_size = os.path.getsize(index_path)
    with open(index_path, "rb") as index_file:
        header = index_file.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise ValueError(f"{index_path} is {file_size} bytes, shorter than the "
                         f"{_HEADER.size}-byte index header")
    magic, version, code, sequence_count, document_count = _HEADER.unpack(header)
    if magic != INDEX_MAGIC:
        raise ValueError(f"{index_path} is not a Megatron indexed dataset index: magic bytes are "
                         f"{magic!r}, expected {INDEX_MAGIC!r}")
    if version != INDEX_VERSION:
        raise ValueError(f"{index_path}: unsupported index version {version}, "
                         f"expected {INDEX_VERSION}")
    if code not in DTYPE_BY_CODE:
        raise ValueError(f"{index_path}: unknown token dtype code {code}, expected one of "
                         f"{sorted(DTYPE_BY_CODE)}")
    expected_size = _HEADER.size + 12 * sequence_count + 8 * document_count
    if file_size != expected_size:
        # Megatron's multimodal variant appends one int8 mode per sequence.
        hint = (" (it carries per-sequence modes: multimodal indexes are not supported)"
                if file_size == expected_size + sequence_count else "")
        raise ValueError(
            f"{index_path} is {file_size} bytes but its header declares {sequence_count} "
            f"sequences and {document_count} document index entries ({expected_size} "
            f"bytes){hint}"
        )
    return DTYPE_BY_CODE[code], sequence_count, document_count


def _check_document_indices(index_path: str, document_indices: np.ndarray,
                            sequence_count: int) -> None:
    # Only the two ends are checked: a full monotonicity scan would touch the whole index of
    # a Pile-sized dataset on every open.
    if len(document_indices) == 0 or document_indices[0] != 0:
        raise ValueError(f"{index_path}: the document index must start with 0")
    if document_indices[-1] != sequence_count:
        raise ValueError(
            f"{index_path}: the document index ends at sequence {int(document_indices[-1])} "
            f"but the index holds {sequence_count} sequences"
        )
