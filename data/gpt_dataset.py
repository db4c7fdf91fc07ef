"""GPT pretraining datasets over Megatron indexed data: split, shuffle, blend.

A GPTDataset turns the documents of one split into fixed-length training samples the way
Megatron-LM does. Documents are laid end to end into one token stream; sample k covers the
stream positions [k * seq_length, (k + 1) * seq_length] inclusive, i.e. seq_length + 1 tokens,
so consecutive samples share one boundary token (the last label of sample k is the first
input of sample k + 1) and samples freely cross document boundaries.

Three index arrays describe that layout:

    document index  the split's document ids, repeated for as many epochs as num_samples
                    needs, each epoch in its own seeded permutation.
    sample index    (num_samples + 1, 2): (position in the document index, token offset) of
                    each sample start; row k + 1 is also where sample k ends (inclusive).
    shuffle index   a seeded permutation of the samples: item i is sample shuffle_index[i].

They are built with vectorised numpy (a cumulative sum of document lengths and one
searchsorted), cached as .npy files under a name that hashes everything they depend on, and
memory-mapped on later runs. BlendedDataset mixes several datasets in fixed proportions (a
greedy interleaving as in Megatron, tightened to stay within one sample of the weights), and
build_train_valid_test_datasets wires it all from Megatron-style arguments (`--data-path`,
`--split`).

This module is numpy-only; distributed callers pass `is_builder` and a `build_barrier` so that
one process builds the cache while the others wait and then memory-map it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from data.indexed_dataset import IndexedDataset, data_file_path, index_file_path

logger = logging.getLogger(__name__)

# Bump whenever the content or layout of a cached index array changes, so old caches are
# never mistaken for new ones.
INDEX_FORMAT_VERSION = 1
# Megatron asks every blend component for 0.5% more samples than its weight, so that the
# interleaving never runs a component past its end.
BLEND_SAMPLE_MARGIN = 1.005
SPLIT_NAMES = ("train", "valid", "test")

IndexArrays = dict[str, np.ndarray]


# -- Splits and data paths ------------------------------------------------------------------------


def parse_split(split: str) -> tuple[float, float, float]:
    """Parse a Megatron `--split` string ("969,30,1", "98/2/0", "1") into normalised weights.

    Missing trailing parts are zero, so "1" means everything goes to train.
    """
    separator = "/" if "/" in split and "," not in split else ","
    parts = [part.strip() for part in split.split(separator)]
    if not split.strip() or len(parts) > 3:
        raise ValueError(f"split {split!r} must be one to three comma-separated weights")
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        raise ValueError(f"split {split!r} holds a weight that is not a number") from None
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"split {split!r} holds a negative or non-finite weight")
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"split {split!r} has weights summing to zero")
    weights += [0.0] * (3 - len(weights))
    return (weights[0] / total, weights[1] / total, weights[2] / total)


def split_documents(num_docs: int, weights: Sequence[float]) -> list[np.ndarray]:
    """Split document ids 0..num_docs-1 into contiguous train/valid/test ranges.

    Megatron's rounding rule: each boundary moves by round(weight * num_docs), then all
    boundaries shift by the rounding surplus so the last one lands exactly on num_docs.
    Boundaries are clamped to [0, num_docs] so that shift can never create negative ids.
    """
    if num_docs < 0:
        raise ValueError(f"num_docs must be >= 0, got {num_docs}")
    if len(weights) != 3 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be three non-negative numbers, got {list(weights)}")
    boundaries = [0]
    for weight in weights:
        boundaries.append(boundaries[-1] + int(round(weight * float(num_docs))))
    surplus = boundaries[-1] - num_docs
    boundaries = [boundaries[0]] + [b - surplus for b in boundaries[1:]]
    boundaries = [min(max(b, 0), num_docs) for b in boundaries]
    return [np.arange(boundaries[i], boundaries[i + 1], dtype=np.int64) for i in range(3)]


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float]]:
    """Parse `--data-path`: either one prefix, or "w1 prefix1 w2 prefix2 ..." for a blend.

    Returns the prefixes and their weights normalised to sum to one.
    """
    items = list(data_path)
    if not items:
        raise ValueError("data path is empty: give one prefix or 'weight prefix' pairs")
    if len(items) == 1:
        return [items[0]], [1.0]
    if len(items) % 2 != 0:
        raise ValueError(f"data path has {len(items)} entries: a blend needs 'weight prefix' pairs")
    prefixes, weights = [], []
    for raw_weight, prefix in zip(items[0::2], items[1::2], strict=True):
        try:
            weight = float(raw_weight)
        except ValueError:
            raise ValueError(
                f"data path weight {raw_weight!r} (before {prefix!r}) is not a number"
            ) from None
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"data path weight {raw_weight!r} for {prefix!r} must be > 0")
        prefixes.append(prefix)
        weights.append(weight)
    total = sum(weights)
    return prefixes, [w / total for w in weights]


# -- Index construction (pure numpy) --------------------------------------------------------------


def _index_dtype(max_value: int) -> type[np.signedinteger]:
    """int32 halves the cache on disk; int64 only where values would overflow it."""
    return np.int32 if max_value < np.iinfo(np.int32).max else np.int64


def num_epochs_needed(tokens_per_epoch: int, num_samples: int, seq_length: int) -> int:
    """Fewest epochs whose token stream holds num_samples samples of seq_length + 1 tokens.

    Sample k ends at stream position (k + 1) * seq_length, so N samples need
    N * seq_length + 1 tokens.
    """
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.Generator
) -> np.ndarray:
    """The split's documents once per epoch, each epoch in a fresh permutation.

    Shuffling per epoch (rather than across all epochs) means every full epoch covers each
    document exactly once, and a truncated last epoch cannot steal documents from earlier ones.
    """
    dtype = _index_dtype(int(documents.max()))
    return np.concatenate([rng.permutation(documents) for _ in range(num_epochs)]).astype(dtype)


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, num_samples: int, seq_length: int
) -> np.ndarray:
    """(position in document_index, offset) of stream position k * seq_length, k = 0..N.

    `side="right"` resolves a position that sits exactly on a boundary to the next document
    with tokens, never to an empty one.
    """
    doc_ends = np.cumsum(sequence_lengths[document_index], dtype=np.int64)
    doc_starts = np.concatenate(([0], doc_ends[:-1]))
    stream_positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    if stream_positions[-1] >= doc_ends[-1]:
        raise ValueError(
            f"document index holds {doc_ends[-1]} tokens, too few for {num_samples} samples "
            f"of seq_length {seq_length}"
        )
    doc_positions = np.searchsorted(doc_starts, stream_positions, side="right") - 1
    offsets = stream_positions - doc_starts[doc_positions]
    max_value = max(len(document_index), int(offsets.max()) + 1)
    return np.stack([doc_positions, offsets], axis=1).astype(_index_dtype(max_value))


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Interleave weighted datasets so every prefix is within one sample of the weights.

    Megatron's greedy rule (pick the dataset whose count lags furthest behind weight * n)
    holds two datasets within one sample, but with three or more it lets a dataset fall up
    to ~1.6 samples behind (measured over random weights). Here the greedy choice is the
    earliest-deadline one: sample k of dataset i is released at position k / w_i and due
    by (k + 1) / w_i, and each position takes, among released samples, the one due first
    (lowest index on ties). Every window [a, b) holds at most sum_i w_i (b - a) = b - a
    samples released and due inside it, so this schedule meets every due date, giving after
    n picks floor(w_i n) <= count_i <= floor(w_i (n - 1)) + 1, i.e. |count_i - w_i n| < 1.
    With two datasets the order matches Megatron's except at exact ties, and position 0 goes
    to the heaviest dataset as in Megatron.

    Returns (dataset_index, dataset_sample_index).
    """
    if len(weights) == 0 or any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"blend weights must be positive, got {list(weights)}")
    if len(weights) > np.iinfo(np.int16).max:
        raise ValueError(f"a blend holds at most 32767 datasets, got {len(weights)}")
    total = float(sum(weights))
    time_per_sample = [total / float(w) for w in weights]  # 1 / normalised weight
    candidates = range(len(time_per_sample))
    counts = [0] * len(time_per_sample)
    next_release = [0.0] * len(time_per_sample)
    next_due = list(time_per_sample)
    dataset_index = [0] * size
    dataset_sample_index = [0] * size
    # Plain Python over lists: per-step numpy calls would cost more than they save for the
    # handful of datasets a blend has (about 0.6 s per million samples, then cached).
    for position in range(size):
        # The slack absorbs float rounding so a sample released exactly now counts as released.
        release_limit = position + 1e-12 * (position + 1)
        chosen, earliest_due = 0, math.inf
        for candidate in candidates:
            if next_release[candidate] <= release_limit and next_due[candidate] < earliest_due:
                chosen, earliest_due = candidate, next_due[candidate]
        dataset_index[position] = chosen
        dataset_sample_index[position] = counts[chosen]
        counts[chosen] += 1
        next_release[chosen] = counts[chosen] * time_per_sample[chosen]
        next_due[chosen] = next_release[chosen] + time_per_sample[chosen]
    return np.array(dataset_index, dtype=np.int16), np.array(dataset_sample_index, dtype=np.int64)


