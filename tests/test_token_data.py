"""Token files as data: flat uint16/uint32 .bin and .npy arrays, memory-mapped, with a vocab."""

import argparse
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from paramserver.plumbing import settings
from worker import data
from worker.config import IslandConfig, IslandConfigError

pytestmark = pytest.mark.timeout(120)


def _cfg(path, **kw):
    base = {"island": "a", "data_dir": "/tmp/unused", "batch_size": 4, "seq_len": 16}
    return IslandConfig(data=str(path), **{**base, **kw})


def _heldout_positions(n, fraction=0.05):
    """The held-out positions by the rule in DESIGN.md: the tail of each of 16 segments."""
    held = set()
    for s in range(16):
        start, stop = n * s // 16, n * (s + 1) // 16
        held.update(range(stop - int(round((stop - start) * fraction)), stop))
    return held


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_bin_file_is_memory_mapped_split_and_sampled_by_position(tmp_path, dtype):
    n = 40_000  # every id is its own position, so a sampled id says where it came from
    path = tmp_path / "train.bin"
    np.arange(n, dtype=dtype).tofile(path)
    tokens = data.load_tokens(path, dtype, vocab_size=n)
    assert isinstance(tokens, np.memmap) and tokens.dtype == dtype and len(tokens) == n
    own = data.island_data(_cfg(path, data_dtype=dtype, vocab_size=n, data_shards=2, data_shard=1))
    assert isinstance(own.sampler.tokens.base, np.memmap)
    held = _heldout_positions(n)
    train_half = sorted(set(range(n)) - held)[len(set(range(n)) - held) // 2 :]  # shard 1 of 2
    for _ in range(20):
        batch = own.sampler.next()
        assert batch.shape == (4, 17) and batch.dtype == np.int32
        assert set(batch.ravel().tolist()) <= set(train_half)
        for row in batch:  # a window is consecutive training positions (it may skip held-out)
            positions = [train_half.index(int(i)) for i in row]
            assert positions == list(range(positions[0], positions[0] + 17))
    eval_ids = {int(i) for b in own.eval_set for i in b.ravel()}
    assert eval_ids <= held and min(eval_ids) < n // 16 and max(eval_ids) == n - 1


def test_a_npy_array_of_any_integer_type_is_memory_mapped(tmp_path):
    ids = np.random.default_rng(0).integers(0, 1000, 5000)  # int64, as np.save writes lists
    path = tmp_path / "tokens.npy"
    np.save(path, ids)
    tokens = data.load_tokens(path, vocab_size=1000)
    assert isinstance(tokens, np.memmap)
    np.testing.assert_array_equal(tokens, ids)
    train, heldout = data.split_tokens(tokens, 1, 0)
    assert train.base is tokens and heldout.base is tokens
    assert len(train) + len(heldout) == 5000
    both = np.concatenate([train.to_array(), heldout.to_array()])
    np.testing.assert_array_equal(np.sort(both), np.sort(ids))


def test_loading_and_sampling_a_token_file_never_copies_it_whole(tmp_path):
    n = 8 << 20  # 32 MiB of uint32 ids
    path = tmp_path / "big.bin"
    np.arange(n, dtype=np.uint32).tofile(path)
    tracemalloc.start()
    try:
        own = data.island_data(_cfg(path, data_dtype="uint32", vocab_size=n, data_shards=4))
        own.sampler.next()
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (n * 4) // 4, f"peak {peak} bytes: the file was copied"


def _write_bin(path, ids, dtype="uint16"):
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


@pytest.mark.parametrize(
    ("make", "settings_kw", "words"),
    [
        (lambda p: p.with_suffix(".bin").write_bytes(b"\0" * 2049), {}, "2049 bytes.*multiple of 2"),
        (lambda p: p.with_suffix(".bin").write_bytes(b"\0" * 4098), {"data_dtype": "uint32"},
         "not a multiple of 4.*--data-dtype"),
        (lambda p: p.with_suffix(".bin").write_bytes(b""), {}, "is empty"),
        (lambda p: _write_bin(p.with_suffix(".bin"), [0] * 5 + [300] + [0] * 2000), {},
         "token id 300 at position 5.*\\[0, 256\\).*--vocab-size 301"),
        (lambda p: _write_bin(p.with_suffix(".bin"), [1] * 100), {}, "100 tokens; at least 1024"),
        (lambda p: np.save(p.with_suffix(".npy"), np.zeros(0, np.uint16)), {}, "is empty"),
        (lambda p: np.save(p.with_suffix(".npy"), np.zeros(3000, np.float32)), {},
         "float32 values, not integer token ids"),
        (lambda p: np.save(p.with_suffix(".npy"), np.zeros((30, 100), np.uint16)), {},
         "shape \\(30, 100\\).*1-D"),
        (lambda p: np.save(p.with_suffix(".npy"), np.array([3] * 2000 + [-1])), {},
         "token id -1 at position 2000.*negative"),
        (lambda p: p.with_suffix(".npy").write_bytes(b"not numpy" * 300), {}, "not a readable .npy"),
    ],
)  # fmt: skip
def test_each_bad_token_file_is_one_error_naming_the_file(tmp_path, make, settings_kw, words):
    make(tmp_path / "bad")
    (path,) = tmp_path.glob("bad.*")
    with pytest.raises(data.DataError, match=words) as caught:
        data.island_data(_cfg(path, **settings_kw))
    message = str(caught.value)
    assert str(path) in message and "\n" not in message


def test_text_data_reads_as_today_and_a_small_vocab_is_checked(tmp_path):
    text = tmp_path / "book.txt"
    text.write_bytes(b"abc \xff" * 400)
    assert isinstance(data.load_tokens(text), np.ndarray)
    assert data.load_tokens(text).tobytes() == text.read_bytes()
    with pytest.raises(data.DataError, match="token id 255 at position 4 of .*book.txt"):
        data.load_tokens(text, vocab_size=128)
    assert data.load_tokens(None).tobytes() == data.default_corpus()


def test_a_text_run_samples_exactly_what_it_sampled_before():
    """The reference: the materialized split and the sampler's rule (uniform starts), by hand."""
    cfg = IslandConfig(island="b", data_dir="/tmp/unused", batch_size=3, seq_len=20, seed=4,
                       eval_batches=2)  # fmt: skip
    own = data.island_data(cfg)
    shard = data.data_shard_of("b", -1, cfg.data_shards)
    train, heldout = data.split_corpus(data.default_corpus(), cfg.data_shards, shard)
    rng = np.random.default_rng(own.seed)
    for _ in range(3):
        starts = rng.integers(0, len(train) - 20, size=3)
        want = np.stack([train[s : s + 21] for s in starts]).astype(np.int32)
        np.testing.assert_array_equal(own.sampler.next(), want)
    starts = np.linspace(0, len(heldout) - 21, 6).astype(np.int64)
    want = np.stack([heldout[s : s + 21] for s in starts]).astype(np.int32)
    np.testing.assert_array_equal(np.concatenate(own.eval_set), want)


def test_vocab_and_dtype_settings_are_validated_and_are_flags():
    with pytest.raises(IslandConfigError, match="data_dtype='int8'.*uint16, uint32"):
        IslandConfig(data_dtype="int8")
    with pytest.raises(IslandConfigError, match="vocab_size=1"):
        IslandConfig(vocab_size=1)
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, IslandConfig)
    flags = parser.parse_args(["--data-dtype", "uint32", "--vocab-size", "50304"])
    cfg = settings.load_settings(IslandConfig, flags=flags)
    assert (cfg.data_dtype, cfg.vocab_size) == ("uint32", 50304)
    helptext = subprocess.run(
        [sys.executable, "-m", "worker.cli", "start", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "--data-dtype" in helptext and "--vocab-size" in helptext


def test_the_model_takes_its_vocabulary_from_the_data():
    import jax

    from worker import model

    assert model.model_config("tiny") == model.MODEL_CONFIGS["tiny"]  # text runs: same model
    cfg = model.model_config("tiny", 1000)
    shapes = jax.eval_shape(lambda: model.init_params(cfg, 0))
    assert shapes["embed"].shape == (1000, 64) and shapes["head"].shape == (64, 1000)
    with pytest.raises(model.ModelConfigError, match="'huge'"):
        model.model_config("huge")


def test_a_view_of_joined_ranges_splits_like_its_array():
    train, _heldout = data.split_tokens(np.arange(20_000, dtype=np.uint32), 1, 0)
    again_train, again_held = data.split_tokens(train, 2, 1)  # a view of 16 joined ranges
    want_train, want_held = data.split_corpus(train.to_array(), 2, 1)
    np.testing.assert_array_equal(again_train.to_array(), want_train)
    np.testing.assert_array_equal(again_held.to_array(), want_held)


def test_the_island_cli_refuses_a_bad_token_file_in_one_line(tmp_path):
    bad = tmp_path / "odd.bin"
    bad.write_bytes(b"\0" * 2049)
    proc = subprocess.run(
        [sys.executable, "-m", "worker.cli", "start", "--connect", "tcp://127.0.0.1:9",
         "--island", "x", "--data", str(bad), "--data-dir", str(tmp_path / "d"),
         "--join-timeout-s", "1"],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert str(bad) in last and "not a multiple of 2" in last and "--data-dtype" in last


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_daemon_island_learns_a_token_file_and_evaluates_it_with_its_vocabulary(tmp_path):
    from conftest import wait_for

    from bench.launcher import IslandSpec, LocalCluster

    vocab, rng = 512, np.random.default_rng(0)
    successors = rng.integers(0, vocab, size=(vocab, 2))  # a language of two next ids per id
    ids = np.zeros(40_000, np.uint16)
    for i, pick in enumerate(rng.integers(0, 2, size=len(ids) - 1), start=1):
        ids[i] = successors[ids[i - 1], pick]
    path = tmp_path / "train.bin"
    ids.tofile(path)
    flags = ("--data", str(path), "--vocab-size", str(vocab), "--data-shards", "1",
             "--inner-steps", "10", "--max-rounds", "400", "--batch-size", "8", "--seq-len", "32",
             "--eval-every", "1", "--lr", "0.01", "--warmup-steps", "10")  # fmt: skip
    with LocalCluster(tmp_path / "run", shards=2, server_args=("--mode", "async")) as cluster:
        cluster.start_server()
        cluster.start_islands([IslandSpec("tokens", 1.0, flags)])

        def evals() -> list[tuple[int, float]]:  # (global versions adopted, held-out loss)
            rows = cluster.island_metrics("tokens")
            return [(r["eval_versions"], r["eval_global"]) for r in rows if "eval_global" in r]

        # the island's rounds (a fraction of a second each) outrun the shards' first outer
        # steps (an XLA compile), so this waits for the global model rather than for rounds
        wait_for(
            lambda: (
                len(evals()) > 1 and evals()[-1][0] >= 16 and evals()[-1][1] < evals()[0][1] - 1.0
            ),
            "the global model's held-out loss to fall by 1 nat",
            timeout_s=400,
        )
        cluster.stop_island("tokens")
        seen = evals()
    assert seen[0][0] == 0 and abs(seen[0][1] - np.log(vocab)) < 0.3, seen  # uniform over 512


def test_a_directory_of_token_files_is_refused_rather_than_read_as_text(tmp_path):
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "notes.txt").write_text("x" * 2000)
    with pytest.raises(data.DataError, match="holds token files \\(train.bin\\).*one token file"):
        data.load_tokens(tmp_path)
    (tmp_path / "train.bin").unlink()
    assert data.load_tokens(tmp_path).tobytes() == b"x" * 2000  # text directories as before
