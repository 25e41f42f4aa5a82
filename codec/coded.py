"""Coded tensors: a message's tensors validated and kept as they arrived, decoded a range at a time.

Owns `read` (frames -> one `CodedTensor` per tensor) and `CodedTensor`: what
a receiver keeps of a tensor instead of its decoded float32 values, and how it
reconstructs any range [lo, hi) of them on demand (`decode_into`), bit for bit
what `codec.decode` returns for those elements. `read` checks everything
`decode` checks (header, frame sizes and checksums, finite non-negative block
scales, topk offsets) before it returns, so a tensor it returns always
decodes.

What is kept, per scheme (`CodedTensor.nbytes` counts it):

- int8 / int4: the codes and the float32 block scales, decompressed
  (1 + 4 / block bytes per element for int8: 1.016 at block 256). zstd buys
  3-20% fewer int8 bytes (`codec` package docstring) but decompressing at
  decode time is most of the decode, so a kept tensor trades that memory for
  a cheaper `decode_into`;
- raw: the stored values (4 bytes per element for float32, 2 for bfloat16);
- topk: the listed entries, int32 positions and float32 values (8 bytes each).
"""

from dataclasses import dataclass

import numpy as np

from . import format as fmt
from .compress import gather
from .decode import _views
from .errors import CodecError
from .quant import decode_blocks, step_factor
from .sparse import topk_entries
from .workspace import scratch, workspace

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
            levels = fmt.LEVELS[self.scheme]
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

    def _dequantize(self, lo: int, hi: int, out: np.ndarray) -> None:
        bs = self.block
        a, b = lo - lo % bs, min(self.size, -(-hi // bs) * bs)  # whole blocks
        dst = out if (a, b) == (lo, hi) else scratch("coded_blocks", b - a, F32)
        levels = fmt.LEVELS[self.scheme]
        per = 2 if levels == 7 else 1
        codes = self.codes[a // per : -(-b // per)]
        decode_blocks(codes, self.scales[a // bs : -(-b // bs)], dst, levels, workspace(bs))
        if dst is not out:
            out[:] = dst[lo - a : hi - a]


def read(frames, max_elements: int = fmt.DEFAULT_MAX_ELEMENTS) -> list[CodedTensor]:
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
        views = _views(frames)
        header = fmt.parse_header(views[0], len(views) - 1, max_elements)
        # topk keeps its decoded entries, not the payload: assemble it in scratch memory
        reuse = header.scheme == "topk"
        payload = gather(views[1:], header.frames, header.zstd, header.total, reuse=reuse)
        with np.errstate(all="ignore"):
            return [_tensor(header, t, payload) for t in header.tensors]
    except CodecError:
        raise
    except Exception as e:  # safety net: like decode, read only ever raises CodecError
        raise CodecError(f"malformed frames ({type(e).__name__}: {e})") from None


def _section(payload: np.ndarray, offset: int, nbytes: int, dtype) -> np.ndarray:
    return payload[offset : offset + nbytes].view(dtype)


def _tensor(header: fmt.Header, t: fmt.TensorLayout, payload: np.ndarray) -> CodedTensor:
    name = "/".join(t.path)
    if header.scheme == "raw":
        store = fmt.DTYPES[header.store]
        codes = _section(payload, t.offset, t.codes_bytes, store)
        return CodedTensor(t.path, t.shape, t.dtype, "raw", 0, codes, np.empty(0, F32))
    scales = _section(payload, t.scales_offset, 4 * t.blocks, F32)
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
    codes = _section(payload, t.offset, t.codes_bytes, code_type)
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