# -- On-disk cache --------------------------------------------------------------------------------


def _description_digest(description: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:20]


def _try_load(paths: dict[str, str], is_valid: Callable[[IndexArrays], bool]) -> IndexArrays | None:
    if not all(os.path.isfile(path) for path in paths.values()):
        return None
    try:
        arrays = {
            key: np.load(path, mmap_mode="r", allow_pickle=False) for key, path in paths.items()
        }
    except (OSError, ValueError, EOFError) as error:
        logger.warning("ignoring unreadable index cache %s: %s", next(iter(paths.values())), error)
        return None
    if not is_valid(arrays):
        logger.warning("ignoring index cache with unexpected shapes: %s", list(paths.values()))
        return None
    return arrays


def _save_atomically(paths: dict[str, str], arrays: IndexArrays) -> bool:
    """Write every array to a temp file, then rename them all into place.

    Readers check that all files exist, so they never see a half-written set. Returns False
    (after a warning) when the cache directory is not writable; the caller keeps its arrays.
    """
    directory = os.path.dirname(next(iter(paths.values())))
    temp_paths: dict[str, str] = {}
    try:
        os.makedirs(directory, exist_ok=True)
        for key, array in arrays.items():
            fd, temp_paths[key] = tempfile.mkstemp(dir=directory, prefix=".", suffix=".npy.tmp")
            with os.fdopen(fd, "wb") as handle:
                np.save(handle, array, allow_pickle=False)
        for key, temp_path in temp_paths.items():
            os.replace(temp_path, paths[key])
    except OSError as error:
        logger.warning("could not write index cache in %s: %s", directory, error)
        for temp_path in temp_paths.values():
            if os.path.exists(temp_path):
                os.remove(temp_path)
        return False
    return True


