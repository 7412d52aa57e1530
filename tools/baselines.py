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


def _topk_torch(shape):
    k = shape["k"]
    return lambda scores: torch.topk(scores, k, dim=-1, sorted=True).indices


def _topk_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.moe import topk_gate

    (scores,) = inputs
    return lambda: topk_gate(scores, shape["k"])


def _cast_torch(shape):
    g, round_scale = shape["group"], shape["round_scale"]

    def f(x):
        n, h = x.shape
        xf = x.float().view(n, h // g, g)
        amax = xf.abs().amax(-1, keepdim=True).clamp(min=1e-4)
        sf = amax / 448.0
        if round_scale:
            sf = torch.exp2(torch.ceil(torch.log2(sf)))
        q = (xf / sf).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(n, h)
        return q, sf.view(n, h // g)

    return f


def _cast_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.quant import per_token_cast

    (x,) = inputs
    return lambda: per_token_cast(x, "e4m3", shape["group"], round_sf=shape["round_scale"])


TORCH: dict[str, Callable[[Shape], Callable[..., Any]]] = {
    "sinkhorn_fwd": _sinkhorn_torch, "topk_gate": _topk_torch, "per_token_cast": _cast_torch,
}
TILE_KERNELS: dict[str, Factory] = {
    "sinkhorn_fwd": _sinkhorn_tk, "topk_gate": _topk_tk, "per_token_cast": _cast_tk,
}

# DeepSeek-style shapes per kernel (V3/V4: hidden 7168, 256 experts top-8, mHC n=4).
SHAPES: dict[str, list[Shape]] = {
    "sinkhorn_fwd": [{"num_tokens": 4096, "n": 4}, {"num_tokens": 65536, "n": 4}, {"num_tokens": 1 << 20, "n": 4}],
    "topk_gate": [
        {"num_tokens": 4096, "num_experts": 256, "k": 8}, {"num_tokens": 65536, "num_experts": 256, "k": 8},
        {"num_tokens": 65536, "num_experts": 64, "k": 6},
    ],
    "per_token_cast": [
        {"num_tokens": 4096, "hidden": 7168, "group": 128}, {"num_tokens": 32768, "hidden": 7168, "group": 128},
        {"num_tokens": 32768, "hidden": 4096, "group": 128, "round_scale": True},
    ],
}
