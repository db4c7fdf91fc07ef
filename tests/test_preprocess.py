"""Pile readers and the preprocessing CLI: token content, determinism across workers, every
bad-input message, skip counting, and no output left behind by a failed run."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
import zstandard

from data import preprocess as preprocess_module
from data import readers
from data.indexed_dataset import IndexedDataset, dataset_exists
from data.preprocess import TokenizerSpec, main, preprocess
from data.readers import BadInputError, ReadStats, iter_documents


class ByteTokenizer:
    """Token ids are the UTF-8 bytes of the text; eod is 256. Obviously correct reference."""

    vocab_size = 257
    eod = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(text) for text in texts]

    def detokenize(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8")


class FailingTokenizer(ByteTokenizer):
    """Raises on a marker text, standing in for a tokenizer crash in the middle of a run."""

    def tokenize(self, text: str) -> list[int]:
        if "POISON" in text:
            raise RuntimeError("tokenizer crashed on a poisoned document")
        return super().tokenize(text)


def pile_line(text: str, set_name: str = "Pile-CC") -> str:
    return json.dumps({"text": text, "meta": {"pile_set_name": set_name}})


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_zst(path: Path, lines: list[str], frames: int = 1) -> Path:
    """Compress the lines into ``frames`` concatenated zstd frames, as Pile shards can be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(line + "\n" for line in lines).encode("utf-8")
    cut_points = np.linspace(0, len(payload), frames + 1, dtype=int)
    compressor = zstandard.ZstdCompressor()
    path.write_bytes(b"".join(compressor.compress(payload[a:b])
                              for a, b in zip(cut_points[:-1], cut_points[1:], strict=True)))
    return path


def write_truncated_zst(path: Path, texts: list[str]) -> Path:
    """A shard cut in the middle of its frame. The text spans several 128 KiB zstd blocks,
    so the complete blocks before the cut still decode to some whole lines."""
    write_zst(path, [pile_line(t) for t in texts])
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def sample_texts(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["the", "Pile", "zero", "naïve", "日本語", "tokens", "\n", "GPU", "😀", "x" * 40]
    return [" ".join(rng.choice(words, size=int(rng.integers(0, 60)))) for _ in range(count)]


def read_all(prefix: str) -> list[list[int]]:
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def expected_tokens(texts: list[str], eod: int | None = 256) -> list[list[int]]:
    return [list(text.encode("utf-8")) + ([eod] if eod is not None else []) for text in texts]


@pytest.fixture()
def sharded_corpus(tmp_path) -> tuple[Path, list[str]]:
    """A directory of jsonl and multi-frame jsonl.zst shards, nested, plus a file to ignore."""
    texts = sample_texts(90)
    root = tmp_path / "corpus"
    write_zst(root / "00.jsonl.zst", [pile_line(t) for t in texts[:30]], frames=3)
    write_jsonl(root / "01.jsonl", [pile_line(t, "ArXiv") for t in texts[30:50]])
    write_zst(root / "sub" / "02.jsonl.zst", [pile_line(t) for t in texts[50:70]])
    write_jsonl(root / "sub" / "deeper" / "03.jsonl", [pile_line(t) for t in texts[70:]])
    (root / "README.txt").write_text("not a shard")
    return root, texts


# -- readers -----------------------------------------------------------------------------------


def test_directory_is_read_recursively_in_sorted_order(sharded_corpus):
    root, texts = sharded_corpus
    stats = ReadStats()
    documents = list(iter_documents(str(root), stats=stats))
    assert [d.text_by_key["text"] for d in documents] == texts
    assert documents[0].source.endswith("00.jsonl.zst") and documents[0].line == 1
    assert documents[30].set_name == "ArXiv" and documents[30].line == 1
    assert documents[-1].source.endswith(os.path.join("deeper", "03.jsonl"))
    assert stats.documents == 90
    assert stats.bytes == sum(len(t.encode("utf-8")) for t in texts)


def test_several_json_keys_and_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [json.dumps({"q": "why", "a": "because"}), "",
                                               "   ", json.dumps({"q": "how", "a": "so"})])
    documents = list(iter_documents([str(path)], json_keys=("q", "a")))
    assert [d.text_by_key for d in documents] == [{"q": "why", "a": "because"},
                                                  {"q": "how", "a": "so"}]
    assert [d.line for d in documents] == [1, 4]
    assert documents[0].set_name is None


def test_hugging_face_dataset_object_and_local_hf_input(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"text": "alpha", "meta": {"pile_set_name": "Wiki"}}, {"text": "beta", "meta": {}}]
    documents = list(iter_documents(datasets.Dataset.from_list(rows)))
    assert [(d.text_by_key["text"], d.set_name, d.line) for d in documents] == [
        ("alpha", "Wiki", 1), ("beta", None, 2)]

    folder = tmp_path / "hf_local"
    write_jsonl(folder / "train.jsonl", [pile_line("gamma", "Books3"), pile_line("delta")])
    documents = list(iter_documents(f"hf:{folder}:train"))
    assert [d.text_by_key["text"] for d in documents] == ["gamma", "delta"]
    assert documents[0].set_name == "Books3" and documents[0].source == f"hf:{folder}:train"


