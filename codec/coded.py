"""Readers that keep a block-scheme tensor's codes, and the framing of codes made elsewhere.

`read_coded` gives `CodedTensor`s (the shard keeps each pending delta so,
about 1 B/param, and dequantizes a range at a time at the merge:
`decode_into`; `from_array` wraps a float32 array as one), and `read_codes`
gives a `Coded` (an island dequantizes an increment's codes on its devices).
`frame_codes` goes the other way for codes quantized elsewhere (on an
accelerator, `codec.quant.jax_rule`): it frames them with the one frame
writer, byte for byte as `Codec.encode` would. The format is specified in
codec/format.py's docstring.
"""

from dataclasses import dataclass

import numpy as np

from .format import (
    DEFAULT_MAX_ELEMENTS,
    DTYPES,
    LEVELS,
    CodecError,
    Header,
    TensorLayout,
    layout,
    parse_header,
)
from .payload import FrameWriter, block_codes, block_scales, frame_views, gather
from .quant import decode_blocks, scratch, sum_squares_int8, workspace
from .quant_rule import step_factor
from .readers import block_jobs, run_job
from .sparse import topk_entries

SQUARES_PIECE = 1 << 16  # elements decoded at a time by CodedTensor.sum_squares (not int8)

F32 = np.float32


@dataclass(frozen=True)
class CodedTensor:
    """One tensor of a message, kept coded (see the module docstring).

    Attributes:
        path: keys from the tree root to the leaf.
        shape: the decoded array's shape.
        dtype: dtype name the tensor decodes to.
        scheme: "int8", "int4", "raw" or "topk".
        block: elements per quantization block (int8, int4; 0 otherwise).
        codes: int8 codes (int8), packed uint8 nibbles (int4), stored values
            (raw), or int32 positions (topk).
        scales: float32 block absmax values (int8, int4), topk values, or an
            empty array (raw).
    """

    path: tuple
    shape: tuple
    dtype: str
    scheme: str
    block: int
    codes: np.ndarray
    scales: np.ndarray

    @property
    def size(self) -> int:
        """Element count."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes this tensor keeps (codes and scales)."""
        return int(self.codes.nbytes + self.scales.nbytes)

    def all_finite(self) -> bool:
        """Whether every decoded element is finite (what `codec.decode` would return).

        Returns:
            For int8/int4: whether a full-scale code of the largest block scale
            decodes to a finite float32 (decoding is monotone in the scale, so
            then every element does); for raw and topk: whether the kept
            values are finite.
        """
        if self.scheme in ("int8", "int4"):
            if not self.scales.size:
                return True
            levels = LEVELS[self.scheme]
            with np.errstate(over="ignore"):
                top = F32(levels) * (F32(self.scales.max()) * step_factor(levels))
            return bool(np.isfinite(top))
        values = self.scales if self.scheme == "topk" else self.codes
        # max/min propagate NaN and expose +-inf without a temporary array
        return not values.size or bool(np.isfinite(values.max()) and np.isfinite(values.min()))

    def decode_into(self, lo: int, hi: int, out: np.ndarray) -> None:
        """Write decoded elements [lo, hi) of the flattened tensor into `out`.

        For a float32 tensor these are exactly `codec.decode`'s values (for
        other dtypes, the float32 values decode casts from).

        Args:
            lo, hi: 0 <= lo <= hi <= size.
            out: float32 array of hi - lo elements.

        Raises:
            CodecError: a bad range or output.
        """
        if not 0 <= lo <= hi <= self.size or out.shape != (hi - lo,) or out.dtype != F32:
            raise CodecError(
                f"decode_into({lo}, {hi}) of {self.size} elements needs a float32 "
                f"array of {hi - lo}, got {out.dtype} {out.shape}"
            )
        if self.scheme == "raw":
            np.copyto(out, self.codes[lo:hi], casting="unsafe")
        elif self.scheme == "topk":
            out[:] = 0
            a, b = np.searchsorted(self.codes, (lo, hi))
            out[self.codes[a:b] - lo] = self.scales[a:b]
        else:
            self._dequantize(lo, hi, out)

    def sum_squares(self, lo: int = 0, hi: int | None = None) -> float:
        """Sum of the squares of decoded elements [lo, hi), in float64 (an L2 norm's square).

        int8: from the codes and block scales in one pass (`quant.sum_squares_int8`,
        within 2**-23 relative of the sum over the decoded values). Other
        schemes: decoded SQUARES_PIECE elements at a time, each piece's squares
        summed by a float64 dot product.

        Args:
            lo, hi: the range (hi None: to the end).

        Returns:
            The sum.
        """
        hi = self.size if hi is None else hi
        if self.scheme == "int8":
            return sum_squares_int8(self.codes, self.scales, lo, hi, self.block)
        buf = np.empty(min(SQUARES_PIECE, max(hi - lo, 0)), F32)
        wide = np.empty(buf.shape[0], np.float64)
        total = 0.0
        for a in range(lo, hi, SQUARES_PIECE):
            b = min(a + SQUARES_PIECE, hi)
            self.decode_into(a, b, buf[: b - a])
            np.copyto(wide[: b - a], buf[: b - a])
            total += float(np.dot(wide[: b - a], wide[: b - a]))
        return total

    def _dequantize(self, lo: int, hi: int, out: np.ndarray) -> None:
        bs = self.block
        a, b = lo - lo % bs, min(self.size, -(-hi // bs) * bs)  # whole blocks
        dst = out if (a, b) == (lo, hi) else scratch("coded_blocks", b - a, F32)
        levels = LEVELS[self.scheme]
        per = 2 if levels == 7 else 1
        codes = self.codes[a // per : -(-b // per)]
        decode_blocks(codes, self.scales[a // bs : -(-b // bs)], dst, levels, workspace(bs))
        if dst is not out:
            out[:] = dst[lo - a : hi - a]


def read_coded(frames, max_elements: int = DEFAULT_MAX_ELEMENTS) -> list[CodedTensor]:
    """The tensors of a codec message, validated and kept coded.

    Args:
        frames: list of bytes-like (bytes, memoryview, zmq.Frame), header first.
        max_elements: refuse headers declaring more elements than this
            (checked before anything is allocated or decompressed).

    Returns:
        One CodedTensor per tensor, in tree order. They keep no reference to
        `frames`: the tensors of one int8/int4/raw message share one buffer
        holding its decompressed payload.

    Raises:
        CodecError: anything `codec.decode` refuses.
    """
    try:
        views = frame_views(frames)
        header = parse_header(views[0], len(views) - 1, max_elements)
        # topk keeps its decoded entries, not the payload: assemble it in scratch memory
        reuse = header.scheme == "topk"
        payload = gather(views[1:], header.frames, header.zstd, header.total, reuse=reuse)
        with np.errstate(all="ignore"):
            return [_coded_tensor(header, t, payload) for t in header.tensors]
    except CodecError:
        raise
    except Exception as e:  # safety net: like decode, read_coded only ever raises CodecError
        raise CodecError(f"malformed frames ({type(e).__name__}: {e})") from None


def _coded_section(payload: np.ndarray, offset: int, nbytes: int, dtype) -> np.ndarray:
    return payload[offset : offset + nbytes].view(dtype)


def _coded_tensor(header: Header, t: TensorLayout, payload: np.ndarray) -> CodedTensor:
    name = "/".join(t.path)
    if header.scheme == "raw":
        store = DTYPES[header.store]
        codes = _coded_section(payload, t.offset, t.codes_bytes, store)
        return CodedTensor(t.path, t.shape, t.dtype, "raw", 0, codes, np.empty(0, F32))
    scales = _coded_section(payload, t.scales_offset, 4 * t.blocks, F32)
    if t.blocks and not (np.isfinite(scales.max()) and scales.min() >= 0):
        raise CodecError(f"tensor {name!r} has a non-finite or negative block scale")
    if header.scheme == "topk":
        section = payload[t.offset : t.offset + t.codes_bytes]
        if not t.kept:
            empty = np.empty(0, np.int32), np.empty(0, F32)
            return CodedTensor(t.path, t.shape, t.dtype, "topk", 0, *empty)
        try:
            pos, values = topk_entries(section, scales, t, header.block, header.keep, header.bits)
        except ValueError as e:
            raise CodecError(f"tensor {name!r}: {e}") from None
        index = np.int32 if t.size < 1 << 31 else np.int64
        return CodedTensor(t.path, t.shape, t.dtype, "topk", 0, pos.astype(index), values)
    code_type = np.int8 if header.scheme == "int8" else np.uint8
    codes = _coded_section(payload, t.offset, t.codes_bytes, code_type)
    return CodedTensor(t.path, t.shape, t.dtype, header.scheme, header.block, codes, scales)


def from_array(values, path: tuple = ("delta",)) -> CodedTensor:
    """A raw float32 CodedTensor holding a 1-D array (no copy when it is float32 already).

    Args:
        values: a 1-D float array.
        path: the tensor's path.

    Returns:
        The CodedTensor (scheme raw).
    """
    flat = np.ascontiguousarray(values, dtype=F32)
    if flat.ndim != 1:
        raise CodecError(f"from_array takes a 1-D array, got shape {flat.shape}")
    return CodedTensor(tuple(path), flat.shape, "float32", "raw", 0, flat, np.empty(0, F32))


def code_dtype(scheme: str) -> np.dtype:
    """The dtype of a block scheme's codes: int8 (one per element) or uint8 (two int4 per byte).

    Args:
        scheme: "int8" or "int4".

    Returns:
        np.int8 or np.uint8.
    """
    _check_scheme(scheme)
    return np.dtype(np.int8 if scheme == "int8" else np.uint8)


def _check_scheme(scheme: str) -> None:
    if scheme not in LEVELS:
        raise CodecError(f"pre-quantized codes are int8 or int4, not {scheme!r}")


def frame_codes(
    scheme: str,
    block: int,
    zstd_level: int | None,
    codes: np.ndarray,
    scales: np.ndarray,
    size: int,
    name: str = "delta",
) -> list:
    """The frames of one 1-D float32 tensor given as its codes and block scales.

    Args:
        scheme: "int8" or "int4".
        block: elements per quantization block.
        zstd_level: zstd level of the payload frames, None for none (as the codec's).
        codes: int8 [size] (int8) or uint8 [ceil(size / 2)] (int4, packed as the format says).
        scales: float32 [ceil(size / block)] block absmax values (0 for flushed blocks).
        size: the tensor's element count.
        name: the tensor's name in the tree (a decoder returns {name: values}).

    Returns:
        Frames (header first), equal to `Codec.encode({name: x}, state)`'s for the
        input whose quantization gave these codes and scales.

    Raises:
        CodecError: bad scheme, codes or scales of the wrong dtype or length, or a
            non-finite or negative scale (the input held NaN or Inf).
    """
    _check_scheme(scheme)
    codes, scales = np.asarray(codes), np.asarray(scales)
    writer = FrameWriter(scheme, block, [((name,), (size,), "float32")], zstd_level)
    (t,) = writer.tensors
    if codes.dtype != code_dtype(scheme) or codes.shape != (t.codes_bytes,):
        raise CodecError(
            f"{scheme} codes of {size} elements must be {code_dtype(scheme)}[{t.codes_bytes}], "
            f"got {codes.dtype}{list(codes.shape)}"
        )
    if scales.dtype != np.float32 or scales.shape != (t.blocks,):
        raise CodecError(
            f"scales of {size} elements in blocks of {block} must be float32[{t.blocks}], "
            f"got {scales.dtype}{list(scales.shape)}"
        )
    if t.blocks and not (np.isfinite(scales.max()) and scales.min() >= 0):
        raise CodecError(f"tensor {name!r} contains NaN or Inf; nothing was encoded")
    payload = np.zeros(writer.total, np.uint8)
    block_codes(payload, t, scheme)[...] = codes
    block_scales(payload, t)[...] = scales
    writer.close(memoryview(payload).cast("B"))
    return writer.frames()


@dataclass(frozen=True)
class Coded:
    """One block-quantized 1-D tensor as it travels: codes and scales, not yet dequantized.

    Attributes:
        scheme: "int8" or "int4".
        block: elements per block.
        size: element count.
        codes: int8 [size] or packed uint8 [ceil(size / 2)].
        scales: float32 [ceil(size / block)], finite and >= 0.
        dtype: the dtype name the tensor decodes to.
    """

    scheme: str
    block: int
    size: int
    codes: np.ndarray
    scales: np.ndarray
    dtype: str = "float32"

    @property
    def levels(self) -> int:
        """127 (int8) or 7 (int4)."""
        return LEVELS[self.scheme]

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales."""
        return self.codes.nbytes + self.scales.nbytes

    def values(self) -> np.ndarray:
        """The dequantized tensor, bit for bit what `codec.decode` gives for its frames.

        Returns:
            A fresh 1-D float32 array of `size` elements.
        """
        (t,), _ = layout(self.scheme, self.block, None, [(("x",), (self.size,), "float32")])
        codes = self.codes.view(np.uint8)  # a lone tensor's section starts at offset 0
        out = np.empty(self.size, DTYPES[self.dtype])
        for job in block_jobs(t, codes, self.scales, out, self.scheme, self.block):
            run_job(*job)
        return out.astype(np.float32, copy=False)


def read_codes(frames, name: str, max_elements: int = DEFAULT_MAX_ELEMENTS) -> Coded | None:
    """The codes and scales of frames holding one 1-D int8 or int4 tensor.

    Args:
        frames: codec frames (bytes-like), header first.
        name: the tensor's expected name (a top-level key of the tree).
        max_elements: refuse headers declaring more elements (as `codec.decode`).

    Returns:
        The tensor as codes and scales, or None when the frames hold another
        scheme (raw, topk) or anything but one 1-D tensor named `name`.

    Raises:
        CodecError: malformed frames, or a non-finite or negative scale.
    """
    try:
        views = [memoryview(f).cast("B") for f in frames]
    except TypeError:
        raise CodecError("frames must be a list of bytes-like objects") from None
    if not views:
        raise CodecError("no frames: a codec message has at least its header frame")
    header = parse_header(views[0], len(views) - 1, max_elements)
    if header.scheme not in LEVELS or len(header.tensors) != 1:
        return None
    (t,) = header.tensors
    if len(t.shape) != 1 or t.path != (name,):
        return None
    payload = gather(views[1:], header.frames, header.zstd, header.total)
    codes = block_codes(payload, t, header.scheme)
    scales = block_scales(payload, t)
    if t.blocks and not (np.isfinite(scales.max()) and scales.min() >= 0):
        raise CodecError(f"tensor {'/'.join(t.path)!r} has a non-finite or negative block scale")
    return Coded(header.scheme, header.block, t.size, codes, scales, t.dtype)
