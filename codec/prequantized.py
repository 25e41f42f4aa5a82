"""Frames for codes and scales quantized elsewhere (e.g. on an accelerator), and codes read back.

An encoder that quantizes on a device (`codec.jax_quant`) hands the host
only a tensor's int8/int4 codes and float32 block scales; `frame_codes` lays
them out, compresses and frames them with `Codec.encode`'s own frame writer
(`codec.writer`) for the same codes and scales, so a shard cannot
tell the two apart: for the same input and error-feedback residual the frames
are byte for byte the same. `read_codes` goes the other way for one
block-scheme tensor: it checks and decompresses the frames once and keeps the
codes and scales (to dequantize on a device), while `Coded.values` gives what
`codec.decode` gives for them, through decode's own kernels.
"""

from dataclasses import dataclass

import numpy as np

from . import format as fmt
from .compress import gather
from .decode import block_jobs, run_job
from .errors import CodecError
from .writer import FrameWriter, block_codes, block_scales


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
    if scheme not in fmt.LEVELS:
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
        return fmt.LEVELS[self.scheme]

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales."""
        return self.codes.nbytes + self.scales.nbytes

    def values(self) -> np.ndarray:
        """The dequantized tensor, bit for bit what `codec.decode` gives for its frames.

        Returns:
            A fresh 1-D float32 array of `size` elements.
        """
        (t,), _ = fmt.layout(self.scheme, self.block, None, [(("x",), (self.size,), "float32")])
        codes = self.codes.view(np.uint8)  # a lone tensor's section starts at offset 0
        out = np.empty(self.size, fmt.DTYPES[self.dtype])
        for job in block_jobs(t, codes, self.scales, out, self.scheme, self.block):
            run_job(*job)
        return out.astype(np.float32, copy=False)


def read_codes(frames, name: str, max_elements: int = fmt.DEFAULT_MAX_ELEMENTS) -> Coded | None:
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
    header = fmt.parse_header(views[0], len(views) - 1, max_elements)
    if header.scheme not in fmt.LEVELS or len(header.tensors) != 1:
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
