"""GPT dataset, split, blend and sampler against hand-built corpora and reference walks.

Token values encode their origin (document d, position j -> 1000 * d + j + 1), so any token
out of place, missing or duplicated shows up as a wrong value, not just a wrong count.
"""

from __future__ import annotations

import glob
import math
import os

import numpy as np
import pytest
import torch

from data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    build_blending_indices,
    build_sample_index,
    build_train_valid_test_datasets,
    parse_data_path,
    parse_split,
    split_documents,
)
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from data.samplers import (
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
    get_batch,
)

# 11 documents, 70 tokens: with seq_length 3 one epoch is exactly (70 - 1) / 3 = 23 samples.
DOC_LENGTHS = [5, 1, 9, 4, 12, 7, 3, 8, 6, 2, 13]


def document_tokens(doc: int, length: int, base: int = 0) -> list[int]:
    return [base + 1000 * doc + j + 1 for j in range(length)]


def write_corpus(prefix: str, lengths: list[int], base: int = 0) -> list[list[int]]:
    documents = [document_tokens(d, n, base) for d, n in enumerate(lengths)]
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        for tokens in documents:
            builder.add_document(tokens)
    return documents


@pytest.fixture
def corpus(tmp_path) -> tuple[str, list[list[int]]]:
    prefix = str(tmp_path / "corpus")
    return prefix, write_corpus(prefix, DOC_LENGTHS)


def make_dataset(prefix: str, documents=None, num_samples=23, seq_length=3, seed=7,
                 cache_dir=None, name="train", **kwargs) -> GPTDataset:
    indexed = IndexedDataset(prefix)
    if documents is None:
        documents = np.arange(len(indexed))
    return GPTDataset(name, indexed, np.asarray(documents), num_samples, seq_length, seed,
                      cache_dir, **kwargs)


def samples_in_stream_order(dataset: GPTDataset) -> list[np.ndarray]:
    """Items reordered so that entry k is sample k (undoing the shuffle index)."""
    position_of_sample = np.argsort(np.asarray(dataset.shuffle_index))
    return [dataset[int(position)]["text"] for position in position_of_sample]


def expected_stream(dataset: GPTDataset, documents: list[list[int]]) -> np.ndarray:
    return np.concatenate([documents[int(d)] for d in dataset.document_index])


def cache_files(directory) -> list[str]:
    return sorted(glob.glob(os.path.join(str(directory), "*_index.npy")))


# ------------------------------------------------------------------------ sample construction


def test_one_epoch_reproduces_the_shuffled_document_stream(corpus):
    prefix, documents = corpus
    dataset = make_dataset(prefix)
    assert len(dataset) == 23 and dataset.num_epochs == 1
    assert sorted(dataset.document_index.tolist()) == list(range(len(DOC_LENGTHS)))
    assert dataset.document_index.tolist() != list(range(len(DOC_LENGTHS)))

    samples = samples_in_stream_order(dataset)
    stream = expected_stream(dataset, documents)
    for k, sample in enumerate(samples):
        assert sample.dtype == np.int64 and sample.shape == (4,)
        np.testing.assert_array_equal(sample, stream[3 * k: 3 * k + 4])
    for current, following in zip(samples, samples[1:], strict=False):
        assert current[-1] == following[0]

    covered = np.concatenate([s[:3] for s in samples] + [samples[-1][-1:]])
    np.testing.assert_array_equal(covered, stream)
    assert sorted(covered.tolist()) == sorted(t for doc in documents for t in doc)


def test_items_follow_the_shuffle_index(corpus):
    prefix, documents = corpus
    dataset = make_dataset(prefix)
    shuffle = np.asarray(dataset.shuffle_index)
    assert sorted(shuffle.tolist()) == list(range(23))
    assert shuffle.tolist() != list(range(23))
    stream = expected_stream(dataset, documents)
    for i in range(len(dataset)):
        k = int(shuffle[i])
        np.testing.assert_array_equal(dataset[i]["text"], stream[3 * k: 3 * k + 4])
    with pytest.raises(IndexError):
        dataset[23]


