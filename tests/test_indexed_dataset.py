"""Megatron indexed dataset: round trips, byte layout against an independent struct codec,
and the errors a corrupt, truncated or mismatched pair must produce."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest

from data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    best_token_dtype,
    data_file_path,
    dataset_exists,
    index_file_path,
)

# Megatron's dtype codes, restated here rather than imported so the test is an independent
# reference for the layout.
MEGATRON_CODES = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 6: "d", 7: "f", 8: "H"}
MAGIC = b"MMIDIDX\x00\x00"


def struct_read(prefix: str) -> dict:
    """Decode a dataset straight from the documented byte layout, with struct only."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == MAGIC
    (version,) = struct.unpack_from("<Q", raw, 9)
    (code,) = struct.unpack_from("<B", raw, 17)
    sequence_count, document_count = struct.unpack_from("<QQ", raw, 18)
    offset = 34
    lengths = list(struct.unpack_from(f"<{sequence_count}i", raw, offset))
    offset += 4 * sequence_count
    pointers = list(struct.unpack_from(f"<{sequence_count}q", raw, offset))
    offset += 8 * sequence_count
    documents = list(struct.unpack_from(f"<{document_count}q", raw, offset))
    offset += 8 * document_count
    assert offset == len(raw), "trailing bytes in the index"
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    fmt = MEGATRON_CODES[code]
    size = struct.calcsize(fmt)
    sequences = [
        list(struct.unpack_from(f"<{length}{fmt}", data, pointer))
        for length, pointer in zip(lengths, pointers, strict=True)
    ]
    return {"version": version, "code": code, "lengths": lengths, "pointers": pointers,
            "documents": documents, "sequences": sequences, "bin_size": len(data),
            "itemsize": size}


def struct_write(prefix: str, documents: list[list[list[int]]], code: int) -> None:
    """Write a dataset the way Megatron's builder lays it out, from the spec, with struct."""
    fmt = MEGATRON_CODES[code]
    lengths, pointers, doc_index, data = [], [], [0], bytearray()
    for document in documents:
        for sequence in document:
            pointers.append(len(data))
            lengths.append(len(sequence))
            data += struct.pack(f"<{len(sequence)}{fmt}", *sequence)
        doc_index.append(len(lengths))
    index = bytearray(MAGIC)
    index += struct.pack("<QBQQ", 1, code, len(lengths), len(doc_index))
    index += struct.pack(f"<{len(lengths)}i", *lengths)
    index += struct.pack(f"<{len(pointers)}q", *pointers)
    index += struct.pack(f"<{len(doc_index)}q", *doc_index)
    with open(prefix + ".idx", "wb") as f:
        f.write(index)
    with open(prefix + ".bin", "wb") as f:
        f.write(data)


def random_documents(rng: np.random.Generator, count: int, high: int) -> list[list[int]]:
    return [rng.integers(0, high, size=int(rng.integers(0, 400))).tolist() for _ in range(count)]


def write_documents(prefix: str, documents: list[list[int]], dtype) -> None:
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for document in documents:
            builder.add_document(document)


# -- round trips -------------------------------------------------------------------------------


def test_round_trip_matches_struct_reader_with_empty_and_huge_documents(tmp_path):
    rng = np.random.default_rng(0)
    huge = rng.integers(0, 50257, size=3_000_000).tolist()
    documents = random_documents(rng, 50, 50257) + [[]] + [huge] + [[7]] + [[]]
    prefix = str(tmp_path / "corpus")
    write_documents(prefix, documents, best_token_dtype(50257))

    dataset = IndexedDataset(prefix)
    assert len(dataset) == len(documents) and dataset.num_documents == len(documents)
    assert dataset.dtype == np.uint16
    for index, document in enumerate(documents):
        assert dataset[index].tolist() == document

    reference = struct_read(prefix)
    assert reference["version"] == 1 and reference["code"] == 8
    assert reference["sequences"] == documents
    assert reference["lengths"] == [len(d) for d in documents]
    expected_pointers = np.concatenate([[0], np.cumsum([2 * len(d) for d in documents])[:-1]])
    assert reference["pointers"] == expected_pointers.tolist()
    assert reference["documents"] == list(range(len(documents) + 1))
    assert dataset.sequence_lengths.tolist() == reference["lengths"]
    assert dataset.sequence_pointers.tolist() == reference["pointers"]
    assert dataset.document_indices.tolist() == reference["documents"]
    assert dataset.num_tokens == sum(map(len, documents)) == reference["bin_size"] // 2