@pytest.mark.parametrize(("spec", "expected"), [
    ("hf:monology/pile-uncopyrighted", ("monology/pile-uncopyrighted", "train")),
    ("hf:monology/pile-uncopyrighted:validation", ("monology/pile-uncopyrighted", "validation")),
    ("hf://EleutherAI/pile:test", ("EleutherAI/pile", "test")),
    ("hf:/data/local_folder:train", ("/data/local_folder", "train")),
])
def test_hf_input_syntax(spec, expected):
    assert readers.parse_hf_input(spec) == expected


def test_hf_input_without_a_name_is_refused():
    with pytest.raises(ValueError, match="expected hf:NAME"):
        iter_documents("hf:")


# -- bad input: one message naming file and line -----------------------------------------------


def bad_corpus(tmp_path: Path) -> dict[str, Path]:
    good = pile_line("fine")
    return {
        "json": write_jsonl(tmp_path / "bad_json.jsonl", [good, good, '{"text": "a" "b"}', good]),
        "key": write_jsonl(tmp_path / "bad_key.jsonl",
                           [good, json.dumps({"content": "x", "meta": {}})]),
        "type": write_jsonl(tmp_path / "bad_type.jsonl", [json.dumps({"text": 42})]),
        "object": write_jsonl(tmp_path / "bad_object.jsonl", [good, "[1, 2]"]),
        "null": write_jsonl(tmp_path / "null.jsonl", [good, good, "null"]),
    }


def test_invalid_json_names_file_and_line(tmp_path):
    path = bad_corpus(tmp_path)["json"]
    with pytest.raises(BadInputError, match=rf"^{re.escape(str(path))}:3: invalid JSON "
                                            r"\(Expecting ',' delimiter at column 14\)$"):
        list(iter_documents(str(path)))


def test_missing_key_names_key_and_keys_present(tmp_path):
    path = bad_corpus(tmp_path)["key"]
    with pytest.raises(BadInputError) as error:
        list(iter_documents(str(path)))
    assert str(error.value) == f"{path}:2: missing key 'text' (keys present: 'content', 'meta')"
    assert error.value.source == str(path) and error.value.line == 2


def test_object_cut_short_reports_the_column_on_its_own_line(tmp_path):
    path = write_jsonl(tmp_path / "cut.jsonl", [pile_line("ok"), '{"text": '])
    with pytest.raises(BadInputError, match=r":2: invalid JSON \(Expecting value at end of line\)$"):
        list(iter_documents(str(path)))


def test_non_string_text_and_non_object_lines(tmp_path):
    paths = bad_corpus(tmp_path)
    with pytest.raises(BadInputError, match=rf"^{re.escape(str(paths['type']))}:1: text is not a string "
                                            r"\(key 'text' holds int\)$"):
        list(iter_documents(str(paths["type"])))
    with pytest.raises(BadInputError, match=rf"^{re.escape(str(paths['object']))}:2: expected a JSON object "
                                            r"\(got list\)$"):
        list(iter_documents(str(paths["object"])))
    with pytest.raises(BadInputError, match=r":3: expected a JSON object \(got NoneType\)$"):
        list(iter_documents(str(paths["null"])))


def test_non_utf8_byte_names_line_and_offset(tmp_path):
    path = tmp_path / "latin1.jsonl"
    first = (pile_line("ok") + "\n").encode()
    path.write_bytes(first + b'{"text": "caf\xe9"}\n')
    with pytest.raises(BadInputError) as error:
        list(iter_documents(str(path)))
    assert str(error.value).startswith(
        f"{path}:2: invalid UTF-8 byte 0xe9 at byte 13 of the line "
        f"(byte {len(first) + 13} of the file)")


def test_non_utf8_inside_zst_names_decompressed_offset(tmp_path):
    path = tmp_path / "latin1.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "\xff"}\n'))
    with pytest.raises(BadInputError, match=r":1: invalid UTF-8 byte 0xff at byte 10 of the line "
                                            r"\(byte 10 of the decompressed file\)"):
        list(iter_documents(str(path)))


def test_truncated_zst_names_file_and_line_where_reading_stopped(tmp_path):
    texts = sample_texts(3000, seed=3)
    cut = write_truncated_zst(tmp_path / "cut.jsonl.zst", texts)
    read: list[str] = []
    with pytest.raises(BadInputError) as error:
        for document in iter_documents(str(cut)):
            read.append(document.text_by_key["text"])
    assert 0 < len(read) < len(texts) and read == texts[: len(read)]
    assert str(error.value) == (
        f"{cut}:{len(read) + 1}: truncated zstd stream (the file ends inside a frame), reading "
        f"stopped after {len(read):,} complete lines")


