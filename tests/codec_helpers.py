"""Shared helpers of the codec tests: the scheme table, error bounds, checked decode, damage."""

import ml_dtypes
import numpy as np

import codec

# One row per scheme variant; every contract test runs over all of them.
SCHEMES = {
    "raw-fp32": lambda: codec.raw("float32"),
    "raw-bf16": lambda: codec.raw("bfloat16"),
    "raw-fp32-zstd": lambda: codec.raw("float32", zstd_level=1),
    "int8": lambda: codec.int8(),
    "int8-b64-nozstd": lambda: codec.int8(block_size=64, zstd_level=None),
    "int8-stochastic": lambda: codec.int8(stochastic=True, seed=0),
    "int8-threads": lambda: codec.int8(zstd_threads=2),
    "int4": lambda: codec.int4(),
    "int4-stochastic": lambda: codec.int4(stochastic=True, seed=0),
    "topk": lambda: codec.topk(),
    "topk-4bit-chunk64-nozstd": lambda: codec.topk(density=0.1, bits=4, chunk=64, zstd_level=None),
    "topk-threads": lambda: codec.topk(density=0.3, chunk=16, zstd_threads=2),
}

BF16 = np.dtype(ml_dtypes.bfloat16)
# Rounding of the final cast back to the input dtype: (relative, absolute).
CAST_TOL = {
    np.dtype(np.float32): (0.0, 0.0),
    np.dtype(np.float16): (2.0**-11, 2.0**-25),
    BF16: (2.0**-8, 2.0**-133),
}
TINY = 2.0**-118  # blocks whose absmax is below this decode to zero


def max_abs_error_bound(c, x_in: np.ndarray) -> np.ndarray:
    """Per-element bound on |decoded - x| for codec `c` and input `x_in`.

    Args:
        c: the codec.
        x_in: input array (any supported dtype).

    Returns:
        float64 array of the flattened shape.
    """
    x = x_in.astype(np.float64).ravel()
    rel, absolute = CAST_TOL[x_in.dtype]
    cast = np.abs(x) * rel * 1.01 + absolute
    if c.scheme == "raw":
        rel_store, abs_store = (0.0, 0.0) if c.store == "float32" else (2.0**-8, 2.0**-133)
        return np.abs(x) * rel_store * 1.01 + abs_store + cast
    b = c.block_size
    if c.scheme == "topk":
        # an entry is dropped (error |x|) or decoded with its sign to a level in
        # (0, chunk absmax]: either way within the chunk absmax
        pad = np.zeros(-(-x.size // b) * b)
        pad[: x.size] = np.abs(x)
        absmax = np.repeat(pad.reshape(-1, b).max(axis=1), b)[: x.size]
        # the decoded value (at most the absmax) is rounded again to the tensor's dtype
        return absmax * (1 + 1e-6) + absmax * rel * 1.01 + absolute
    levels = 127 if c.scheme == "int8" else 7
    pad = np.zeros(-(-x.size // b) * b)
    pad[: x.size] = np.abs(x)
    absmax = np.repeat(pad.reshape(-1, b).max(axis=1), b)[: x.size]
    factor = 1.0 if c.stochastic else 0.5
    quant = factor * absmax / levels * (1 + 1e-5) + absmax * 1e-6
    quant = np.where(absmax < TINY, absmax, quant)
    # the output cast rounds the decoded value, whose magnitude is at most |x| + quant: a
    # near-zero input that stochastic rounding sends to one step is rounded at that step's
    # magnitude (found by hypothesis: int4, bf16, a block of 1e-3 and -6e-8)
    return quant + (np.abs(x) + quant) * rel * 1.01 + absolute


def fuzz_tree() -> dict:
    """A small tree of mixed dtypes and shapes (a matrix, a nested float16 vector, a scalar)."""
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((40, 30)).astype(np.float32),
        "b": {"bias": rng.standard_normal(33).astype(np.float16)},
        "s": np.float32(2.0).reshape(()),
    }


DECODED_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)


def checked_decode(frames, c=None, like=None, **kw) -> dict | None:
    """Decode `frames` and check what came back; None when the codec refused them.

    A refusal must be a CodecError with a message (any other exception fails the
    test). A result must be a tree of arrays in a dtype the codec writes, with
    finite values; given the input it encoded (`like`, encoded by `c`), it must
    have the input's paths, shapes and dtypes and lie within the codec's error
    bound of it.

    Args:
        frames: the message to decode.
        c: the codec that encoded `like` (needed with `like`).
        like: the tree whose clean encoding `frames` is, or None for damaged input.
        kw: passed to `codec.decode` (max_elements, threads).

    Returns:
        The decoded tree, or None when decode raised CodecError.
    """
    try:
        tree = codec.decode(frames, **kw)
    except codec.CodecError as e:
        assert str(e), "a CodecError without a message"
        return None
    leaves = codec.flatten(tree)
    for path, out in leaves.items():
        assert isinstance(out, np.ndarray), (path, type(out))
        assert out.dtype in DECODED_DTYPES, (path, out.dtype)
        assert np.isfinite(out.astype(np.float64)).all(), f"{path}: non-finite values decoded"
    if like is not None:
        want = codec.flatten(like)
        assert sorted(leaves) == sorted(want)
        for path, x in want.items():
            x = np.asarray(x)
            out = leaves[path]
            assert (out.shape, out.dtype) == (x.shape, x.dtype), path
            err = np.abs(out.astype(np.float64).ravel() - x.astype(np.float64).ravel())
            bound = max_abs_error_bound(c, x)
            assert (err <= bound).all(), f"{path}: error {err.max()} over the bound"
    return tree


def mutate(rnd, frames: list[bytes]) -> list[bytes]:
    """One random damage to a message: flip bits, truncate, reorder, drop, duplicate,
    replace a frame with random bytes, or append garbage to one.

    Args:
        rnd: a random.Random.
        frames: the message (not modified).

    Returns:
        The damaged copy.
    """
    frames = list(frames)
    kind = rnd.randrange(7)
    i = rnd.randrange(len(frames))
    f = bytearray(frames[i])
    if kind == 0 and f:  # flip bits
        for _ in range(rnd.randint(1, 4)):
            f[rnd.randrange(len(f))] ^= 1 << rnd.randrange(8)
        frames[i] = bytes(f)
    elif kind == 1:  # truncate
        frames[i] = bytes(f[: rnd.randrange(len(f) + 1)])
    elif kind == 2:  # reorder
        rnd.shuffle(frames)
    elif kind == 3:  # drop
        del frames[i]
    elif kind == 4:  # duplicate
        frames.insert(i, frames[i])
    elif kind == 5:  # random bytes in place of a frame
        frames[i] = rnd.randbytes(rnd.randrange(64))
    else:  # append garbage to a frame
        frames[i] = bytes(f) + rnd.randbytes(rnd.randint(1, 8))
    return frames
