"""The island's data: the corpus, its split into islands, and batches of byte windows.

This module owns where text comes from (the embedded Shakespeare corpus or files on
disk), how it is divided (one held-out split common to all islands, each island a
disjoint contiguous shard of the rest) and how training and evaluation batches are cut
from it. Everything is bytes (vocab 256) and deterministic from explicit seeds.
"""

from __future__ import annotations

import functools
import gzip
import importlib.resources
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from worker.config import IslandConfig

# A corpus shorter than this cannot give meaningful shards and held-out windows.
MIN_CORPUS_BYTES = 1024
# The held-out split is the tail of each of this many equal segments, so it samples the
# whole corpus (every play) rather than only its end.
HELDOUT_SEGMENTS = 16
_CORPUS_RESOURCE = ("corpus", "shakespeare.txt.gz")


class DataError(ValueError):
    """A corpus, split or batch argument is invalid."""


@functools.cache
def default_corpus() -> bytes:
    """The embedded corpus (nine Shakespeare plays, ~1.1 MB of UTF-8 text).

    Returns:
        The decompressed corpus; read from the installed package, so it works offline.
    """
    resource = importlib.resources.files("worker").joinpath(*_CORPUS_RESOURCE)
    return gzip.decompress(resource.read_bytes())


def _read_text_file(path: Path) -> bytes:
    raw = path.read_bytes()
    return gzip.decompress(raw) if path.suffix == ".gz" else raw


def load_corpus(path: str | Path | None = None) -> bytes:
    """Load training text: the embedded corpus, one file, or every file under a directory.

    Args:
        path: None for the embedded corpus; a file (".gz" is decompressed); or a directory,
            whose regular non-hidden files are read recursively in sorted path order and
            joined with a newline.

    Returns:
        The corpus bytes (at least MIN_CORPUS_BYTES long).

    Raises:
        DataError: the path does not exist, the directory holds no files, or the text is
            shorter than MIN_CORPUS_BYTES.
    """
    if path is None:
        return default_corpus()
    path = Path(path)
    if path.is_file():
        data = _read_text_file(path)
    elif path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise DataError(f"corpus directory {str(path)!r} contains no files")
        data = b"\n".join(_read_text_file(p) for p in files)
    else:
        raise DataError(f"corpus path {str(path)!r} does not exist")
    if len(data) < MIN_CORPUS_BYTES:
        raise DataError(
            f"corpus at {str(path)!r} has {len(data)} bytes; at least {MIN_CORPUS_BYTES} needed"
        )
    return data


