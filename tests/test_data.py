"""worker.data: embedded corpus, loading, island splits, samplers and evaluation batches."""

import gzip
import zlib

import numpy as np
import pytest

from worker import data


def _windows(arr, width=16):
    raw = arr.tobytes()
    return {raw[i : i + width] for i in range(len(raw) - width + 1)}


@pytest.fixture(scope="module")
def random_corpus():
    # Random bytes: every 16-byte window occurs once, so shared windows mean shared text.
    return np.random.default_rng(0).integers(0, 256, 60_000).astype(np.uint8).tobytes()


def test_default_corpus_is_real_text_available_offline():
    corpus = data.default_corpus()
    assert len(corpus) > 1_000_000
    text = corpus.decode("utf-8")
    assert "HAMLET:" in text and "MACBETH:" in text
    assert "**" not in text and "\\[" not in text
    assert data.load_corpus() == corpus


def test_load_corpus_from_file_gzip_and_directory(tmp_path):
    a, b = b"a" * 1500 + b"\n", b"b" * 700
    (tmp_path / "one.txt").write_bytes(a)
    (tmp_path / "two.txt.gz").write_bytes(gzip.compress(b))
    (tmp_path / ".hidden").write_bytes(b"x" * 5000)
    assert data.load_corpus(tmp_path / "one.txt") == a
    assert data.load_corpus(str(tmp_path)) == a + b"\n" + b
    big = tmp_path / "big.txt.gz"
    big.write_bytes(gzip.compress(b"z" * 2000))
    assert data.load_corpus(big) == b"z" * 2000


def test_load_corpus_errors_name_the_path(tmp_path):
    with pytest.raises(data.DataError, match="does not exist"):
        data.load_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DataError, match="no files"):
        data.load_corpus(tmp_path / "empty")
    (tmp_path / "small.txt").write_bytes(b"to be")
    with pytest.raises(data.DataError, match="small.txt.*5 bytes"):
        data.load_corpus(tmp_path / "small.txt")


def test_split_is_disjoint_covering_and_deterministic(random_corpus):
    n_islands = 3
    splits = [data.split_corpus(random_corpus, n_islands, i, 0.1) for i in range(n_islands)]
    heldout = splits[0][1]
    assert all(np.array_equal(h, heldout) for _, h in splits)
    shards = [s for s, _ in splits]
    assert sum(len(s) for s in shards) + len(heldout) == len(random_corpus)
    assert abs(len(heldout) - 0.1 * len(random_corpus)) < 20
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
    parts = [*shards, heldout]
    windows = [_windows(p) for p in parts]
    for i in range(len(parts)):
        for j in range(i + 1, len(parts)):
            assert not windows[i] & windows[j], (i, j)
    again = data.split_corpus(random_corpus, n_islands, 1, 0.1)
    assert np.array_equal(again[0], shards[1]) and np.array_equal(again[1], heldout)
    assert shards[0].dtype == np.uint8 and heldout.dtype == np.uint8


def test_heldout_samples_the_whole_corpus():
    corpus = data.default_corpus()
    _, heldout = data.split_corpus(corpus, 2, 0)
    text = heldout.tobytes()
    # Speakers from the first and the last play both appear in the held-out text.
    assert b"HAMLET:" in text and b"PROSPERO:" in text


@pytest.mark.parametrize(
    ("args", "word"),
    [
        ((0, 0, 0.05), "num_islands"),
        ((2, 2, 0.05), "island_index=2"),
        ((2, -1, 0.05), "island_index"),
        ((2, 0, 0.0), "heldout_fraction"),
        ((2, 0, 0.7), "heldout_fraction"),
        ((1000, 0, 0.05), "too small"),
    ],
)
def test_split_rejects_bad_arguments(args, word):
    with pytest.raises(data.DataError, match=word):
        data.split_corpus(b"x" * 2000, *args)