def test_deterministic_per_seed_and_different_across_seeds(corpus, tmp_path):
    prefix, _ = corpus
    first = make_dataset(prefix, seed=11, cache_dir=str(tmp_path / "a"))
    again = make_dataset(prefix, seed=11, cache_dir=str(tmp_path / "b"))
    other = make_dataset(prefix, seed=12, cache_dir=str(tmp_path / "c"))
    assert again.index_was_built
    items = [first[i]["text"].tolist() for i in range(len(first))]
    assert items == [again[i]["text"].tolist() for i in range(len(again))]
    assert items != [other[i]["text"].tolist() for i in range(len(other))]


def test_multiple_epochs_cover_every_document_once_per_epoch(corpus):
    prefix, documents = corpus
    num_samples = 80  # 80 * 3 + 1 = 241 tokens: 4 epochs of 70
    dataset = make_dataset(prefix, num_samples=num_samples)
    assert dataset.num_epochs == 4 and len(dataset) == num_samples
    epochs = np.asarray(dataset.document_index).reshape(4, len(DOC_LENGTHS))
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(len(DOC_LENGTHS)))
    assert len({tuple(epoch) for epoch in epochs}) > 1
    stream = expected_stream(dataset, documents)
    for k, sample in enumerate(samples_in_stream_order(dataset)):
        np.testing.assert_array_equal(sample, stream[3 * k: 3 * k + 4])


def test_split_subset_uses_only_its_documents(corpus):
    prefix, documents = corpus
    split = np.array([3, 4, 5, 6])  # 4 + 12 + 7 + 3 = 26 tokens
    dataset = make_dataset(prefix, documents=split, num_samples=5, seq_length=5)
    assert sorted(dataset.document_index.tolist()) == split.tolist()
    allowed = {t for d in split for t in documents[d]}
    for i in range(len(dataset)):
        assert set(dataset[i]["text"].tolist()) <= allowed


def test_empty_documents_are_skipped(tmp_path):
    prefix = str(tmp_path / "gaps")
    documents = write_corpus(prefix, [0, 4, 0, 0, 5, 0, 3])
    dataset = make_dataset(prefix, num_samples=5, seq_length=2)
    stream = expected_stream(dataset, documents)
    for k, sample in enumerate(samples_in_stream_order(dataset)):
        np.testing.assert_array_equal(sample, stream[2 * k: 2 * k + 3])


def reference_sample_index(lengths, document_index, num_samples, seq_length):
    """Megatron's token-by-token walk, transcribed as a plain loop."""
    rows, position, offset = [(0, 0)], 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            available = lengths[document_index[position]] - offset
            remaining -= available
            if remaining <= 0:
                offset += remaining + available - 1
                remaining = 0
            else:
                position, offset = position + 1, 0
        rows.append((position, offset))
    return np.array(rows)


@pytest.mark.parametrize("seq_length", [1, 4, 17, 64])
def test_vectorised_sample_index_matches_megatron_walk(seq_length):
    rng = np.random.default_rng(seq_length)
    lengths = rng.integers(1, 40, size=300).astype(np.int32)
    document_index = np.concatenate([rng.permutation(300) for _ in range(3)])
    num_samples = (int(lengths.sum()) * 3 - 1) // seq_length
    built = build_sample_index(lengths, document_index, num_samples, seq_length)
    reference = reference_sample_index(lengths, document_index, num_samples, seq_length)
    np.testing.assert_array_equal(built, reference)


# ------------------------------------------------------------------------------------- caching


def test_cache_is_reused_then_rebuilt_when_the_data_changes(corpus, tmp_path):
    prefix, _ = corpus
    first = make_dataset(prefix)
    files = cache_files(tmp_path)
    assert first.index_was_built and len(files) == 3
    assert not glob.glob(str(tmp_path / ".*tmp"))
    mtimes = [os.stat(f).st_mtime_ns for f in files]

    reused = make_dataset(prefix)
    assert not reused.index_was_built
    assert isinstance(reused.sample_index, np.memmap)
    assert [os.stat(f).st_mtime_ns for f in files] == mtimes
    assert [reused[i]["text"].tolist() for i in range(23)] == \
        [first[i]["text"].tolist() for i in range(23)]

    new_documents = write_corpus(prefix, DOC_LENGTHS, base=500)
    changed = make_dataset(prefix)
    assert changed.index_was_built and changed.cache_key != first.cache_key
    stream = expected_stream(changed, new_documents)
    np.testing.assert_array_equal(samples_in_stream_order(changed)[0], stream[:4])