def test_int32_path_for_large_vocabularies(tmp_path):
    vocab_size = 128_256
    assert best_token_dtype(vocab_size) == np.int32
    rng = np.random.default_rng(1)
    documents = random_documents(rng, 30, vocab_size) + [[vocab_size - 1, 65_536, 0]]
    prefix = str(tmp_path / "llama")
    write_documents(prefix, documents, best_token_dtype(vocab_size))

    reference = struct_read(prefix)
    assert reference["code"] == 4 and reference["itemsize"] == 4
    assert reference["sequences"] == documents
    dataset = IndexedDataset(prefix)
    assert dataset.dtype == np.int32
    assert [dataset[i].tolist() for i in range(len(dataset))] == documents
    assert dataset.max_token_id() == vocab_size - 1


@pytest.mark.parametrize(("vocab_size", "dtype"), [
    (1, np.uint16), (50_257, np.uint16), (65_499, np.uint16), (65_500, np.int32),
    (65_536, np.int32), (2**31 - 1, np.int32),
])
def test_best_token_dtype_uses_megatron_threshold(vocab_size, dtype):
    assert best_token_dtype(vocab_size) == np.dtype(dtype)


@pytest.mark.parametrize("vocab_size", [0, -5, 2**31, 1.5])
def test_best_token_dtype_rejects_bad_sizes(vocab_size):
    with pytest.raises(ValueError, match="vocab_size"):
        best_token_dtype(vocab_size)


def test_reads_a_file_written_from_the_megatron_layout(tmp_path):
    """Several sequences per document, as Megatron's add_item/end_document produce."""
    documents = [[[1, 2, 3], [4]], [[5, 6]], [[], [7, 8, 9, 10], [11]], [[12]]]
    prefix = str(tmp_path / "megatron")
    struct_write(prefix, documents, code=8)

    dataset = IndexedDataset(prefix)
    flat = [sequence for document in documents for sequence in document]
    assert [dataset[i].tolist() for i in range(len(dataset))] == flat
    assert dataset.document_indices.tolist() == [0, 2, 3, 6, 7]
    assert dataset.num_documents == 4
    assert dataset.get(4, offset=1, length=2).tolist() == [8, 9]
    assert dataset.get(4, offset=3).tolist() == [10]


def test_builder_output_is_byte_identical_to_the_megatron_layout(tmp_path):
    documents = [[[1, 2, 3], [4]], [[5, 6]], [[], [70_000, 8, 9, 10], [11]]]
    reference = str(tmp_path / "reference")
    struct_write(reference, documents, code=4)
    ours = str(tmp_path / "ours")
    with IndexedDatasetBuilder(ours, np.int32) as builder:
        for document in documents:
            for sequence in document:
                builder.add_item(sequence)
            builder.end_document()
    for path in (data_file_path, index_file_path):
        assert open(path(ours), "rb").read() == open(path(reference), "rb").read()


def test_add_documents_batch_equals_one_by_one(tmp_path):
    rng = np.random.default_rng(2)
    documents = random_documents(rng, 40, 1000) + [[]]
    one_by_one, batched = str(tmp_path / "a"), str(tmp_path / "b")
    write_documents(one_by_one, documents, np.uint16)
    with IndexedDatasetBuilder(batched, np.uint16) as builder:
        builder.add_documents(np.array(sum(documents[:25], []), dtype=np.int64),
                              [len(d) for d in documents[:25]])
        builder.add_documents(np.array(sum(documents[25:], []), dtype=np.int64),
                              [len(d) for d in documents[25:]])
    for path in (data_file_path, index_file_path):
        assert open(path(one_by_one), "rb").read() == open(path(batched), "rb").read()


