"""What tkjit is measured against, per kernel: TileKernels' shipped kernel and a torch version.

Each entry maps a full shape to a zero-arg callable over given inputs, or None when the baseline
cannot run that shape. TileKernels is imported only here, and only when it is installed: it is a
baseline, never a dependency.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Shape = dict[str, Any]
Factory = Callable[[Shape, tuple], Callable[[], Any] | None]


def _tile_kernels():
    try:
        import tile_kernels  # noqa: F401

        return tile_kernels
    except Exception:
        return None


def _sinkhorn_torch(shape):
    eps, repeat = shape["eps"], shape["repeat"]

    def f(x):
        y = x.softmax(-1) + eps
        y = y / (y.sum(-2, keepdim=True) + eps)
        for _ in range(repeat - 1):
            y = y / (y.sum(-1, keepdim=True) + eps)
            y = y / (y.sum(-2, keepdim=True) + eps)
        return y

    return f


def _sinkhorn_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.mhc.sinkhorn_kernel import _mhc_sinkhorn_fwd

    (x,) = inputs
    kernel = _mhc_sinkhorn_fwd(shape["n"], 1, shape["repeat"], shape["eps"])  # its shipped token block: 1
    out = torch.empty_like(x)
    return lambda: kernel(x, out)


TORCH: dict[str, Callable[[Shape], Callable[..., Any]]] = {"sinkhorn_fwd": _sinkhorn_torch}
TILE_KERNELS: dict[str, Factory] = {"sinkhorn_fwd": _sinkhorn_tk}

# DeepSeek-style shapes per kernel (V3/V4: hidden 7168, 256 experts top-8, mHC n=4).
SHAPES: dict[str, list[Shape]] = {
    "sinkhorn_fwd": [{"num_tokens": 4096, "n": 4}, {"num_tokens": 65536, "n": 4}, {"num_tokens": 1 << 20, "n": 4}],
}