def test_corrupt_zst_is_reported(tmp_path):
    path = tmp_path / "garbage.jsonl.zst"
    path.write_bytes(b"this was never compressed\n")
    with pytest.raises(BadInputError, match=rf"^{re.escape(str(path))}:1: corrupt zstd data"):
        list(iter_documents(str(path)))


def test_missing_paths_fail_before_reading(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [pile_line("x")])
    with pytest.raises(FileNotFoundError, match=r"input path does not exist: .*nope\.jsonl"):
        iter_documents([str(good), str(tmp_path / "nope.jsonl")])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="contains no .jsonl or .jsonl.zst files"):
        iter_documents(str(tmp_path / "empty_dir"))


def test_skip_bad_lines_counts_each_reason(tmp_path):
    paths = bad_corpus(tmp_path)
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"text": "caf\xe9"}\n' + (pile_line("kept") + "\n").encode())
    cut = write_truncated_zst(tmp_path / "cut.jsonl.zst", sample_texts(3000, seed=4))
    inputs = [str(p) for p in (paths["json"], paths["key"], paths["object"], latin, cut)]

    stats = ReadStats()
    documents = list(iter_documents(inputs, skip_bad_lines=True, stats=stats))
    from_cut = [d for d in documents if d.source == str(cut)]
    # 3 + 1 + 1 good lines, "kept", and every complete line of the truncated shard
    assert len(documents) == 6 + len(from_cut) and len(from_cut) > 0
    assert stats.documents == len(documents)
    assert stats.skipped_lines == 5
    assert stats.skip_reasons == {"invalid JSON": 1, "missing key": 1,
                                  "expected a JSON object": 1, "invalid UTF-8": 1,
                                  "truncated zstd stream": 1}
    assert stats.skip_examples[0].startswith(f"{paths['json']}:3: invalid JSON")
    assert "skipped 5 lines" in stats.summary()


# -- preprocessing -----------------------------------------------------------------------------


def test_tokens_are_tokenizer_output_plus_eod_in_order(sharded_corpus, tmp_path):
    root, texts = sharded_corpus
    prefixes = preprocess(str(root), str(tmp_path / "out"), ByteTokenizer())
    assert prefixes == {"text": str(tmp_path / "out") + "_text_document"}
    assert read_all(prefixes["text"]) == expected_tokens(texts)
    dataset = IndexedDataset(prefixes["text"])
    assert dataset.dtype == np.uint16 and dataset.num_documents == len(texts)


def test_without_eod_and_with_several_keys(tmp_path):
    rows = [json.dumps({"title": f"t{i}", "body": f"body {i}" * i}) for i in range(12)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    prefixes = preprocess([str(path)], str(tmp_path / "multi"), ByteTokenizer(),
                          json_keys=("title", "body"), append_eod=False)
    assert read_all(prefixes["title"]) == expected_tokens([f"t{i}" for i in range(12)], None)
    assert read_all(prefixes["body"]) == expected_tokens([f"body {i}" * i for i in range(12)],
                                                         None)


def test_two_workers_are_byte_identical_to_one(sharded_corpus, tmp_path, monkeypatch):
    root, texts = sharded_corpus
    monkeypatch.setattr(preprocess_module, "CHUNK_MAX_DOCUMENTS", 7)  # many small chunks
    one = preprocess(str(root), str(tmp_path / "w1"), ByteTokenizer(), workers=1)["text"]
    two = preprocess(str(root), str(tmp_path / "w2"), ByteTokenizer(), workers=2)["text"]
    assert read_all(two) == expected_tokens(texts)
    for suffix in (".bin", ".idx"):
        assert Path(one + suffix).read_bytes() == Path(two + suffix).read_bytes()


def test_gpt2_cli_end_to_end_with_workers(sharded_corpus, tmp_path, caplog, monkeypatch):
    tokenizers = pytest.importorskip("data.tokenizers")
    try:
        gpt2 = tokenizers.build_tokenizer("GPT2BPETokenizer")
    except (FileNotFoundError, ValueError) as error:
        pytest.skip(f"GPT-2 files unavailable: {error}")
    root, texts = sharded_corpus
    monkeypatch.setattr(preprocess_module, "CHUNK_MAX_DOCUMENTS", 10)
    caplog.set_level(logging.INFO, logger="data.preprocess")
    outputs = {}
    for workers in (1, 2):
        prefix = str(tmp_path / f"gpt2_w{workers}")
        code = main(["--input", str(root / "00.jsonl.zst"), str(root / "01.jsonl"),
                     str(root / "sub"), "--output-prefix", prefix, "--append-eod",
                     "--workers", str(workers), "--log-interval", "25"])
        assert code == 0
        outputs[workers] = prefix + "_text_document"
    progress = [r.getMessage() for r in caplog.records if r.name == "data.preprocess"]
    assert any(re.fullmatch(r"processed 30 docs \([\d,]+ docs/s, [\d.]+ MB/s\)", line)
               for line in progress)
    assert any(re.fullmatch(r"processed 90 docs, [\d.]+ MB in [\d.]+ s: [\d.]+ MB/s", line)
               for line in progress)
    expected = [gpt2.tokenize(text) + [gpt2.eod] for text in texts]
    assert read_all(outputs[1]) == expected
    for suffix in (".bin", ".idx"):
        assert Path(outputs[1] + suffix).read_bytes() == Path(outputs[2] + suffix).read_bytes()


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys, monkeypatch):
    path = bad_corpus(tmp_path)["key"]
    prefix = tmp_path / "cli"
    code = main(["--input", str(path), "--output-prefix", str(prefix), "--tokenizer-type",
                 "NoSuchTokenizer"])
    assert code == 1
    assert capsys.readouterr().err.strip().startswith("error: unknown tokenizer type")

    monkeypatch.setattr(TokenizerSpec, "build", lambda self: ByteTokenizer())
    code = main(["--input", str(path), "--output-prefix", str(prefix)])
    assert code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {path}:2: missing key 'text' (keys present: 'content', 'meta')"]
    assert not dataset_exists(f"{prefix}_text_document")