def test_any_changed_parameter_gets_its_own_cache(corpus, tmp_path):
    prefix, _ = corpus
    make_dataset(prefix)
    for changed in ({"seed": 8}, {"num_samples": 22}, {"seq_length": 2},
                    {"documents": np.arange(10)}, {"name": "valid"}):
        assert make_dataset(prefix, **changed).index_was_built, changed
    assert len(cache_files(tmp_path)) == 3 * 6


def test_corrupt_cache_is_rebuilt(corpus, tmp_path):
    prefix, _ = corpus
    make_dataset(prefix)
    sample_file = [f for f in cache_files(tmp_path) if f.endswith("_sample_index.npy")][0]
    with open(sample_file, "wb") as handle:
        handle.write(b"not an array")
    rebuilt = make_dataset(prefix)
    assert rebuilt.index_was_built
    assert np.load(sample_file, allow_pickle=False).shape == (24, 2)


def test_cache_dir_holds_the_index_files(corpus, tmp_path):
    prefix, _ = corpus
    make_dataset(prefix, cache_dir=str(tmp_path / "cache"))
    assert len(cache_files(tmp_path / "cache")) == 3 and cache_files(tmp_path) == []


def test_non_builder_waits_for_the_builder_then_loads(corpus, tmp_path):
    prefix, _ = corpus
    calls: list[str] = []

    def barrier_after_builder() -> None:
        calls.append("barrier")
        builder = make_dataset(prefix, is_builder=True)  # what rank 0 does meanwhile
        assert builder.index_was_built

    follower = make_dataset(prefix, is_builder=False, build_barrier=barrier_after_builder)
    assert calls == ["barrier"] and not follower.index_was_built

    lonely_dir = tmp_path / "node_local"
    lonely = make_dataset(prefix, cache_dir=str(lonely_dir), is_builder=False,
                          build_barrier=lambda: None)
    assert lonely.index_was_built and not lonely_dir.exists()
    assert lonely[0]["text"].tolist() == follower[0]["text"].tolist()


# ------------------------------------------------------------------------------- split parsing


def test_parse_split_normalises_and_pads():
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.030, 0.001))
    assert parse_split("98,2,0") == pytest.approx((0.98, 0.02, 0.0))
    assert parse_split("1") == (1.0, 0.0, 0.0)
    assert parse_split("3/1") == pytest.approx((0.75, 0.25, 0.0))


@pytest.mark.parametrize("bad", ["", "1,2,3,4", "a,b", "-1,2", "0,0,0", "nan"])
def test_parse_split_rejects_bad_strings(bad):
    with pytest.raises(ValueError, match="split"):
        parse_split(bad)


@pytest.mark.parametrize("num_docs, split, expected", [
    (1000, "969,30,1", [(0, 969), (969, 999), (999, 1000)]),
    (10, "98,2,0", [(0, 10), (10, 10), (10, 10)]),
    (7, "1,1,1", [(0, 3), (3, 5), (5, 7)]),  # round(7/3) = 2 thrice: one doc of surplus
    (7, "0,1,1", [(0, 0), (0, 3), (3, 7)]),  # round(3.5) = 4 twice: clamped at zero
    (1, "1", [(0, 1), (1, 1), (1, 1)]),
])
def test_split_documents_follows_megatron_rounding(num_docs, split, expected):
    splits = split_documents(num_docs, parse_split(split))
    assert [s.tolist() for s in splits] == [list(range(a, b)) for a, b in expected]


def test_split_documents_always_partitions_every_document():
    rng = np.random.default_rng(0)
    for _ in range(200):
        num_docs = int(rng.integers(0, 50))
        weights = rng.random(3) * (rng.random(3) > 0.3) + 1e-9
        splits = split_documents(num_docs, tuple(weights / weights.sum()))
        np.testing.assert_array_equal(np.concatenate(splits), np.arange(num_docs))


# ----------------------------------------------------------------------------------- blending


