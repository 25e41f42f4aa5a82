"""The codecs users build: `int8`, `int4`, `topk`, `raw`, and their encode.

Owns each scheme's settings (validated in the constructors), the encode
pipeline (walk the tree, check inputs and state, quantize or cast every
tensor into the payload in independent pieces, on the codec's thread pool
when `zstd_threads` > 1, then compress the finished payload's frames on the
same pool, write the header) and error feedback (residual = input + old
residual - decoded; topk may decay the old residual first: input + ef_decay x
old residual - decoded).
"""

import math
import threading

import numpy as np

from . import format as fmt
from .format import CodecError
from .parallel import check_threads, pool, run_all
from .payload import FrameWriter, block_codes, block_scales
from .quant import encode_blocks, encode_raw, workspace
from .sparse import encode_topk, piece_elements
from .state import ErrorFeedbackState, advance, check_state, init_state
from .tree import leaf_items

PIECE_ELEMENTS = 1 << 18  # elements per parallel encode job (int8, int4, raw)

_DTYPE_NAMES = {v: k for k, v in fmt.DTYPES.items()}


def _as_array(path, leaf) -> np.ndarray:
    name = "/".join(path)
    try:
        arr = np.asarray(leaf)
    except Exception as e:
        raise CodecError(f"tensor {name!r} is not an array: {e}") from None
    if arr.dtype not in _DTYPE_NAMES:
        raise CodecError(
            f"tensor {name!r} has dtype {arr.dtype}; the codec takes float32, float16 or bfloat16"
        )
    return arr