def _as_bytes_array(data: bytes | np.ndarray, name: str) -> np.ndarray:
    if isinstance(data, bytes | bytearray | memoryview):
        return np.frombuffer(bytes(data), dtype=np.uint8)
    if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1:
        return data
    raise DataError(f"{name} must be bytes or a 1-D uint8 array, got {type(data).__name__}")


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < minimum:
        raise DataError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def split_corpus(
    data: bytes | np.ndarray, num_islands: int, island_index: int, heldout_fraction: float = 0.05
) -> tuple[np.ndarray, np.ndarray]:
    """Split a corpus into one island's training shard and the common held-out text.

    The held-out text is the last `heldout_fraction` of each of HELDOUT_SEGMENTS equal
    segments (the same for every island); the remaining text, in order, is cut into
    `num_islands` contiguous shards of equal size (+-1 byte), and island `island_index`
    gets shard `island_index`. Shards are disjoint from each other and from held-out.

    Args:
        data: the corpus, bytes or 1-D uint8 array.
        num_islands: number of islands sharing the corpus (>= 1).
        island_index: this island's index, 0 <= island_index < num_islands.
        heldout_fraction: share of the corpus held out, in (0, 0.5].

    Returns:
        (train_shard, heldout), both 1-D uint8 arrays (fresh copies).
    """
    data_N = _as_bytes_array(data, "data")
    num_islands = _check_int("num_islands", num_islands, 1)
    island_index = _check_int("island_index", island_index, 0)
    if island_index >= num_islands:
        raise DataError(f"island_index={island_index} must be < num_islands={num_islands}")
    if not isinstance(heldout_fraction, int | float) or not 0.0 < heldout_fraction <= 0.5:
        raise DataError(f"heldout_fraction must be in (0, 0.5], got {heldout_fraction!r}")
    n = len(data_N)
    bounds = [n * s // HELDOUT_SEGMENTS for s in range(HELDOUT_SEGMENTS + 1)]
    train_parts, heldout_parts = [], []
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        cut = stop - int(round((stop - start) * heldout_fraction))
        train_parts.append(data_N[start:cut])
        heldout_parts.append(data_N[cut:stop])
    train_N = np.concatenate(train_parts)
    heldout_M = np.concatenate(heldout_parts)
    lo = len(train_N) * island_index // num_islands
    hi = len(train_N) * (island_index + 1) // num_islands
    if hi - lo < 2 or len(heldout_M) < 2:
        raise DataError(
            f"corpus of {n} bytes is too small for {num_islands} islands with "
            f"heldout_fraction={heldout_fraction}"
        )
    return train_N[lo:hi].copy(), heldout_M.copy()


def _check_windows(data_N: np.ndarray, batch: int, seq_len: int, name: str) -> None:
    _check_int("batch", batch, 1)
    _check_int("seq_len", seq_len, 1)
    if len(data_N) < seq_len + 1:
        raise DataError(f"{name} has {len(data_N)} bytes, fewer than seq_len + 1 = {seq_len + 1}")


class BatchSampler:
    """Random training windows from one text, deterministic from a seed."""

    def __init__(self, data: bytes | np.ndarray, batch: int, seq_len: int, seed: int) -> None:
        """Prepare the sampler.

        Args:
            data: the island's training text, bytes or 1-D uint8 array.
            batch: windows per batch B.
            seq_len: model context T; each window holds T+1 bytes.
            seed: the same seed gives the same sequence of batches.
        """
        self._data_N = _as_bytes_array(data, "data")
        _check_windows(self._data_N, batch, seq_len, "data")
        _check_int("seed", seed, 0)
        self.batch = int(batch)
        self.seq_len = int(seq_len)
        self._rng = np.random.default_rng(int(seed))
        self._offsets_T1 = np.arange(self.seq_len + 1)

    def next(self) -> np.ndarray:
        """Draw the next batch.

        Returns:
            int32 array [B, T+1] of byte ids, windows starting at uniform random offsets.
        """
        high = len(self._data_N) - self.seq_len  # exclusive bound on window starts
        starts_B = self._rng.integers(0, high, size=self.batch)
        return self._data_N[starts_B[:, None] + self._offsets_T1[None, :]].astype(np.int32)

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> np.ndarray:
        return self.next()


def eval_batches(
    heldout: bytes | np.ndarray, batch: int, seq_len: int, count: int
) -> list[np.ndarray]:
    """Fixed evaluation batches: batch*count windows evenly spaced over the held-out text.

    Args:
        heldout: the held-out text, bytes or 1-D uint8 array.
        batch: windows per batch B.
        seq_len: model context T; each window holds T+1 bytes.
        count: number of batches (>= 1).

    Returns:
        `count` int32 arrays [B, T+1]; the same arguments always give the same batches.
    """
    heldout_N = _as_bytes_array(heldout, "heldout")
    _check_windows(heldout_N, batch, seq_len, "heldout")
    count = _check_int("count", count, 1)
    starts = np.linspace(0, len(heldout_N) - (seq_len + 1), batch * count).astype(np.int64)
    windows_NxT1 = heldout_N[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)
    return [windows_NxT1[i * batch : (i + 1) * batch] for i in range(count)]


def unigram_entropy(data: bytes | np.ndarray) -> float:
    """Entropy of the byte distribution, in nats/byte: the loss of the best context-free model.

    Args:
        data: text as bytes or a uint8 array.

    Returns:
        -sum p log p over the byte frequencies.
    """
    counts = np.bincount(_as_bytes_array(data, "data"), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@dataclass(frozen=True)
class IslandData:
    """What one island (or data-parallel rank) trains and evaluates on.

    Attributes:
        sampler: the island's own training batches (its data shard, its seed).
        eval_set: the held-out batches, the same for every island of a run.
        seed: the island's seed (crc32 of its id xor the run's seed), also for pacing.
    """

    sampler: BatchSampler
    eval_set: list[np.ndarray]
    seed: int


def data_shard_of(island: str, data_shard: int, data_shards: int) -> int:
    """The island's data shard: explicit, or a stable hash of its id.

    Args:
        island: the island id.
        data_shard: the configured shard, or < 0 for the hash.
        data_shards: number of shards.

    Returns:
        Index in [0, data_shards).
    """
    if data_shard >= 0:
        return data_shard
    return zlib.crc32(island.encode()) % data_shards


def island_data(cfg: IslandConfig) -> IslandData:
    """Load the corpus and cut out an island's training stream and the common held-out set.

    Args:
        cfg: island settings (data, data_shards, data_shard, heldout_fraction, batch_size,
            seq_len, eval_batches, island, seed).

    Returns:
        The island's IslandData.
    """
    corpus = load_corpus(cfg.data or None)
    shard = data_shard_of(cfg.island, cfg.data_shard, cfg.data_shards)
    train, heldout = split_corpus(corpus, cfg.data_shards, shard, cfg.heldout_fraction)
    seed = zlib.crc32(cfg.island.encode()) ^ cfg.seed
    return IslandData(
        BatchSampler(train, cfg.batch_size, cfg.seq_len, seed),
        eval_batches(heldout, cfg.batch_size, cfg.seq_len, cfg.eval_batches),
        seed,
    )
