"""The codecs users build: `int8`, `int4`, `raw`, and their encode.

Owns each scheme's settings (validated in the constructors), the encode
pipeline (walk the tree, check inputs and state, quantize or cast every
tensor into the payload piece by piece, hand finished pieces to zstd, write
the header) and error feedback (residual = input + old residual - decoded).
"""

import threading

import numpy as np

from . import format as fmt
from .compress import FrameSink, make_pool
from .errors import CodecError
from .quant import encode_blocks
from .rawcast import encode_raw
from .state import ErrorFeedbackState, advance, check_state, init_state
from .tree import leaf_items
from .workspace import workspace

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
    """One compression scheme with its settings; build with int8/int4/raw.

    Args:
        scheme: "int8", "int4" or "raw".
        block_size: elements per quantization block (quantized schemes).
        zstd_level: zstd level, or None for no compression.
        stochastic: stochastic instead of round-to-nearest rounding.
        zstd_threads: compression threads (0: compress in the calling thread).
        seed: seed of the stochastic-rounding generator (None: from the OS).
        store: stored dtype of the raw scheme.
    """

    def __init__(self, scheme, block_size, zstd_level, stochastic, zstd_threads, seed, store):
        if scheme != "raw":
            if not isinstance(block_size, int) or not 2 <= block_size <= 1 << 20:
                raise CodecError(f"block_size must be an int in [2, 2**20], got {block_size!r}")
            if scheme == "int4" and block_size % 2:
                raise CodecError(f"int4 block_size must be even, got {block_size}")
        if zstd_level is not None and (
            not isinstance(zstd_level, int) or not -7 <= zstd_level <= 22
        ):
            raise CodecError(f"zstd_level must be None or an int in [-7, 22], got {zstd_level!r}")
        if not isinstance(zstd_threads, int) or not 0 <= zstd_threads <= 64:
            raise CodecError(f"zstd_threads must be an int in [0, 64], got {zstd_threads!r}")
        self.scheme = scheme
        self.block_size = block_size if scheme != "raw" else 0
        self.zstd_level = zstd_level
        self.stochastic = bool(stochastic)
        self.zstd_threads = zstd_threads
        self.store = store
        self._rng = np.random.default_rng(seed) if stochastic else None
        self._pool = make_pool(zstd_threads)
        self._local = threading.local()

    def __repr__(self) -> str:
        if self.scheme == "raw":
            return f"codec.raw({self.store!r}, zstd_level={self.zstd_level})"
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
        tensors, total = fmt.layout(self.scheme, self.block_size, self.store, specs)
        payload = self._payload(total)
        sink = FrameSink(
            memoryview(payload).cast("B"), fmt.frame_ranges(total), self.zstd_level, self._pool
        )
        try:
            with np.errstate(all="ignore"):
                prev_end = 0
                for i, (t, (path, arr)) in enumerate(zip(tensors, items, strict=True)):
                    payload[prev_end : t.offset] = 0
                    prev_end = t.end
                    res = None if state is None else state.residuals[i]
                    new_res = None if state is None else state.spare[i]
                    self._encode_tensor(t, path, arr.reshape(-1), res, new_res, payload, sink)
            frames, entries = sink.finish()
        except BaseException:
            sink.cancel()
            raise
        header = fmt.pack_header(
            self.scheme, self.block_size, self.store, self.zstd_level is not None,
            tensors, total, entries,
        )  # fmt: skip
        return [header, *frames], (None if state is None else advance(state))

    def _payload(self, total: int) -> np.ndarray:
        """Payload buffer: reused when frames are compressed copies, fresh otherwise."""
        if self.zstd_level is None:
            return np.zeros(total, np.uint8)
        buf = getattr(self._local, "payload", None)
        if buf is None or buf.shape[0] < total:
            buf = self._local.payload = np.zeros(max(total, 1), np.uint8)
        return buf[:total]

    def _encode_tensor(self, t, path, x, res, new_res, payload, sink) -> None:
        start = t.offset
        payload[t.offset + t.codes_bytes : t.scales_offset] = 0
        if self.scheme == "raw":
            store = fmt.DTYPES[self.store]
            out = payload[t.offset : t.offset + t.codes_bytes].view(store)
            piece = fmt.FRAME_BYTES // store.itemsize
            step = 1
        else:
            levels = fmt.LEVELS[self.scheme]
            packed = levels == 7
            codes = payload[t.offset : t.offset + t.codes_bytes]
            if not packed:
                codes = codes.view(np.int8)
            scales = payload[t.scales_offset : t.end].view(np.float32)
            piece = max(self.block_size, (fmt.FRAME_BYTES // self.block_size) * self.block_size)
            step = 2 if packed else 1
            piece *= step
        ws = workspace(self.block_size or 1)
        for a in range(0, t.size, piece):
            b = min(a + piece, t.size)
            r = None if res is None else res[a:b]
            nr = None if new_res is None else new_res[a:b]
            if self.scheme == "raw":
                ok = encode_raw(x[a:b], r, nr, out[a:b], ws)
                sink.ready(start + b * out.itemsize)
            else:
                bs = self.block_size
                sc = scales[a // bs : -(-b // bs)]
                cd = codes[a // step : -(-b // step)]
                encode_blocks(x[a:b], r, nr, cd, sc, levels, ws, self._rng)
                ok = bool(np.isfinite(sc.max())) if sc.shape[0] else True
                sink.ready(start + -(-b // step))
            if not ok:
                _raise_non_finite(path, x)
        sink.ready(t.end)


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