def test_parse_data_path():
    assert parse_data_path(["A"]) == (["A"], [1.0])
    prefixes, weights = parse_data_path(["0.3", "A", "0.7", "B"])
    assert prefixes == ["A", "B"] and weights == pytest.approx([0.3, 0.7])
    assert parse_data_path(["2", "A", "6", "B"])[1] == pytest.approx([0.25, 0.75])


@pytest.mark.parametrize("bad, message", [
    ([], "empty"),
    (["0.3", "A", "B"], "pairs"),
    (["x", "A", "0.7", "B"], "'x'.*not a number"),
    (["-0.3", "A", "0.7", "B"], "must be > 0"),
    (["0", "A", "1", "B"], "must be > 0"),
])
def test_parse_data_path_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_data_path(bad)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.5], [0.1, 0.2, 0.3, 0.4],
                                     [0.01, 0.98, 0.01], [1 / 3, 1 / 3, 1 / 3]])
def test_blending_proportions_within_one_sample_at_every_prefix(weights):
    size = 5000
    dataset_index, dataset_sample_index = build_blending_indices(weights, size)
    positions = np.arange(1, size + 1)
    for number, weight in enumerate(weights):
        picked = dataset_index == number
        realised = np.cumsum(picked)
        assert np.abs(realised - weight * positions).max() <= 1.0
        np.testing.assert_array_equal(dataset_sample_index[picked], np.arange(picked.sum()))


def test_random_blends_stay_within_one_sample():
    rng = np.random.default_rng(1)
    for _ in range(20):
        weights = rng.random(int(rng.integers(2, 9))) ** 3 + 1e-3
        dataset_index, _ = build_blending_indices(weights, 3000)
        realised = np.cumsum(dataset_index[:, None] == np.arange(len(weights)), axis=0)
        ideal = np.arange(1, 3001)[:, None] * (weights / weights.sum())
        assert np.abs(realised - ideal).max() < 1.0


def megatron_greedy(weights, size):
    """Megatron's rule: the dataset lagging furthest behind weight * max(n, 1), first on ties."""
    counts, order = np.zeros(len(weights)), []
    for position in range(size):
        chosen = int(np.argmax(np.asarray(weights) * max(position, 1) - counts))
        order.append(chosen)
        counts[chosen] += 1
    return np.array(order)


# Weights without exact ties (weight * n an integer for both) in the first 2000 positions,
# where the two rules may legitimately pick different datasets; equal weights tie the same way.
@pytest.mark.parametrize("weights", [[0.3711, 0.6289], [1 / math.pi, 1 - 1 / math.pi], [0.5, 0.5]])
def test_two_dataset_blend_matches_megatron_greedy(weights):
    dataset_index, _ = build_blending_indices(weights, 2000)
    np.testing.assert_array_equal(dataset_index, megatron_greedy(weights, 2000))


def test_blending_weight_errors():
    with pytest.raises(ValueError, match="positive"):
        build_blending_indices([0.5, -0.5], 10)
    with pytest.raises(ValueError, match="positive"):
        build_blending_indices([], 10)


def test_blended_dataset_draws_items_from_the_right_component(tmp_path):
    components = [[f"a{i}" for i in range(40)], [f"b{i}" for i in range(70)]]
    blend = BlendedDataset(components, [0.4, 0.6], size=100, seed=1)
    assert blend.index_was_built and len(blend) == 100
    items = [blend[i] for i in range(100)]
    assert items[:5] == ["b0", "a0", "b1", "a1", "b2"]  # position 0 counts as 1
    assert sum(item.startswith("a") for item in items) == 40
    assert [item for item in items if item.startswith("b")] == components[1][:60]

    cached = BlendedDataset(components, [0.4, 0.6], 100, 1, cache_dir=str(tmp_path))
    again = BlendedDataset(components, [0.4, 0.6], 100, 1, cache_dir=str(tmp_path))
    assert cached.index_was_built and not again.index_was_built
    assert [again[i] for i in range(100)] == items


