"""TileKernels' mhc_pre chain as its torch references compute it (the oracle of the mhc_pre_big_fuse tests)."""

import torch

from tkjit.torch_ops import tf32_round


def tk_chain(residual, fn, scale, base, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value,
             sinkhorn_repeat):
    """TileKernels' torch references (tile_kernels/torch/mhc.py) chained as its mhc_pre does, float32, fn rounded
    to TF32 as its kernels round it: (post_mix, comb_mix, layer_input)."""
    m, h = residual.shape[-2:]
    x = residual.flatten(-2).float()
    mixes = (x @ tf32_round(fn).T) * (x.square().sum(-1, keepdim=True) / (m * h) + rms_eps).rsqrt()
    s = torch.cat([scale[0].expand(m), scale[1].expand(m), scale[2].expand(m * m)])
    z = mixes * s + base
    pre = z[..., :m].sigmoid().unsqueeze(-1) + mhc_pre_eps
    post = (z[..., m:2 * m].sigmoid() * mhc_post_mult_value).unsqueeze(-1)
    comb = z[..., 2 * m:].unflatten(-1, (m, m)).softmax(-1) + mhc_sinkhorn_eps
    comb = comb / (comb.sum(-2, keepdim=True) + mhc_sinkhorn_eps)
    for _ in range(sinkhorn_repeat - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + mhc_sinkhorn_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + mhc_sinkhorn_eps)
    return post, comb, (residual * pre).sum(-2).bfloat16()