def _load_or_build_index(
    paths: dict[str, str] | None,
    build: Callable[[], IndexArrays],
    is_valid: Callable[[IndexArrays], bool],
    is_builder: bool,
    build_barrier: Callable[[], None] | None,
) -> tuple[IndexArrays, bool]:
    """Load cached index arrays, building (and caching) them first where needed.

    The builder loads or builds before the barrier; everyone else waits at the barrier and then
    memory-maps the builder's files. A process that still finds no cache (a node-local
    directory the builder did not write) builds in memory: the arrays are deterministic, so it
    gets the same ones. Returns (arrays, whether this process built them).
    """
    if paths is None:
        if build_barrier is not None:
            build_barrier()
        return build(), True
    arrays = _try_load(paths, is_valid) if is_builder else None
    built = False
    if is_builder and arrays is None:
        arrays, built = build(), True
        if _save_atomically(paths, arrays):
            arrays = _try_load(paths, is_valid) or arrays
    if build_barrier is not None:
        build_barrier()
    if arrays is None:
        arrays = _try_load(paths, is_valid)
    if arrays is None:
        logger.warning("index cache %s missing after the barrier; building locally", paths)
        arrays, built = build(), True
    return arrays, built


# -- Datasets -------------------------------------------------------------------------------------


class GPTDataset:
    """Fixed-length samples of seq_length + 1 tokens over one split of an indexed dataset.

    Item i is {"text": int64 array of seq_length + 1 tokens}; the model reads text[:-1] and
    predicts text[1:]. Deterministic in `seed` for any num_samples, looping over as many
    epochs as needed.

    Attributes `document_index`, `sample_index` and `shuffle_index` are the three index arrays
    (see the module docstring); `index_was_built` says whether this process built them (False
    when they came from the cache).
    """

    def __init__(
        self,
        name: str,
        indexed: IndexedDataset,
        documents: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: str | None,
        build_barrier: Callable[[], None] | None = None,
        is_builder: bool = True,
    ) -> None:
        self.name = name
        self.indexed = indexed
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.documents = self._validated_documents(documents, len(indexed))
        if num_samples < 1:
            raise ValueError(f"dataset {name!r}: num_samples must be >= 1, got {num_samples}")
        if seq_length < 1:
            raise ValueError(f"dataset {name!r}: seq_length must be >= 1, got {seq_length}")
        sequence_lengths = np.asarray(indexed.sequence_lengths)
        self.tokens_per_epoch = int(sequence_lengths[self.documents].sum(dtype=np.int64))
        if self.tokens_per_epoch < seq_length + 1:
            raise ValueError(
                f"dataset {name!r}: its {len(self.documents)} documents hold "
                f"{self.tokens_per_epoch} tokens, fewer than one sample of seq_length + 1 = "
                f"{seq_length + 1} tokens"
            )
        self.num_epochs = num_epochs_needed(self.tokens_per_epoch, num_samples, seq_length)

        self.cache_key = _description_digest(self._description(seed))
        paths = self._cache_paths(cache_dir or os.path.dirname(os.path.abspath(indexed.prefix)))
        build = functools.partial(self._build_index, sequence_lengths, seed)
        arrays, self.index_was_built = _load_or_build_index(
            paths, build, self._index_is_valid, is_builder, build_barrier
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    @staticmethod
    def _validated_documents(documents: np.ndarray, num_indexed: int) -> np.ndarray:
        documents = np.asarray(documents)
        if documents.ndim != 1 or len(documents) == 0:
            raise ValueError(
                f"documents must be a non-empty 1-D array, got shape {documents.shape}"
            )
        if not np.issubdtype(documents.dtype, np.integer):
            raise ValueError(f"documents must hold integer ids, got dtype {documents.dtype}")
        if documents.min() < 0 or documents.max() >= num_indexed:
            raise ValueError(
                f"document ids must lie in [0, {num_indexed}), got "
                f"[{documents.min()}, {documents.max()}]"
            )
        return documents.astype(np.int64)

    def _description(self, seed: int) -> dict[str, Any]:
        """Everything the index arrays depend on; its hash names the cache files."""
        prefix = os.path.abspath(self.indexed.prefix)
        idx_stat = os.stat(index_file_path(prefix))
        return {
            "class": "GPTDataset",
            "format_version": INDEX_FORMAT_VERSION,
            "path_prefix": prefix,
            "idx_size": idx_stat.st_size,
            "idx_mtime_ns": idx_stat.st_mtime_ns,
            "documents_sha256": hashlib.sha256(self.documents.tobytes()).hexdigest(),
            "num_samples": self.num_samples,
            "seq_length": self.seq_length,
            "seed": seed,
        }

    def _cache_paths(self, directory: str) -> dict[str, str]:
        stem = f"{os.path.basename(self.indexed.prefix)}_{self.name}_{self.cache_key}"
        keys = ("document_index", "sample_index", "shuffle_index")
        return {key: os.path.join(directory, f"{stem}_{key}.npy") for key in keys}

    def _build_index(self, sequence_lengths: np.ndarray, seed: int) -> IndexArrays:
        start = time.perf_counter()
        rng = np.random.default_rng(seed)
        document_index = build_document_index(self.documents, self.num_epochs, rng)
        sample_index = build_sample_index(
            sequence_lengths, document_index, self.num_samples, self.seq_length
        )
        shuffle_index = rng.permutation(self.num_samples).astype(_index_dtype(self.num_samples))
        logger.info(
            "built %s index: %d samples, %d epochs, %d documents in %.2f s",
            self.name, self.num_samples, self.num_epochs, len(self.documents),
            time.perf_counter() - start,
        )
        return dict(
            document_index=document_index, sample_index=sample_index, shuffle_index=shuffle_index
        )

    def _index_is_valid(self, arrays: IndexArrays) -> bool:
        return (
            arrays["document_index"].shape == (self.num_epochs * len(self.documents),)
            and arrays["sample_index"].shape == (self.num_samples + 1, 2)
            and arrays["shuffle_index"].shape == (self.num_samples,)
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"{self.name}: index {index} out of range for {self.num_samples}")
        sample = int(self.shuffle_index[index])
        return {"text": self._sample_tokens(sample)}

    def _sample_tokens(self, sample: int) -> np.ndarray:
        """Tokens of sample `sample` (unshuffled order), seq_length + 1 of them."""
        first_position, first_offset = (int(v) for v in self.sample_index[sample])
        last_position, last_offset = (int(v) for v in self.sample_index[sample + 1])
        get, document_at = self.indexed.get, self.document_index
        if first_position == last_position:
            length = last_offset - first_offset + 1
            pieces = [get(int(document_at[first_position]), offset=first_offset, length=length)]
        else:
            pieces = [get(int(document_at[first_position]), offset=first_offset)]
            pieces += [get(int(document_at[p])) for p in range(first_position + 1, last_position)]
            pieces.append(get(int(document_at[last_position]), offset=0, length=last_offset + 1))
        return np.concatenate(pieces).astype(np.int64)


class BlendedDataset:
    """Several datasets interleaved in fixed proportions (see build_blending_indices).

    Item i is item dataset_sample_index[i] of datasets[dataset_index[i]]. The interleaving
    depends only on the weights and size; `seed` takes part in the cache identity so blends of
    differently seeded components never share cache files. With `cache_dir` None nothing is
    written to disk.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float],
        size: int,
        seed: int,
        cache_dir: str | None = None,
        build_barrier: Callable[[], None] | None = None,
        is_builder: bool = True,
    ) -> None:
        if len(datasets) == 0 or len(datasets) != len(weights):
            raise ValueError(
                f"blend needs one weight per dataset, got {len(datasets)} datasets and "
                f"{len(weights)} weights"
            )
        if any(not math.isfinite(w) or w <= 0 for w in weights):
            raise ValueError(f"blend weights must be positive, got {list(weights)}")
        if size < 1:
            raise ValueError(f"blend size must be >= 1, got {size}")
        total = float(sum(weights))
        self.datasets = list(datasets)
        self.weights = [float(w) / total for w in weights]
        self.size = size
        description = {
            "class": "BlendedDataset",
            "format_version": INDEX_FORMAT_VERSION,
            "weights": self.weights,
            "size": size,
            "seed": seed,
        }
        paths = None
        if cache_dir is not None:
            stem = os.path.join(cache_dir, f"blend_{_description_digest(description)}")
            paths = {key: f"{stem}_{key}.npy" for key in ("dataset_index", "dataset_sample_index")}
        arrays, self.index_was_built = _load_or_build_index(
            paths, self._build_index, self._index_is_valid, is_builder, build_barrier
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        self._check_components_are_large_enough()

    def _build_index(self) -> IndexArrays:
        dataset_index, dataset_sample_index = build_blending_indices(self.weights, self.size)
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    def _index_is_valid(self, arrays: IndexArrays) -> bool:
        return all(array.shape == (self.size,) for array in arrays.values())

    def _check_components_are_large_enough(self) -> None:
        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for number, (dataset, count) in enumerate(zip(self.datasets, needed, strict=True)):
            if len(dataset) < count:
                raise ValueError(
                    f"blend component {number} has {len(dataset)} samples but the blend of "
                    f"size {self.size} draws {count} from it"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not -self.size <= index < self.size:
            raise IndexError(f"blend index {index} out of range for {self.size}")
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index])]


class MockGPTDataset:
    """Megatron's ``--mock-data``: ``num_samples`` samples of random token ids, no files.

    Sample ``i`` is drawn from its own seeded generator, so it is the same on every rank and
    in every run, and any sample can be read without the others.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int) -> None:
        self.num_samples, self.seq_length = num_samples, seq_length
        self.vocab_size, self.seed = vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"mock data index {index} out of range for {self.num_samples}")
        rng = np.random.default_rng((self.seed, index))
        return {"text": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}


