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


def _sinkhorn_bwd_torch(shape):
    fwd = _sinkhorn_torch(shape)

    def f(grad_out, x):
        with torch.enable_grad():
            xg = x.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(fwd(xg), xg, grad_out)
        return g

    return f


def _sinkhorn_bwd_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.mhc.sinkhorn_kernel import _mhc_sinkhorn_bwd

    grad_out, x = inputs
    kernel = _mhc_sinkhorn_bwd(shape["n"], 32, shape["repeat"], shape["eps"])  # its shipped token block: 32
    out = torch.empty_like(x)
    return lambda: kernel(grad_out, x, out)


def _transpose_torch(shape):
    return lambda x: x.transpose(-1, -2).contiguous()


def _transpose_tk(shape, inputs):
    if _tile_kernels() is None or shape["rows"] % 64 or shape["cols"] % 64:
        return None  # TileKernels' transpose takes multiples of 64 only
    from tile_kernels.transpose import transpose

    (x,) = inputs
    return lambda: transpose(x)


TORCH: dict[str, Callable[[Shape], Callable[..., Any]]] = {
    "sinkhorn_fwd": _sinkhorn_torch, "sinkhorn_bwd": _sinkhorn_bwd_torch, "topk_gate": _topk_torch,
    "per_token_cast": _cast_torch, "transpose": _transpose_torch,
}
TILE_KERNELS: dict[str, Factory] = {
    "sinkhorn_fwd": _sinkhorn_tk, "sinkhorn_bwd": _sinkhorn_bwd_tk, "topk_gate": _topk_tk,
    "per_token_cast": _cast_tk, "transpose": _transpose_tk,
}

# DeepSeek-style shapes per kernel (V3/V4: hidden 7168, 256 experts top-8, mHC n=4).
SHAPES: dict[str, list[Shape]] = {
    "sinkhorn_fwd": [{"num_tokens": 4096, "n": 4}, {"num_tokens": 1 << 20, "n": 4}],
    "sinkhorn_bwd": [{"num_tokens": 262144, "n": 4}],
    "topk_gate": [{"num_tokens": 4096, "num_experts": 256, "k": 8}, {"num_tokens": 65536, "num_experts": 256, "k": 8}],
    "per_token_cast": [
        {"num_tokens": 4096, "hidden": 7168, "group": 128}, {"num_tokens": 32768, "hidden": 7168, "group": 128},
    ],
    "transpose": [{"rows": 16384, "cols": 7168, "dtype": "bfloat16"}, {"rows": 4001, "cols": 576, "dtype": "bfloat16"}],
}