def test_skip_bad_lines_in_preprocess(tmp_path, caplog):
    paths = bad_corpus(tmp_path)
    inputs = [str(paths["json"]), str(paths["key"])]
    with pytest.raises(BadInputError):
        preprocess(inputs, str(tmp_path / "strict"), ByteTokenizer())
    assert not os.path.exists(tmp_path / "strict_text_document.bin")
    prefixes = preprocess(inputs, str(tmp_path / "lenient"), ByteTokenizer(),
                          skip_bad_lines=True)
    assert read_all(prefixes["text"]) == expected_tokens(["fine"] * 4)
    assert "skipped 2 lines (1 invalid JSON, 1 missing key)" in caplog.text


@pytest.mark.parametrize("workers", [1, 2])
def test_failure_mid_run_leaves_no_output(tmp_path, monkeypatch, workers):
    texts = sample_texts(60, seed=5)
    texts[45] = "POISON " + texts[45]
    path = write_jsonl(tmp_path / "poisoned.jsonl", [pile_line(t) for t in texts])
    monkeypatch.setattr(preprocess_module, "CHUNK_MAX_DOCUMENTS", 5)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(RuntimeError, match="tokenizer crashed on a poisoned document"):
        preprocess(str(path), str(out_dir / "run"), FailingTokenizer(), workers=workers)
    assert os.listdir(out_dir) == []


@pytest.mark.parametrize("failure", [OSError("disk vanished"), KeyboardInterrupt()])
def test_monkeypatched_tokenizer_raising_after_some_chunks(tmp_path, monkeypatch, failure):
    path = write_jsonl(tmp_path / "c.jsonl", [pile_line(t) for t in sample_texts(50, 6)])
    tokenizer = ByteTokenizer()
    calls = {"count": 0}
    original = tokenizer.tokenize_batch

    def flaky(texts):
        calls["count"] += 1
        if calls["count"] == 4:
            raise failure
        return original(texts)

    monkeypatch.setattr(tokenizer, "tokenize_batch", flaky)
    monkeypatch.setattr(preprocess_module, "CHUNK_MAX_DOCUMENTS", 5)
    with pytest.raises(type(failure)):
        preprocess(str(path), str(tmp_path / "flaky"), tokenizer)
    assert calls["count"] == 4
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]


def test_eod_must_be_inside_the_vocabulary(tmp_path):
    class BadEod(ByteTokenizer):
        eod = 257

    path = write_jsonl(tmp_path / "c.jsonl", [pile_line("x")])
    with pytest.raises(ValueError, match=r"eod id 257 is outside its vocabulary \[0, 257\)"):
        preprocess(str(path), str(tmp_path / "o"), BadEod())
    preprocess(str(path), str(tmp_path / "o"), BadEod(), append_eod=False)


def test_token_id_beyond_vocabulary_is_refused(tmp_path):
    class Liar(ByteTokenizer):
        vocab_size = 100

    path = write_jsonl(tmp_path / "c.jsonl", [pile_line("~~~")])  # '~' is byte 126
    with pytest.raises(ValueError, match="produced id 126, outside its vocabulary of 100"):
        preprocess(str(path), str(tmp_path / "o"), Liar(), append_eod=False)
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]