def test_blended_dataset_errors():
    with pytest.raises(ValueError, match="component 0 has 10 samples"):
        BlendedDataset([list(range(10)), list(range(90))], [0.5, 0.5], size=100, seed=0)
    with pytest.raises(ValueError, match="one weight per dataset"):
        BlendedDataset([[1], [2]], [1.0], size=1, seed=0)
    with pytest.raises(ValueError, match="positive"):
        BlendedDataset([[1], [2]], [1.0, 0.0], size=1, seed=0)


# ------------------------------------------------------------------- train/valid/test builder


def test_build_single_prefix_splits_by_documents(corpus):
    prefix, documents = corpus
    train, valid, test = build_train_valid_test_datasets(
        [prefix], "8,2,1", seq_length=3, seed=5, train_valid_test_num_samples=(30, 4, 0))
    assert test is None
    # round(8), round(2), round(1) of 11 documents: [0, 8), [8, 10), [10, 11)
    assert sorted(train.document_index[:8].tolist()) == list(range(8))
    assert sorted(valid.document_index[:2].tolist()) == [8, 9]
    assert len(train) == 30 and len(valid) == 4
    valid_tokens = set(documents[8] + documents[9])
    assert all(set(valid[i]["text"].tolist()) <= valid_tokens for i in range(4))


def test_build_blend_gives_margin_and_exact_proportions(tmp_path):
    prefix_a, prefix_b = str(tmp_path / "a"), str(tmp_path / "b")
    write_corpus(prefix_a, DOC_LENGTHS * 4)
    write_corpus(prefix_b, DOC_LENGTHS * 4, base=100_000)
    train, valid, test = build_train_valid_test_datasets(
        ["0.3", prefix_a, "0.7", prefix_b], "1", seq_length=4, seed=3,
        train_valid_test_num_samples=(200, 0, 0), cache_dir=str(tmp_path / "cache"))
    assert valid is None and test is None and len(train) == 200
    assert [len(d) for d in train.datasets] == [math.ceil(200 * w * 1.005) for w in (0.3, 0.7)]
    from_b = np.array([train[i]["text"][0] > 100_000 for i in range(200)])
    assert np.abs(np.cumsum(from_b) - 0.7 * np.arange(1, 201)).max() <= 1.0


@pytest.mark.parametrize("counts", [(1, 0), (1, -1, 0)])
def test_sample_counts_must_be_three_non_negative(corpus, counts):
    prefix, _ = corpus
    with pytest.raises(ValueError, match="train_valid_test_num_samples"):
        build_train_valid_test_datasets([prefix], "1", 3, 0, counts)


def test_missing_prefix_names_both_files(tmp_path):
    prefix = str(tmp_path / "absent")
    with pytest.raises(FileNotFoundError) as error:
        build_train_valid_test_datasets([prefix], "1", 3, 0, (1, 0, 0))
    assert prefix + ".bin" in str(error.value) and prefix + ".idx" in str(error.value)


def test_empty_split_asked_for_samples(corpus):
    prefix, _ = corpus
    with pytest.raises(ValueError, match="valid split .* has no documents, but 3 samples"):
        build_train_valid_test_datasets([prefix], "100,0,0", 3, 0, (5, 3, 0))


def test_too_few_tokens_for_one_sample(corpus):
    prefix, _ = corpus
    with pytest.raises(ValueError, match="hold 6 tokens, fewer than one sample"):
        make_dataset(prefix, documents=[1, 9, 6], num_samples=1, seq_length=6)
    make_dataset(prefix, documents=[1, 9, 6], num_samples=4, seq_length=5)  # 6 tokens suffice


@pytest.mark.parametrize("kwargs, message", [
    ({"documents": []}, "non-empty"),
    ({"documents": [0, 11]}, r"\[0, 11\)"),
    ({"documents": [0.5]}, "integer ids"),
    ({"num_samples": 0}, "num_samples"),
    ({"seq_length": 0}, "seq_length"),
])
def test_gpt_dataset_argument_errors(corpus, kwargs, message):
    prefix, _ = corpus
    with pytest.raises(ValueError, match=message):
        make_dataset(prefix, **kwargs)


# ------------------------------------------------------------------------------------ sampler


