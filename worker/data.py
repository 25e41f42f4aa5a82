"""The island's data: the corpus, its split into islands, and batches of token windows.

This module owns where tokens come from (the embedded Shakespeare corpus, text files on
disk as bytes with vocab 256, or token files: a flat binary of uint16/uint32 ids in the
nanoGPT layout, or a 1-D `.npy` array), how they are divided (one held-out split common
to all islands, each island a disjoint contiguous shard of the rest) and how training and
evaluation batches are cut from them. Token files are memory-mapped and never read
whole into memory: a split is a `Tokens` view (ranges of the file), and a batch reads only
its windows. Everything is deterministic from explicit seeds. (Just over 400 lines:
text and token files share the split, the samplers and the held-out set.)
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.resources
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from worker.token_files import DataError, Tokens, check_token_ids, is_token_file, open_token_file

if TYPE_CHECKING:
    from worker.config import IslandConfig

# A corpus shorter than this (bytes of text, or tokens) cannot give meaningful shards and
# held-out windows.
MIN_CORPUS_BYTES = 1024
# The held-out split is the tail of each of this many equal segments, so it samples the
# whole corpus (every play) rather than only its end.
HELDOUT_SEGMENTS = 16
BYTE_VOCAB = 256  # text is read as bytes
_CORPUS_RESOURCE = ("corpus", "shakespeare.txt.gz")


@functools.cache
def default_corpus() -> bytes:
    """The embedded corpus (nine Shakespeare plays, ~1.1 MB of UTF-8 text).

    Returns:
        The decompressed corpus; read from the installed package, so it works offline.
    """
    resource = importlib.resources.files("worker").joinpath(*_CORPUS_RESOURCE)
    return gzip.decompress(resource.read_bytes())


def _files_in(directory: Path) -> list[Path]:
    """The regular, non-hidden files under `directory`, recursively, in sorted path order."""
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )


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
        files = _files_in(path)
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


def _refuse_token_files_in(directory: Path) -> None:
    """A directory is read as text: one holding token files (e.g. nanoGPT's) is a mistake."""
    found = [str(p.relative_to(directory)) for p in _files_in(directory) if is_token_file(p)]
    if found:
        raise DataError(
            f"corpus directory {str(directory)!r} holds token files ({', '.join(found[:3])}"
            f"{', ...' if len(found) > 3 else ''}), which a directory would read as text: "
            "pass one token file as --data"
        )


def load_tokens(
    path: str | Path | None = None, dtype: str = "uint16", vocab_size: int = BYTE_VOCAB
) -> np.ndarray:
    """Load the corpus as a 1-D array of token ids: text as bytes, a token file memory-mapped.

    Args:
        path: None for the embedded corpus; a ".bin" file of flat `dtype` ids (nanoGPT
            layout, no header) or a ".npy" 1-D integer array, both memory-mapped; anything
            else is text as `load_corpus` reads it (bytes, ids < 256), but a directory
            that holds ".bin" or ".npy" files is refused.
        dtype: the id type of a ".bin" file, one of DATA_DTYPES (a ".npy" holds its own).
        vocab_size: the model's vocabulary; every id must be below it.

    Returns:
        A uint8 array of the text, or an np.memmap over the token file (read on access).

    Raises:
        DataError: a missing, empty, truncated (odd length for `dtype`), 2-D or non-integer
            file, ids outside [0, vocab_size), or fewer than MIN_CORPUS_BYTES tokens.
    """
    if path is not None and is_token_file(path) and Path(path).is_file():
        path = Path(path)
        tokens = open_token_file(path, dtype)
        if len(tokens) < MIN_CORPUS_BYTES:
            raise DataError(
                f"token file {str(path)!r} has {len(tokens)} tokens; at least "
                f"{MIN_CORPUS_BYTES} needed"
            )
        source = repr(str(path))
    else:
        if path is not None and Path(path).is_dir():
            _refuse_token_files_in(Path(path))
        tokens = np.frombuffer(load_corpus(path), dtype=np.uint8)
        source = "the embedded corpus" if path is None else repr(str(path))
        if vocab_size >= BYTE_VOCAB:  # every byte fits: no scan needed
            return tokens
    check_token_ids(tokens, vocab_size, source)
    return tokens


def _as_tokens(data: bytes | np.ndarray | Tokens, name: str) -> Tokens:
    if isinstance(data, Tokens):
        return data
    if isinstance(data, bytes | bytearray | memoryview):
        data = np.frombuffer(bytes(data), dtype=np.uint8)
    if isinstance(data, np.ndarray) and data.ndim == 1 and data.dtype.kind in "ui":
        return Tokens(data, [(0, len(data))])
    raise DataError(
        f"{name} must be bytes, a 1-D integer array or Tokens, got {type(data).__name__}"
        + (f" of dtype {data.dtype}, shape {data.shape}" if isinstance(data, np.ndarray) else "")
    )


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < minimum:
        raise DataError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def split_tokens(
    data: bytes | np.ndarray | Tokens,
    num_islands: int,
    island_index: int,
    heldout_fraction: float = 0.05,
) -> tuple[Tokens, Tokens]:
    """Split a corpus into one island's training shard and the common held-out tokens.

    The held-out tokens are the last `heldout_fraction` of each of HELDOUT_SEGMENTS equal
    segments (the same for every island); the remaining tokens, in order, are cut into
    `num_islands` contiguous shards of equal size (+-1 token), and island `island_index`
    gets shard `island_index`. Shards are disjoint from each other and from held-out.
    A memory-mapped corpus is never copied (both parts are views of the file); an
    in-memory one is (each part one contiguous array).

    Args:
        data: the corpus: bytes, a 1-D integer array (e.g. from `load_tokens`) or Tokens.
        num_islands: number of islands sharing the corpus (>= 1).
        island_index: this island's index, 0 <= island_index < num_islands.
        heldout_fraction: share of the corpus held out, in (0, 0.5].

    Returns:
        (train_shard, heldout) as Tokens.
    """
    corpus = _as_tokens(data, "data")
    num_islands = _check_int("num_islands", num_islands, 1)
    island_index = _check_int("island_index", island_index, 0)
    if island_index >= num_islands:
        raise DataError(f"island_index={island_index} must be < num_islands={num_islands}")
    if not isinstance(heldout_fraction, int | float) or not 0.0 < heldout_fraction <= 0.5:
        raise DataError(f"heldout_fraction must be in (0, 0.5], got {heldout_fraction!r}")
    n = len(corpus)
    bounds = [n * s // HELDOUT_SEGMENTS for s in range(HELDOUT_SEGMENTS + 1)]
    train_ranges, heldout_ranges = [], []
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        cut = stop - int(round((stop - start) * heldout_fraction))
        train_ranges.append((start, cut))
        heldout_ranges.append((cut, stop))
    n_train = sum(b - a for a, b in train_ranges)
    lo = n_train * island_index // num_islands
    hi = n_train * (island_index + 1) // num_islands
    n_heldout = n - n_train
    if hi - lo < 2 or n_heldout < 2:
        raise DataError(
            f"corpus of {n} tokens is too small for {num_islands} islands with "
            f"heldout_fraction={heldout_fraction}"
        )
    # The shard is [lo, hi) of the training ranges joined: map it back to corpus positions.
    shard_ranges, seen = [], 0
    for a, b in train_ranges:
        first, last = max(a, a + lo - seen), min(b, a + hi - seen)
        if last > first:
            shard_ranges.append((first, last))
        seen += b - a
    parts = corpus.select(shard_ranges), corpus.select(heldout_ranges)
    if isinstance(corpus.base, np.memmap):
        return parts
    # In memory anyway (text): contiguous copies, which sample fastest.
    train, heldout = (Tokens(p.to_array(), [(0, len(p))]) for p in parts)
    return train, heldout


def split_corpus(
    data: bytes | np.ndarray, num_islands: int, island_index: int, heldout_fraction: float = 0.05
) -> tuple[np.ndarray, np.ndarray]:
    """`split_tokens` as fresh arrays (reads both parts whole; for small corpora and tests).

    Args:
        data: the corpus, bytes or a 1-D integer array.
        num_islands: number of islands sharing the corpus (>= 1).
        island_index: this island's index, 0 <= island_index < num_islands.
        heldout_fraction: share of the corpus held out, in (0, 0.5].

    Returns:
        (train_shard, heldout), both 1-D arrays of the corpus dtype (uint8 for bytes).
    """
    train, heldout = split_tokens(data, num_islands, island_index, heldout_fraction)
    return train.to_array(), heldout.to_array()


def _check_windows(tokens: Tokens, batch: int, seq_len: int, name: str) -> None:
    _check_int("batch", batch, 1)
    _check_int("seq_len", seq_len, 1)
    if len(tokens) < seq_len + 1:
        raise DataError(f"{name} has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}")


class BatchSampler:
    """Random training windows from one token sequence, deterministic from a seed.

    Attributes:
        tokens: the sequence windows are cut from (a view; a memory-mapped file stays so).
        batch: windows per batch B.
        seq_len: model context T.
    """

    def __init__(
        self, data: bytes | np.ndarray | Tokens, batch: int, seq_len: int, seed: int
    ) -> None:
        """Prepare the sampler.

        Args:
            data: the island's training tokens: bytes, a 1-D integer array or Tokens.
            batch: windows per batch B.
            seq_len: model context T; each window holds T+1 tokens.
            seed: the same seed gives the same sequence of batches.
        """
        self.tokens = _as_tokens(data, "data")
        _check_windows(self.tokens, batch, seq_len, "data")
        _check_int("seed", seed, 0)
        self.batch = int(batch)
        self.seq_len = int(seq_len)
        self._rng = np.random.default_rng(int(seed))
        self._offsets_T1 = np.arange(self.seq_len + 1)

    def next(self) -> np.ndarray:
        """Draw the next batch.

        Returns:
            int32 array [B, T+1] of token ids, windows starting at uniform random offsets.
        """
        high = len(self.tokens) - self.seq_len  # exclusive bound on window starts
        starts_B = self._rng.integers(0, high, size=self.batch)
        return self.tokens.take(starts_B[:, None] + self._offsets_T1[None, :]).astype(np.int32)

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> np.ndarray:
        return self.next()


def eval_batches(
    heldout: bytes | np.ndarray | Tokens, batch: int, seq_len: int, count: int
) -> list[np.ndarray]:
    """Fixed evaluation batches: batch*count windows evenly spaced over the held-out tokens.

    Args:
        heldout: the held-out tokens: bytes, a 1-D integer array or Tokens.
        batch: windows per batch B.
        seq_len: model context T; each window holds T+1 tokens.
        count: number of batches (>= 1).

    Returns:
        `count` int32 arrays [B, T+1]; the same arguments always give the same batches.
    """
    tokens = _as_tokens(heldout, "heldout")
    _check_windows(tokens, batch, seq_len, "heldout")
    count = _check_int("count", count, 1)
    starts = np.linspace(0, len(tokens) - (seq_len + 1), batch * count).astype(np.int64)
    windows_NxT1 = tokens.take(starts[:, None] + np.arange(seq_len + 1)[None, :]).astype(np.int32)
    return [windows_NxT1[i * batch : (i + 1) * batch] for i in range(count)]


def unigram_entropy(data: bytes | np.ndarray) -> float:
    """Entropy of the token distribution, in nats/token: the loss of the best context-free model.

    Args:
        data: text as bytes, or a 1-D integer array of token ids (read whole).

    Returns:
        -sum p log p over the token frequencies.
    """
    counts = np.bincount(_as_tokens(data, "data").to_array()).astype(np.float64)
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


def _split_of(cfg: IslandConfig, shard: int) -> tuple[Tokens, Tokens]:
    tokens = load_tokens(cfg.data or None, cfg.data_dtype, cfg.vocab_size)
    return split_tokens(tokens, cfg.data_shards, shard, cfg.heldout_fraction)


def heldout_set(cfg: IslandConfig) -> list[np.ndarray]:
    """The common held-out evaluation batches, exactly as every island builds them.

    Args:
        cfg: settings (data, data_dtype, vocab_size, data_shards, heldout_fraction,
            batch_size, seq_len, eval_batches); the island's data shard does not matter.

    Returns:
        `cfg.eval_batches` int32 arrays [batch_size, seq_len + 1].
    """
    _train, heldout = _split_of(cfg, 0)
    return eval_batches(heldout, cfg.batch_size, cfg.seq_len, cfg.eval_batches)


def island_data(cfg: IslandConfig) -> IslandData:
    """Load the corpus and cut out an island's training stream and the common held-out set.

    Args:
        cfg: island settings (data, data_dtype, vocab_size, data_shards, data_shard,
            heldout_fraction, batch_size, seq_len, eval_batches, island, seed).

    Returns:
        The island's IslandData.

    Raises:
        DataError: a bad data file or split (see `load_tokens`, `split_tokens`).
    """
    shard = data_shard_of(cfg.island, cfg.data_shard, cfg.data_shards)
    train, heldout = _split_of(cfg, shard)
    seed = zlib.crc32(cfg.island.encode()) ^ cfg.seed
    return IslandData(
        BatchSampler(train, cfg.batch_size, cfg.seq_len, seed),
        eval_batches(heldout, cfg.batch_size, cfg.seq_len, cfg.eval_batches),
        seed,
    )


HELDOUT_ID_SAMPLE = 1 << 20  # tokens read from each end of the held-out split for its identity


def heldout_identity(cfg: IslandConfig) -> str:
    """A short hash naming the common held-out set: the data and the held-out rule together.

    It covers the held-out split's length, id type and its first and last
    `HELDOUT_ID_SAMPLE` tokens, so another corpus, token file or `heldout_fraction`
    gives another identity (`data_shards` cuts only the training part), and a large
    token file is not read whole.

    Args:
        cfg: settings (data, data_dtype, vocab_size, data_shards, heldout_fraction).

    Returns:
        16 hex digits; islands record it in their status, `diloco-worker eval` in its result.
    """
    _train, heldout = _split_of(cfg, 0)
    n = len(heldout)
    ends = np.unique(
        np.r_[np.arange(min(n, HELDOUT_ID_SAMPLE)), np.arange(max(0, n - HELDOUT_ID_SAMPLE), n)]
    )
    sample = np.ascontiguousarray(heldout.take(ends.astype(np.int64)))
    digest = hashlib.sha256(f"{n}:{sample.dtype.str}:".encode())
    digest.update(sample.tobytes())
    return digest.hexdigest()[:16]