def test_split_rejects_data_that_is_not_token_ids():
    with pytest.raises(data.DataError, match="integer array.*float32"):
        data.split_corpus(np.zeros(5000, np.float32), 1, 0)
    with pytest.raises(data.DataError, match="integer array.*shape \\(50, 100\\)"):
        data.split_corpus(np.zeros((50, 100), np.uint16), 1, 0)


def test_sampler_is_deterministic_from_seed_and_cuts_real_windows(random_corpus):
    first = data.BatchSampler(random_corpus, 4, 32, seed=5)
    second = data.BatchSampler(random_corpus, 4, 32, seed=5)
    other = data.BatchSampler(random_corpus, 4, 32, seed=6)
    a = [first.next() for _ in range(3)]
    b = [next(second) for _ in range(3)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], other.next())
    assert not np.array_equal(a[0], a[1])
    assert a[0].shape == (4, 33) and a[0].dtype == np.int32
    for row in a[0]:
        assert row.astype(np.uint8).tobytes() in random_corpus


def test_sampler_reaches_both_ends_of_short_data():
    text = np.arange(10, dtype=np.uint8)
    sampler = data.BatchSampler(text, 64, 8, seed=0)
    firsts = {int(x) for x in sampler.next()[:, 0]}
    assert firsts == {0, 1}


def test_eval_batches_are_deterministic_and_span_the_text(random_corpus):
    heldout = np.frombuffer(random_corpus, np.uint8)[:5000]
    batches = data.eval_batches(heldout, 4, 32, 3)
    again = data.eval_batches(heldout, 4, 32, 3)
    assert len(batches) == 3
    assert all(b.shape == (4, 33) and b.dtype == np.int32 for b in batches)
    assert all(np.array_equal(x, y) for x, y in zip(batches, again, strict=True))
    assert np.array_equal(batches[0][0], heldout[:33])
    assert np.array_equal(batches[-1][-1], heldout[-33:])


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"batch": 0}, "batch"),
        ({"seq_len": 0}, "seq_len"),
        ({"seq_len": 100}, "seq_len \\+ 1 = 101"),
        ({"seed": -1}, "seed"),
    ],
)
def test_sampler_rejects_bad_arguments(kwargs, word):
    args = {"data": b"y" * 50, "batch": 2, "seq_len": 8, "seed": 0, **kwargs}
    with pytest.raises(data.DataError, match=word):
        data.BatchSampler(**args)


def test_eval_batches_reject_bad_arguments():
    with pytest.raises(data.DataError, match="count"):
        data.eval_batches(b"y" * 50, 2, 8, 0)
    with pytest.raises(data.DataError, match="heldout has 5 tokens"):
        data.eval_batches(b"y" * 5, 2, 8, 1)


def test_unigram_entropy_of_known_distributions_and_the_corpus():
    assert data.unigram_entropy(b"aaaa") == 0.0
    assert abs(data.unigram_entropy(bytes(range(256))) - np.log(256)) < 1e-12
    assert 3.0 < data.unigram_entropy(data.default_corpus()) < 3.6


@pytest.mark.timeout(60)
def test_island_data_is_the_islands_shard_and_the_common_heldout_set():
    from worker.config import IslandConfig
    from worker.data import data_shard_of, island_data

    assert data_shard_of("x", 3, 8) == 3
    assert data_shard_of("island-1", -1, 8) == zlib.crc32(b"island-1") % 8
    a = island_data(IslandConfig(island="a", data_dir="/tmp/unused", batch_size=2, seq_len=16,
                                 eval_batches=2, data_shard=0))  # fmt: skip
    b = island_data(IslandConfig(island="b", data_dir="/tmp/unused", batch_size=2, seq_len=16,
                                 eval_batches=2, data_shard=1))  # fmt: skip
    assert a.seed == zlib.crc32(b"a") ^ 0 and a.seed != b.seed
    assert len(a.eval_set) == 2  # the held-out set is the same for every island
    for x, y in zip(a.eval_set, b.eval_set, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.sampler.next(), b.sampler.next())  # different shards