class Codec:
    """One compression scheme with its settings; build with int8/int4/topk/raw.

    Args:
        scheme: "int8", "int4", "topk" or "raw".
        block_size: elements per quantization block (int8, int4) or per chunk (topk).
        zstd_level: zstd level, or None for no compression.
        stochastic: stochastic instead of round-to-nearest rounding.
        zstd_threads: worker threads that quantize pieces and compress frames
            in parallel (0 or 1: everything in the calling thread).
        seed: seed of the stochastic-rounding generator (None: from the OS).
        store: stored dtype of the raw scheme.
        keep: topk entries kept per full chunk.
        bits: topk bits per kept value (2 or 4).
        ef_decay: topk factor on the old residual before each encode, in (0, 1].
    """

    def __init__(
        self,
        scheme,
        block_size,
        zstd_level,
        stochastic,
        zstd_threads,
        seed,
        store,
        keep=0,
        bits=0,
        ef_decay=1.0,
    ):
        if scheme != "raw":
            if not isinstance(block_size, int) or not 2 <= block_size <= 1 << 20:
                raise CodecError(f"block_size must be an int in [2, 2**20], got {block_size!r}")
            if scheme == "int4" and block_size % 2:
                raise CodecError(f"int4 block_size must be even, got {block_size}")
        if zstd_level is not None and (
            not isinstance(zstd_level, int) or not -7 <= zstd_level <= 22
        ):
            raise CodecError(f"zstd_level must be None or an int in [-7, 22], got {zstd_level!r}")
        check_threads(zstd_threads, "zstd_threads")
        self.scheme = scheme
        self.block_size = block_size if scheme != "raw" else 0
        self.zstd_level = zstd_level
        self.stochastic = bool(stochastic)
        self.zstd_threads = zstd_threads
        self.store = store
        self.keep, self.bits = keep, bits
        self.ef_decay = ef_decay
        self.density = keep / block_size if scheme == "topk" else None
        self._rng = np.random.default_rng(seed) if stochastic else None
        self._local = threading.local()

    def __repr__(self) -> str:
        if self.scheme == "raw":
            return f"codec.raw({self.store!r}, zstd_level={self.zstd_level})"
        if self.scheme == "topk":
            return (
                f"codec.topk(density={self.density!r}, bits={self.bits}, "
                f"chunk={self.block_size}, ef_decay={self.ef_decay!r}, "
                f"zstd_level={self.zstd_level}, zstd_threads={self.zstd_threads})"
            )
        return (
            f"codec.{self.scheme}(block_size={self.block_size}, zstd_level={self.zstd_level}, "
            f"stochastic={self.stochastic}, zstd_threads={self.zstd_threads})"
        )

    def init(self, tree) -> ErrorFeedbackState:
        """Zero error-feedback residuals for a tree.

        Args:
            tree: mapping name -> array (nested mappings allowed).

        Returns:
            ErrorFeedbackState to pass to `encode`.
        """
        items = [(p, _as_array(p, leaf)) for p, leaf in leaf_items(tree)]
        return init_state([p for p, _ in items], [a.shape for _, a in items])

    def encode(self, tree, state=None) -> tuple[list, ErrorFeedbackState | None]:
        """Encode a tree into frames.

        Args:
            tree: mapping name -> float32/float16/bfloat16 array, nested allowed.
            state: error-feedback state from `init` or the previous encode;
                None disables error feedback. A state serves one successful
                encode (its buffers are then recycled); a failed encode leaves
                it valid.

        Returns:
            (frames, new_state): frames[0] is the header, the rest payload
            (bytes-like, for zmq send_multipart); new_state is None when
            state was None.
        """
        items = [(p, _as_array(p, leaf)) for p, leaf in leaf_items(tree)]
        paths = [p for p, _ in items]
        if state is not None:
            check_state(state, paths, [a.shape for _, a in items])
        specs = [(p, a.shape, _DTYPE_NAMES[a.dtype]) for p, a in items]
        writer = FrameWriter(
            self.scheme, self.block_size, specs, self.zstd_level, self.store, self.keep, self.bits
        )
        payload = self._payload(writer.total)
        jobs, prev_end = [], 0
        for i, (t, (_, arr)) in enumerate(zip(writer.tensors, items, strict=True)):
            payload[prev_end : t.offset] = 0
            payload[t.offset + t.codes_bytes : t.scales_offset] = 0
            prev_end = t.end
            res = None if state is None else state.residuals[i]
            new_res = None if state is None else state.spare[i]
            x = arr.reshape(-1)
            jobs += [(i, t, x, res, new_res, payload, a, b) for a, b in self._pieces(t.size)]
        workers = pool(self.zstd_threads)
        # stochastic rounding draws from one generator: in order, in this thread
        ok = run_all(None if self.stochastic else workers, self._encode_piece, jobs)
        for job, good in zip(jobs, ok, strict=True):
            if not good:
                _raise_non_finite(items[job[0]][0], job[2])
        writer.close(memoryview(payload).cast("B"), workers)
        return writer.frames(), None if state is None else advance(state)

    def _payload(self, total: int) -> np.ndarray:
        """Payload buffer: reused when frames are compressed copies, fresh otherwise."""
        if self.zstd_level is None:
            return np.empty(total, np.uint8)
        buf = getattr(self._local, "payload", None)
        if buf is None or buf.shape[0] < total:
            buf = self._local.payload = np.zeros(max(total, 1), np.uint8)
        return buf[:total]

    def _pieces(self, n: int) -> list:
        """Element ranges encoded as independent jobs (block- or chunk-aligned).

        On one thread an int8/int4/raw tensor is one job (a kernel call walks
        it once instead of once per piece).
        """
        if self.scheme == "topk":
            piece = piece_elements(self.block_size)
        elif self.zstd_threads <= 1:
            piece = max(n, 1)
        else:
            unit = max(self.block_size, 2)
            piece = max(unit, (PIECE_ELEMENTS // unit) * unit)
        return [(a, min(a + piece, n)) for a in range(0, n, piece)]

    def _encode_piece(self, *job) -> bool:
        with np.errstate(all="ignore"):  # thread-local: set in the thread that computes
            return self._encode_piece_in(*job)

    def _encode_piece_in(self, i, t, x, res, new_res, payload, a, b) -> bool:
        r = None if res is None else res[a:b]
        nr = None if new_res is None else new_res[a:b]
        if self.scheme == "raw":
            store = fmt.DTYPES[self.store]
            out = payload[t.offset : t.offset + t.codes_bytes].view(store)
            return encode_raw(x[a:b], r, nr, out[a:b], workspace(1))
        bs = self.block_size
        scales = block_scales(payload, t)
        if self.scheme == "topk":
            k0 = fmt.topk_kept(a, bs, self.keep)
            k1 = k0 + fmt.topk_kept(b - a, bs, self.keep)
            lo = payload[t.offset : t.offset + t.kept]
            hi = payload[t.offset + t.kept : t.offset + 2 * t.kept]
            codes = payload[t.offset + 2 * t.kept : t.offset + t.codes_bytes]
            cd = codes[k0 * self.bits // 8 : -(-k1 * self.bits // 8)]
            sc = scales[a // bs : -(-b // bs)]
            return encode_topk(
                x[a:b], r, nr, lo[k0:k1], hi[k0:k1], cd, sc, bs, self.keep, self.bits, self.ef_decay
            )
        levels = fmt.LEVELS[self.scheme]
        step = 2 if levels == 7 else 1
        codes = block_codes(payload, t, self.scheme)
        sc = scales[a // bs : -(-b // bs)]
        cd = codes[a // step : -(-b // step)]
        encode_blocks(x[a:b], r, nr, cd, sc, levels, workspace(bs), self._rng)
        return bool(np.isfinite(sc.max())) if sc.shape[0] else True


def _raise_non_finite(path, x) -> None:
    name = "/".join(path)
    if not np.isfinite(x).all():
        raise CodecError(f"tensor {name!r} contains NaN or Inf; nothing was encoded")
    raise CodecError(
        f"tensor {name!r} overflows float32 once its error-feedback residual is added; "
        "nothing was encoded (reset the state with init)"
    )


def int8(block_size=256, zstd_level=1, stochastic=False, zstd_threads=0, seed=None) -> Codec:
    """Block-absmax int8 codec.

    Args:
        block_size: elements per block (each block stores a float32 absmax).
        zstd_level: zstd level of the payload frames, None for no zstd.
        stochastic: stochastic rounding instead of round-to-nearest.
        zstd_threads: threads compressing payload frames (0: calling thread).
        seed: seed for stochastic rounding.

    Returns:
        Codec.
    """
    return Codec("int8", block_size, zstd_level, stochastic, zstd_threads, seed, None)


def int4(block_size=64, zstd_level=1, stochastic=False, zstd_threads=0, seed=None) -> Codec:
    """Block-absmax int4 codec (two values per byte, levels -7..7).

    Args:
        block_size: elements per block (even).
        zstd_level: zstd level of the payload frames, None for no zstd.
        stochastic: stochastic rounding instead of round-to-nearest.
        zstd_threads: threads compressing payload frames (0: calling thread).
        seed: seed for stochastic rounding.

    Returns:
        Codec.
    """
    return Codec("int4", block_size, zstd_level, stochastic, zstd_threads, seed, None)


def raw(dtype="float32", zstd_level=None, zstd_threads=0) -> Codec:
    """Uncompressed baseline: values stored as float32 or bfloat16.

    Args:
        dtype: "float32" or "bfloat16" (the stored type).
        zstd_level: zstd level, None (default) for no zstd.
        zstd_threads: threads compressing payload frames (0: calling thread).

    Returns:
        Codec.
    """
    if dtype not in fmt.STORES:
        raise CodecError(f"raw dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    return Codec("raw", 0, zstd_level, False, zstd_threads, None, dtype)


def _check_unit_share(name: str, value: object) -> None:
    """Refuse a topk setting that is not a real number in (0, 1] (a bool is not one)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= 1
    ):
        raise CodecError(f"topk {name} must be a number in (0, 1], got {value!r}")


def topk(density=0.02, bits=2, chunk=4096, zstd_level=1, zstd_threads=0, ef_decay=1.0) -> Codec:
    """Sparse top-k codec with error feedback (SparseLoCo-style).

    Per chunk of `chunk` elements, keeps the ceil(density * chunk) entries of
    largest magnitude (of input + residual), sends their chunk-local offsets
    (gap-coded uint16, zstd) and their values at `bits` bits (sign + level
    against the chunk absmax). Everything not sent, quantization error
    included, stays in the error-feedback state, so the decoded sum over
    rounds tracks the sum of the inputs; pass a state from `init`, since
    without it the dropped mass is lost. At density 0.02 and 2 bits a round
    is about 1/100 of fp32 bytes. Decodes to dense tensors of the encoded
    dtype (float32 deltas decode to float32), zeros where nothing was sent.
    With `ef_decay` < 1 each encode selects from input + ef_decay x residual
    (SparseLoCo's decay, 0.95 there): old unsent mass fades instead of
    piling up, so the sum over rounds no longer tracks the inputs exactly.

    Args:
        density: share of entries kept per chunk, in (0, 1].
        bits: bits per kept value, 2 or 4.
        chunk: elements per chunk, 1..65536 (offsets are uint16).
        zstd_level: zstd level, or None to skip zstd (for links faster than
            the compressor; see `diloco-bench codec` for the break-even).
        zstd_threads: worker threads (0: the calling thread).
        ef_decay: factor on the error-feedback residual before each encode, in
            (0, 1]; 1 (the default) keeps every unsent value whole.

    Returns:
        Codec.
    """
    _check_unit_share("density", density)
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in fmt.TOPK_BITS:
        raise CodecError(f"topk bits must be 2 or 4, got {bits!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 2 <= chunk <= fmt.MAX_CHUNK:
        raise CodecError(f"topk chunk must be an int in [2, {fmt.MAX_CHUNK}], got {chunk!r}")
    _check_unit_share("ef_decay", ef_decay)
    keep = min(chunk, max(1, math.ceil(density * chunk)))
    c = Codec(
        "topk", chunk, zstd_level, False, zstd_threads, None, None, keep, bits, float(ef_decay)
    )
    c.density = density
    return c
