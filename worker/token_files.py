"""Token files and views of them: the flat binary / `.npy` readers and the `Tokens` view.

A token file is read memory-mapped and never whole: `open_token_file` maps it,
`check_token_ids` scans it chunk by chunk, and a `Tokens` view (ranges of one array joined
end to end) reads only the positions a batch indexes. `worker.data` splits and samples
these views; the same views serve text (an array of bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from worker.config import DATA_DTYPES

_SCAN_CHUNK = 1 << 20  # token ids checked per chunk, so a file is never read whole


class DataError(ValueError):
    """A corpus, token file, split or batch argument is invalid (`worker.data` raises it)."""


def is_token_file(path: str | Path) -> bool:
    """Whether `--data path` is read as token ids (".bin" or ".npy") rather than as text."""
    return Path(path).suffix in (".bin", ".npy")


def _open_bin(path: Path, dtype: str) -> np.ndarray:
    if dtype not in DATA_DTYPES:
        raise DataError(f"data dtype {dtype!r} must be one of {', '.join(DATA_DTYPES)}")
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
        raise DataError(f"token file {str(path)!r} is empty: give a file of {dtype} token ids")
    if size % itemsize:
        raise DataError(
            f"token file {str(path)!r} has {size} bytes, not a multiple of {itemsize} "
            f"({dtype} ids): it is truncated, or pass the --data-dtype it was written with"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def _open_npy(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"token file {str(path)!r} is not a readable .npy array: {exc}") from None
    if array.ndim != 1:
        raise DataError(
            f"token file {str(path)!r} holds an array of shape {array.shape}: save one 1-D "
            "array of token ids (e.g. np.save(path, ids.reshape(-1)))"
        )
    if array.dtype.kind not in "ui":
        raise DataError(
            f"token file {str(path)!r} holds {array.dtype} values, not integer token ids: "
            "save them as uint16 or uint32 (ids.astype(np.uint32))"
        )
    if len(array) == 0:
        raise DataError(f"token file {str(path)!r} is empty: save a 1-D array of token ids")
    return array


def check_token_ids(tokens: np.ndarray, vocab_size: int, source: str) -> None:
    """Raise unless every id is in [0, vocab_size), scanning in chunks (never a whole copy).

    Args:
        tokens: a 1-D integer array (a memmap is read chunk by chunk).
        vocab_size: the model's vocabulary V.
        source: what to name in the error (a file path, or "the embedded corpus").

    Raises:
        DataError: the first id out of range, its position, and the --vocab-size to pass.
    """
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = np.asarray(tokens[start : start + _SCAN_CHUNK])
        bad = (
            chunk >= vocab_size if chunk.dtype.kind == "u" else (chunk < 0) | (chunk >= vocab_size)
        )
        if bad.any():
            where = int(np.argmax(bad))
            value = int(chunk[where])
            fix = (
                "negative ids are not tokens: rewrite the file"
                if value < 0
                else f"pass --vocab-size {int(chunk.max()) + 1} or more "
                "(or the --data-dtype the file was written with)"
            )
            raise DataError(
                f"token id {value} at position {start + where} of {source} is outside the "
                f"vocabulary [0, {vocab_size}): {fix}"
            )


def open_token_file(path: Path, dtype: str) -> np.ndarray:
    """Memory-map a token file: ".bin" as flat `dtype` ids, ".npy" as its own integer array.

    Args:
        path: an existing ".bin" or ".npy" file.
        dtype: the ids' type in a ".bin" file, one of DATA_DTYPES (it has no header).

    Returns:
        A 1-D np.memmap (nothing is read until indexed).

    Raises:
        DataError: an empty or truncated (length not a multiple of the id size) file, or a
            ".npy" that is unreadable, not 1-D or not of integers.
    """
    return _open_bin(path, dtype) if path.suffix == ".bin" else _open_npy(path)


class Tokens:
    """A 1-D token sequence made of ranges of one array, joined end to end.

    Indexing reads only the indexed positions, so a split of a memory-mapped file never
    loads it whole.
    """

    def __init__(self, base: np.ndarray, ranges: Sequence[tuple[int, int]]) -> None:
        """Join `base[a:b]` for each (a, b) of `ranges`, in order.

        Args:
            base: a 1-D integer array (np.memmap included).
            ranges: (start, stop) index ranges into `base`; empty ones are dropped.
        """
        kept = [(int(a), int(b)) for a, b in ranges if b > a]
        self.base = base
        self._starts = np.array([a for a, _ in kept], dtype=np.int64)
        lengths = np.array([b - a for a, b in kept], dtype=np.int64)
        self._offsets = np.cumsum(lengths) - lengths  # position of each range in the view
        self._len = int(lengths.sum())

    def __len__(self) -> int:
        return self._len

    def take(self, index: np.ndarray) -> np.ndarray:
        """The tokens at positions `index` (an int array of any shape, values in [0, len)).

        Returns:
            An array of `index`'s shape and the base's dtype (a copy; the base is untouched).
        """
        if len(self._starts) == 1:  # one range: a shift
            return self.base[index + self._starts[0]]
        piece = np.searchsorted(self._offsets, index, side="right") - 1
        return self.base[index - self._offsets[piece] + self._starts[piece]]

    def select(self, ranges: Sequence[tuple[int, int]]) -> Tokens:
        """Ranges of this view's positions, as a view of the same base (nothing is read).

        Args:
            ranges: (start, stop) position ranges into this view, each within one of its
                ranges or this view a single range (as a split's segments are).

        Returns:
            The Tokens view of those positions, in order.
        """
        if len(self._starts) != 1:  # a joined view: read it once into a single array
            return Tokens(self.to_array(), [(0, self._len)]).select(ranges)
        shift = int(self._starts[0])
        return Tokens(self.base, [(a + shift, b + shift) for a, b in ranges])

    def to_array(self) -> np.ndarray:
        """Every token, as one fresh array (reads the whole view)."""
        return self.take(np.arange(self._len, dtype=np.int64))