def test_empty_dataset_round_trips(tmp_path):
    prefix = str(tmp_path / "empty")
    with IndexedDatasetBuilder(prefix, np.uint16):
        pass
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 0 and dataset.num_documents == 0 and dataset.max_token_id() == -1
    assert struct_read(prefix)["documents"] == [0]


def test_get_slices_and_index_errors(tmp_path):
    prefix = str(tmp_path / "small")
    write_documents(prefix, [[10, 11, 12, 13], [20, 21]], np.uint16)
    dataset = IndexedDataset(prefix)
    assert dataset.get(0, 1, 2).tolist() == [11, 12]
    assert dataset.get(0, 4).tolist() == []
    assert dataset[-1].tolist() == [20, 21]
    assert not dataset[0].flags.writeable
    with pytest.raises(IndexError, match="sequence index 2 out of range for 2"):
        dataset[2]
    with pytest.raises(ValueError, match=r"tokens \[1, 4\) are outside sequence 1 of 2"):
        dataset.get(1, 1, 3)
    with pytest.raises(TypeError):
        dataset["0"]


def test_max_token_id_and_pickle_reopen(tmp_path):
    prefix = str(tmp_path / "pick")
    write_documents(prefix, [[5, 900, 3], [], [41]], np.uint16)
    dataset = IndexedDataset(prefix)
    assert dataset.max_token_id() == 900
    payload = pickle.dumps(dataset)
    assert len(payload) < 500, "pickling must carry the prefix, not the tokens"
    clone = pickle.loads(payload)
    assert [clone[i].tolist() for i in range(3)] == [[5, 900, 3], [], [41]]
    assert clone.max_token_id() == 900


def test_finalize_replaces_an_existing_dataset(tmp_path):
    prefix = str(tmp_path / "again")
    write_documents(prefix, [[1, 2, 3]] * 10, np.uint16)
    write_documents(prefix, [[9]], np.uint16)
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 1 and dataset[0].tolist() == [9]
    assert sorted(os.listdir(tmp_path)) == ["again.bin", "again.idx"]


# -- builder failure modes ---------------------------------------------------------------------


def test_exception_inside_builder_leaves_no_files(tmp_path):
    prefix = str(tmp_path / "broken")
    with pytest.raises(RuntimeError, match="boom"):
        with IndexedDatasetBuilder(prefix, np.uint16) as builder:
            builder.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert not dataset_exists(prefix)
    assert os.listdir(tmp_path) == []


def test_keyboard_interrupt_inside_builder_leaves_no_files(tmp_path):
    prefix = str(tmp_path / "interrupted")
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetBuilder(prefix, np.uint16) as builder:
            builder.add_document([1])
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_unfinished_document_is_refused_at_finalize(tmp_path):
    prefix = str(tmp_path / "pending")
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    builder.add_document([1])
    builder.add_item([2, 3])
    with pytest.raises(ValueError, match="1 sequence.*after the last end_document"):
        builder.finalize()
    assert os.listdir(tmp_path) == []


def test_token_out_of_dtype_range_is_refused(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "range"), np.uint16) as builder:
        with pytest.raises(ValueError, match=r"values span \[0, 70000\].*\[0, 65535\]"):
            builder.add_document([0, 70_000])
        with pytest.raises(ValueError, match="values span"):
            builder.add_document([-1])
        with pytest.raises(ValueError, match="must be integers"):
            builder.add_document([1.5])