TrainingDataset = GPTDataset | BlendedDataset | MockGPTDataset


# -- Entry point used by the training script ------------------------------------------------------


def _open_indexed_dataset(prefix: str) -> IndexedDataset:
    bin_path, idx_path = data_file_path(prefix), index_file_path(prefix)
    missing = [path for path in (bin_path, idx_path) if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(
            f"data prefix {prefix!r} needs {bin_path} and {idx_path}; missing: "
            f"{', '.join(missing)}"
        )
    return IndexedDataset(prefix)


def _build_prefix_datasets(
    prefix: str,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int],
    cache_dir: str | None,
    build_barrier: Callable[[], None] | None,
    is_builder: bool,
) -> list[GPTDataset | None]:
    """train/valid/test GPTDatasets of one prefix; None where no samples are asked for."""
    indexed = _open_indexed_dataset(prefix)
    split_docs = split_documents(len(indexed), parse_split(split))
    datasets: list[GPTDataset | None] = []
    for name, documents, samples in zip(SPLIT_NAMES, split_docs, num_samples, strict=True):
        if samples <= 0:
            datasets.append(None)
            continue
        if len(documents) == 0:
            raise ValueError(
                f"the {name} split of {prefix!r} (split {split!r} over {len(indexed)} "
                f"documents) has no documents, but {samples} samples were requested"
            )
        datasets.append(
            GPTDataset(
                name, indexed, documents, samples, seq_length, seed, cache_dir,
                build_barrier=build_barrier, is_builder=is_builder,
            )
        )
    return datasets


