"""Kernels of the raw schemes: store float32 or bfloat16 values as they are.

Owns the cast to the stored dtype, its error-feedback residual (zero for a
float32 store, the bfloat16 rounding error otherwise) and the finiteness check
done on the way.
"""

import ml_dtypes
import numpy as np

from .workspace import Workspace

BF16_MAX = np.float32(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def encode_raw(x, res, new_res, out, ws: Workspace) -> bool:
    """Copy `x` (+ `res`) into `out`, casting to its dtype.

    Args:
        x: 1-D float32/float16/bfloat16 input.
        res: 1-D float32 residual or None.
        new_res: 1-D float32 output residual or None.
        out: 1-D output in the stored dtype (float32 or bfloat16).
        ws: workspace (block size 1).

    Returns:
        True when every value written is finite.
    """
    n, chunk = x.shape[0], ws.chunk
    exact = out.dtype == np.float32
    finite = True
    for a in range(0, n, chunk):
        m = min(chunk, n - a)
        if res is None and x.dtype == np.float32:
            src = x[a : a + m]
        else:
            src = ws.tmp[:m]
            np.copyto(src, x[a : a + m], casting="unsafe")
            if res is not None:
                np.add(src, res[a : a + m], out=src)
        hi, lo = src.max(), src.min()
        finite = finite and bool(np.isfinite(hi) and np.isfinite(lo))
        stored = src
        if not exact and (hi > BF16_MAX or lo < -BF16_MAX):
            # would round to +-inf in bfloat16: saturate; the residual keeps the rest
            stored = ws.noise[:m]
            np.clip(src, -BF16_MAX, BF16_MAX, out=stored)
        np.copyto(out[a : a + m], stored, casting="unsafe")
        if new_res is not None:
            if exact:
                new_res[a : a + m] = 0
            else:
                back = ws.work[:m]
                np.copyto(back, out[a : a + m], casting="unsafe")
                np.subtract(src, back, out=new_res[a : a + m])
    return finite