def test_builder_rejects_bad_dtype_missing_directory_and_reuse(tmp_path):
    with pytest.raises(ValueError, match="complex128 has no Megatron code"):
        IndexedDatasetBuilder(str(tmp_path / "x"), np.complex128)
    with pytest.raises(FileNotFoundError, match="output directory does not exist"):
        IndexedDatasetBuilder(str(tmp_path / "no" / "such" / "x"), np.uint16)
    builder = IndexedDatasetBuilder(str(tmp_path / "done"), np.uint16)
    builder.finalize()
    with pytest.raises(ValueError, match="already finalized"):
        builder.add_document([1])


# -- reader errors -----------------------------------------------------------------------------


@pytest.fixture()
def good_prefix(tmp_path) -> str:
    prefix = str(tmp_path / "good")
    write_documents(prefix, [[1, 2, 3], [4, 5], [6]], np.uint16)
    return prefix


def _patch_bytes(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_corrupt_magic(good_prefix):
    _patch_bytes(good_prefix + ".idx", 0, b"NOTMAGIC!")
    with pytest.raises(ValueError, match=r"good\.idx is not a Megatron indexed dataset index"):
        IndexedDataset(good_prefix)


def test_bad_version_and_dtype_code(good_prefix):
    _patch_bytes(good_prefix + ".idx", 9, struct.pack("<Q", 2))
    with pytest.raises(ValueError, match="unsupported index version 2"):
        IndexedDataset(good_prefix)
    _patch_bytes(good_prefix + ".idx", 9, struct.pack("<QB", 1, 9))
    with pytest.raises(ValueError, match="unknown token dtype code 9"):
        IndexedDataset(good_prefix)


def test_truncated_bin_names_both_files(good_prefix):
    os.truncate(good_prefix + ".bin", 8)
    with pytest.raises(ValueError) as error:
        IndexedDataset(good_prefix)
    message = str(error.value)
    assert "good.bin is 8 bytes" in message and "good.idx describes 6 tokens" in message


def test_truncated_index(good_prefix):
    size = os.path.getsize(good_prefix + ".idx")
    os.truncate(good_prefix + ".idx", size - 8)
    with pytest.raises(ValueError, match=f"good.idx is {size - 8} bytes but its header declares "
                                         "3 sequences and 4 document index entries"):
        IndexedDataset(good_prefix)
    os.truncate(good_prefix + ".idx", 20)
    with pytest.raises(ValueError, match="shorter than the 34-byte index header"):
        IndexedDataset(good_prefix)


def test_index_of_another_dataset(good_prefix, tmp_path):
    other = str(tmp_path / "other")
    write_documents(other, [[1, 2], [3, 4, 5]], np.uint16)
    os.replace(other + ".idx", good_prefix + ".idx")
    with pytest.raises(ValueError, match="good.bin is 12 bytes but .*good.idx describes 5 tokens"
                                         ".*truncated or mismatched"):
        IndexedDataset(good_prefix)


def test_inconsistent_document_index(tmp_path):
    prefix = str(tmp_path / "docs")
    struct_write(prefix, [[[1], [2]], [[3]]], code=8)
    _patch_bytes(prefix + ".idx", 34 + 3 * 12 + 16, struct.pack("<q", 2))
    with pytest.raises(ValueError, match="document index ends at sequence 2 but the index holds 3"):
        IndexedDataset(prefix)


def test_inconsistent_sequence_pointers(good_prefix):
    last_pointer_offset = 34 + 3 * 4 + 2 * 8
    _patch_bytes(good_prefix + ".idx", last_pointer_offset, struct.pack("<q", 2))
    with pytest.raises(ValueError, match="sequence pointers end at byte 4 but the lengths add up "
                                         "to 12 bytes"):
        IndexedDataset(good_prefix)


def test_missing_files(good_prefix):
    os.remove(good_prefix + ".bin")
    assert not dataset_exists(good_prefix)
    with pytest.raises(FileNotFoundError, match=r"not found: .*good\.bin"):
        IndexedDataset(good_prefix)