def build_train_valid_test_datasets(
    data_path: list[str],
    split: str,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    build_barrier: Callable[[], None] | None = None,
    is_builder: bool = True,
) -> tuple[TrainingDataset | None, TrainingDataset | None, TrainingDataset | None]:
    """(train, valid, test) datasets from `--data-path` and `--split`; None for empty splits.

    A single prefix gives GPTDatasets; a weighted list gives BlendedDatasets whose components
    are each asked for size * weight * 1.005 samples.
    """
    if len(train_valid_test_num_samples) != 3 or any(n < 0 for n in train_valid_test_num_samples):
        raise ValueError(
            "train_valid_test_num_samples must be three counts >= 0, got "
            f"{train_valid_test_num_samples}"
        )
    prefixes, weights = parse_data_path(data_path)
    if len(prefixes) == 1:
        train, valid, test = _build_prefix_datasets(
            prefixes[0], split, seq_length, seed, train_valid_test_num_samples,
            cache_dir, build_barrier, is_builder,
        )
        return train, valid, test

    per_prefix = [
        _build_prefix_datasets(
            prefix, split, seq_length, seed,
            [math.ceil(n * weight * BLEND_SAMPLE_MARGIN) for n in train_valid_test_num_samples],
            cache_dir, build_barrier, is_builder,
        )
        for prefix, weight in zip(prefixes, weights, strict=True)
    ]
    blend_cache_dir = cache_dir or os.path.dirname(os.path.abspath(prefixes[0]))
    blends: list[BlendedDataset | None] = []
    for split_number, size in enumerate(train_valid_test_num_samples):
        if size == 0:
            blends.append(None)
            continue
        components = [datasets[split_number] for datasets in per_prefix]
        blends.append(
            BlendedDataset(
                components, weights, size, seed, blend_cache_dir,
                build_barrier=build_barrier, is_builder=is_builder,
            )
        )
    return blends[0], blends[1], blends[2]