def test_ranks_partition_each_global_batch():
    micro, world, total = 2, 3, 40
    per_rank = [list(MegatronPretrainingSampler(total, 0, micro, rank, world))
                for rank in range(world)]
    assert all(len(steps) == total // (micro * world) for steps in per_rank)
    for step, batches in enumerate(zip(*per_rank, strict=True)):
        start = step * micro * world
        for rank, batch in enumerate(batches):
            assert batch == list(range(start + rank * micro, start + (rank + 1) * micro))


@pytest.mark.parametrize("consumed", [6, 12, 7])
def test_resume_yields_the_tail_of_the_uninterrupted_run(consumed):
    uninterrupted = list(MegatronPretrainingSampler(50, 0, 2, 1, 3))
    resumed = list(MegatronPretrainingSampler(50, consumed, 2, 1, 3))
    if consumed % 6 == 0:
        assert resumed == uninterrupted[consumed // 6:]
    else:  # a resume mid-batch shifts the grouping but still starts at `consumed`
        assert resumed[0] == [consumed + 2, consumed + 3]
    assert len(resumed) == len(MegatronPretrainingSampler(50, consumed, 2, 1, 3))


def test_sampler_keeps_the_partial_last_batch_without_drop_last():
    # 10 samples, global batch 4: the tail [8, 9] goes to rank 0 only.
    tails = [list(MegatronPretrainingSampler(10, 0, 2, rank, 2, drop_last=False))
             for rank in range(2)]
    assert tails[0] == [[0, 1], [4, 5], [8, 9]] and tails[1] == [[2, 3], [6, 7]]
    assert [len(MegatronPretrainingSampler(10, 0, 2, r, 2, drop_last=False))
            for r in range(2)] == [3, 2]


@pytest.mark.parametrize("args, message", [
    ((0, 0, 1, 0, 1), "total_samples"),
    ((10, -1, 1, 0, 1), "consumed_samples"),
    ((10, 10, 1, 0, 1), "consumed_samples .* below total_samples"),
    ((10, 0, 0, 0, 1), "micro_batch_size"),
    ((10, 0, 1, 0, 0), "data_parallel_size"),
    ((10, 0, 1, 2, 2), "data_parallel_rank .* below"),
    ((10, 0, 1, -1, 2), "data_parallel_rank"),
    ((10, 0, 1.5, 0, 1), "micro_batch_size"),
])
def test_sampler_argument_errors(args, message):
    with pytest.raises(ValueError, match=message):
        MegatronPretrainingSampler(*args)


def test_data_loader_stacks_this_ranks_samples(corpus):
    prefix, _ = corpus
    dataset = make_dataset(prefix)
    loader = build_pretraining_data_loader(dataset, consumed_samples=4, micro_batch_size=2,
                                           dp_rank=1, dp_size=2)
    batches = list(loader)
    assert len(batches) == (23 - 4) // 4
    for step, batch in enumerate(batches):
        assert batch.dtype == torch.long and batch.shape == (2, 4)
        first = 4 + step * 4 + 2
        expected = np.stack([dataset[first]["text"], dataset[first + 1]["text"]])
        np.testing.assert_array_equal(batch.numpy(), expected)
    assert build_pretraining_data_loader(None, 0, 2, 0, 1) is None


def test_data_loader_workers_give_the_same_batches(corpus):
    prefix, _ = corpus
    dataset = make_dataset(prefix)
    in_process = list(build_pretraining_data_loader(dataset, 0, 3, 0, 2))
    with_worker = list(build_pretraining_data_loader(dataset, 0, 3, 0, 2, num_workers=1))
    assert len(in_process) == len(with_worker) == 3
    for a, b in zip(in_process, with_worker, strict=True):
        assert torch.equal(a, b)


def test_get_batch_shifts_labels_by_one():
    text = torch.arange(10).reshape(2, 5)
    tokens, labels, loss_mask, position_ids = get_batch(text)
    assert tokens.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]]
    assert labels.tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]]
    assert loss_mask.dtype == torch.float and loss_mask.tolist() == [[1.0] * 4] * 2
    assert position_ids.tolist() == [[0, 1, 2, 3]] * 2
    with pytest.raises(ValueError, match="shape"):
        get_batch(torch.arange(5))
    with pytest.raises(ValueError, match="LongTensor"):
        get_batch(text.int())
