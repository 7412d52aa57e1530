"""What tkjit is measured against, per kernel: TileKernels' shipped kernel and a torch version.

Each entry maps a full shape to a zero-arg callable over given inputs, or None when the baseline
cannot run that shape. TileKernels is imported only here, and only when it is installed: it is a
baseline, never a dependency.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tkjit.torch_ops import pre_norm_fn_partials

Shape = dict[str, Any]
Factory = Callable[[Shape, tuple], Callable[[], Any] | None]


def _tile_kernels():
    try:
        import tile_kernels  # noqa: F401

        return tile_kernels
    except Exception:
        return None


def _readable_map(pos, n):
    """A map's entries outside [0, n) as -1: tkjit reads them as absent (zero rows, weight 0), TileKernels would
    read past its table (the specs' make_inputs put such entries in on odd seeds, the benchmark's)."""
    return torch.where((pos >= 0) & (pos < n), pos, torch.full_like(pos, -1))


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


# -- normalize_weight, mask_indices_by_tp, inplace_unique_group_indices ------------------------------

def _normalize_weight_torch(shape):
    def f(w):
        s = torch.full((w.shape[0],), 1e-20, dtype=torch.float32, device=w.device)
        for j in range(w.shape[1]):
            s = s + w[:, j]
        return s, w / s[:, None]

    return f


def _normalize_weight_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.moe import normalize_weight

    (w,) = inputs
    return lambda: normalize_weight(w)


def _mask_tp_torch(shape):
    def f(x, per_gpu, tp_rank, num_tp_ranks):
        g = x.div(per_gpu, rounding_mode="floor")
        keep = (x >= 0) & (g.remainder(num_tp_ranks) == tp_rank)
        return torch.where(keep, g.div(num_tp_ranks, rounding_mode="floor") * per_gpu + x.remainder(per_gpu), -1)

    return f


def _mask_tp_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.moe import mask_indices_by_tp

    x, per_gpu, tp_rank, num_tp_ranks = inputs
    num_ep_ranks = 8  # any: TileKernels only uses n // num_ep_ranks
    return lambda: mask_indices_by_tp(x, per_gpu * num_ep_ranks, num_ep_ranks, tp_rank, num_tp_ranks)


def _unique_groups_torch(shape):
    groups = shape["num_groups"]

    def f(x):  # in place, as the kernel (after the first call there is nothing left to clear)
        k = x.shape[1]
        earlier = torch.ones(k, k, dtype=torch.bool, device=x.device).tril(-1)
        repeat = ((x[:, :, None] == x[:, None, :]) & earlier).any(-1)
        x.masked_fill_(repeat & (x >= 0) & (x < groups), -1)

    return f


def _unique_groups_tk(shape, inputs):
    if _tile_kernels() is None or shape["num_groups"] > 128:
        return None
    from tile_kernels.moe import inplace_unique_group_indices

    (x,) = inputs
    x = x.clone()
    x[(x < -1) | (x >= shape["num_groups"])] = -1  # TileKernels asserts on out-of-range ids
    return lambda: inplace_unique_group_indices(x, shape["num_groups"])


TORCH.update({"normalize_weight": _normalize_weight_torch, "mask_indices_by_tp": _mask_tp_torch,
              "inplace_unique_group_indices": _unique_groups_torch})
TILE_KERNELS.update({"normalize_weight": _normalize_weight_tk, "mask_indices_by_tp": _mask_tp_tk,
                     "inplace_unique_group_indices": _unique_groups_tk})
SHAPES.update({
    "normalize_weight": [{"num_tokens": 8192, "num_topk": 8}, {"num_tokens": 65536, "num_topk": 8}],
    "mask_indices_by_tp": [{"num_tokens": 8192, "num_topk": 8, "dtype": "int64"},
                           {"num_tokens": 65536, "num_topk": 8, "dtype": "int64"}],
    "inplace_unique_group_indices": [{"num_tokens": 8192, "num_topk": 8, "num_groups": 8},
                                     {"num_tokens": 65536, "num_topk": 8, "num_groups": 8}],
})


# -- get_fused_mapping -------------------------------------------------------------------------------

def _fused_mapping_torch(shape):
    from tkjit_kernels.moe.get_fused_mapping import reference

    # The spec's plain-torch reference (stable sort by expert); the workspace input is ignored.
    return lambda topk_idx, workspace: reference(shape, topk_idx, workspace)


def _fused_mapping_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.moe import get_fused_mapping

    topk_idx, _ = inputs
    e, nexp, a = shape["num_experts"], shape["num_expanded_tokens"], shape["alignment"]
    topk_idx = topk_idx.clone()
    topk_idx[(topk_idx < -1) | (topk_idx >= e)] = -1  # TileKernels writes out of bounds on out-of-range ids
    return lambda: get_fused_mapping(topk_idx, e, nexp, a)


def _fused_shape(tokens, k, e, a):
    from tkjit_kernels.moe.get_fused_mapping import upper_bound

    return {"num_tokens": tokens, "num_topk": k, "num_experts": e, "alignment": a,
            "num_expanded_tokens": upper_bound(tokens, k, e, a)}


TORCH["get_fused_mapping"] = _fused_mapping_torch
TILE_KERNELS["get_fused_mapping"] = _fused_mapping_tk
SHAPES["get_fused_mapping"] = [_fused_shape(8192, 8, 256, 128), _fused_shape(8192, 8, 256, 64),
                               _fused_shape(4001, 8, 256, 128), _fused_shape(65536, 8, 256, 128)]


# -- group_count, aux_fi, topk_sum_and_topk_group_idx ------------------------------------------------

def _group_count_torch(shape):
    groups = shape["num_groups"]

    def f(idx):
        flat = idx.reshape(-1)
        return torch.bincount(flat[(flat >= 0) & (flat < groups)], minlength=groups).int()

    return f


def _group_count_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.moe import group_count

    (idx,) = inputs
    if ((idx >= shape["num_groups"]) | (idx < -1)).any():  # TileKernels asserts on out-of-range ids
        idx = idx.clamp(-1, shape["num_groups"] - 1)
    return lambda: group_count(idx, shape["num_groups"])


def _aux_fi_torch(shape):
    experts = shape["num_experts"]

    def f(idx, num_aux_topk):
        flat = idx.reshape(-1)
        counts = torch.bincount(flat[(flat >= 0) & (flat < experts)], minlength=experts)
        return counts.float() * experts / (idx.shape[0] * num_aux_topk)

    return f


def _aux_fi_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.moe import aux_fi

    idx, num_aux_topk = inputs
    if ((idx >= shape["num_experts"]) | (idx < -1)).any():
        idx = idx.clamp(-1, shape["num_experts"] - 1)
    return lambda: aux_fi(idx, shape["num_experts"], num_aux_topk)


def _topk_sum_torch(shape):
    ks, kg = shape["num_topk_sum"], shape["num_topk_groups"]

    def f(scores):
        sums = scores.topk(ks, dim=-1, sorted=False).values.sum(-1)
        return torch.sort(sums, dim=-1, descending=True, stable=True).indices[:, :kg]

    return f


def _topk_sum_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.moe import topk_sum_and_topk_group_idx

    (scores,) = inputs
    return lambda: topk_sum_and_topk_group_idx(scores, shape["num_topk_sum"], shape["num_topk_groups"])


TORCH.update({"group_count": _group_count_torch, "aux_fi": _aux_fi_torch,
              "topk_sum_and_topk_group_idx": _topk_sum_torch})
TILE_KERNELS.update({"group_count": _group_count_tk, "aux_fi": _aux_fi_tk,
                     "topk_sum_and_topk_group_idx": _topk_sum_tk})
SHAPES.update({
    "group_count": [{"num_tokens": n, "num_topk": 8, "num_groups": 256} for n in (4096, 8192, 65536)],
    "aux_fi": [{"num_tokens": n, "num_topk": 8, "num_experts": 256} for n in (4096, 8192, 65536)],
    "topk_sum_and_topk_group_idx": [
        {"num_tokens": n, "num_groups": 8, "num_experts_per_group": 32, "num_topk_sum": 2, "num_topk_groups": 4}
        for n in (8192, 65536)
    ],
})


# -- expand_to_fused, reduce_fused -------------------------------------------------------------------
# Odd-seed inputs hold out-of-range positions (tkjit skips them); TileKernels and the torch versions read
# through them, so they get the positions with those entries set to -1 (what tkjit does with them).

def _in_range(pos, rows):
    return torch.where((pos >= 0) & (pos < rows), pos, -1)


def _expand_torch(shape):
    def f(x, pos, pos_to_expert):
        pos = _in_range(pos, pos_to_expert.shape[0])
        out = torch.zeros((pos_to_expert.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        flat = pos.reshape(-1).long()
        ok = flat >= 0
        out[flat[ok]] = x.repeat_interleave(pos.shape[1], 0)[ok]
        return out

    return f


def _expand_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.moe import expand_to_fused

    x, pos, pos_to_expert = inputs
    pos = _in_range(pos, pos_to_expert.shape[0])
    return lambda: expand_to_fused(x, pos, pos_to_expert)


def _reduce_torch(shape):
    from tkjit_kernels.moe.reduce_fused import split_inputs

    def f(*inputs):  # the weighted sum in float32 (multiply-adds, not bit-exact FMAs)
        x, w, pos, sf, x_sf = split_inputs(shape, inputs)
        pos = _in_range(pos, x.shape[0])
        ok = (pos >= 0)[..., None]
        rows = x[pos.clamp(min=0).long()].float()
        s = w if w is not None else torch.ones(pos.shape, device=x.device)
        if x_sf is not None:
            s = s * x_sf[pos.clamp(min=0).long()]
        acc = (rows * s[..., None] * ok).sum(1)
        if sf is not None:
            acc = acc * sf[0]
        return acc.to(torch.float8_e4m3fn if shape["e4m3_out"] else x.dtype)

    return f


def _reduce_tk(shape, inputs):
    if _tile_kernels() is None or shape["hidden"] % 256:
        return None  # TileKernels' reduce_fused takes hidden multiples of 256 only
    from tile_kernels.moe import reduce_fused

    from tkjit_kernels.moe.reduce_fused import split_inputs

    x, w, pos, sf, x_sf = split_inputs(shape, inputs)
    pos = _in_range(pos, x.shape[0])
    xq = (x, x_sf) if x_sf is not None else x
    fmt = "e4m3" if shape["e4m3_out"] else ""
    return lambda: reduce_fused(xq, w, pos, fmt, sf)


TORCH.update({"expand_to_fused": _expand_torch, "reduce_fused": _reduce_torch})
TILE_KERNELS.update({"expand_to_fused": _expand_tk, "reduce_fused": _reduce_tk})
_FUSED_ROWS = 8192 * 8 + 256 * 64  # 8192 tokens, top-8, 256 experts aligned to 64 (upper bound of the padding)
SHAPES.update({
    "expand_to_fused": [
        {"num_tokens": 8192, "num_expanded_tokens": _FUSED_ROWS, "hidden": h, "num_topk": 8, "dtype": "bfloat16"}
        for h in (7168, 4096, 576)
    ] + [{"num_tokens": 8192, "num_expanded_tokens": _FUSED_ROWS, "hidden": 7168, "num_topk": 8,
          "dtype": "float8_e4m3fn"}],
    "reduce_fused": [
        {"num_tokens": 8192, "num_expanded_tokens": _FUSED_ROWS, "hidden": h, "num_topk": 8} for h in (7168, 4096)
    ] + [{"num_tokens": 8192, "num_expanded_tokens": _FUSED_ROWS, "hidden": 7168, "num_topk": 8, "e4m3_out": True,
          "has_x_sf": True, "has_sf": True}],
})


# -- expand_to_fused_with_sf (row-major and TMA-aligned column-major scales) --------------------------

def _expand_sf_torch(col_major):
    def make(shape):
        def f(x, x_sf, pos, pos_to_expert):
            pos = _in_range(pos, pos_to_expert.shape[0])
            p, k = pos_to_expert.shape[0], pos.shape[1]
            flat = pos.reshape(-1).long()
            ok = flat >= 0
            out = torch.zeros((p, x.shape[1]), dtype=x.dtype, device=x.device)
            out[flat[ok]] = x.repeat_interleave(k, 0)[ok]
            sw = x_sf.shape[1]
            if col_major:  # TileKernels' reference: the .T view of a (hidden_sf, align(p, 4)) buffer
                out_sf = torch.zeros((sw, -(-p // 4) * 4), dtype=x_sf.dtype, device=x.device)[:, :p].T
            else:
                out_sf = torch.zeros((p, sw), dtype=x_sf.dtype, device=x.device)
            out_sf[flat[ok]] = x_sf.repeat_interleave(k, 0)[ok]
            return out, out_sf

        return f

    return make


def _expand_sf_tk(col_major):
    def make(shape, inputs):
        if _tile_kernels() is None:
            return None
        from tile_kernels.moe import expand_to_fused_with_sf

        x, x_sf, pos, pos_to_expert = inputs
        pos = _in_range(pos, pos_to_expert.shape[0])
        npc = shape["num_per_channels"]
        return lambda: expand_to_fused_with_sf((x, x_sf), npc, pos, pos_to_expert, col_major)

    return make


TORCH.update({"expand_to_fused_with_sf": _expand_sf_torch(False),
              "expand_to_fused_with_sf_colmajor": _expand_sf_torch(True)})
TILE_KERNELS.update({"expand_to_fused_with_sf": _expand_sf_tk(False),
                     "expand_to_fused_with_sf_colmajor": _expand_sf_tk(True)})
SHAPES.update({
    "expand_to_fused_with_sf": [
        {"num_tokens": 8192, "num_expanded_tokens": _FUSED_ROWS, "hidden": h, "num_topk": 8,
         "num_per_channels": 128, "dtype": "float8_e4m3fn", "sf_dtype": "float32"} for h in (7168, 4096)
    ],
    "expand_to_fused_with_sf_colmajor": [
        {"num_tokens": 8192, "num_expanded_tokens": _FUSED_ROWS, "hidden": 7168, "num_topk": 8,
         "num_per_channels": 128, "dtype": "float8_e4m3fn", "sf_dtype": "float32"},
        {"num_tokens": 8192, "num_expanded_tokens": _FUSED_ROWS, "hidden": 7168, "num_topk": 8,
         "num_per_channels": 32, "dtype": "float8_e4m3fn", "sf_dtype": "int32"},
    ],
})


# -- top2_sum_gate -----------------------------------------------------------------------------------

def _top2_sum_gate_torch(shape):
    from tkjit_kernels.moe.top2_sum_gate import reference

    return lambda *inputs: reference(shape, *inputs)  # plain torch eager (sort-based selection)


def _top2_sum_gate_tk(shape, inputs):
    if _tile_kernels() is None or shape.get("has_map"):
        return None
    from tile_kernels.moe import top2_sum_gate

    logits, bias, rsf, ep_rank, per_gpu, tp_rank, num_tp_ranks = inputs
    num_ep_ranks = shape["num_experts"] // per_gpu
    return lambda: top2_sum_gate(logits, bias, shape["num_topk"], shape["num_topk_groups"], shape["num_groups"],
                                 False, 0, rsf, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, shape["scoring_func"])


TORCH["top2_sum_gate"] = _top2_sum_gate_torch
TILE_KERNELS["top2_sum_gate"] = _top2_sum_gate_tk
SHAPES["top2_sum_gate"] = [
    {"num_tokens": n, "num_experts": 256, "num_topk": 8, "num_groups": 8, "num_topk_groups": 4} for n in (8192, 65536)
] + [{"num_tokens": 8192, "num_experts": 256, "num_topk": 8, "num_groups": 8, "num_topk_groups": 4,
      "scoring_func": "softmax"}]


# -- engram_hash, fused_weight ------------------------------------------------------------------------
# TileKernels ships no benchmark for these: its kernels' defaults (3-grams, 2 layers, 8 tables per n-gram)
# at prefill-sized batches, and the gate's weights at mHC rate 4 and V3 / smaller hidden sizes.

def _engram_hash_torch(shape):
    from tkjit_kernels.engram.engram_hash import reference

    return lambda *inputs: reference(shape, *inputs)  # plain torch: int64 products, xor, remainder


def _engram_hash_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.engram import engram_hash

    return lambda: engram_hash(*inputs)


def _fused_weight_torch(shape):
    return lambda wh, we: wh.float() * we.float()


def _fused_weight_tk(shape, inputs):
    if _tile_kernels() is None or shape["hidden_size"] % 256:
        return None  # TileKernels' fused_weight takes multiples of 256 only
    from tile_kernels.engram import fused_weight

    return lambda: fused_weight(*inputs)


TORCH.update({"engram_hash": _engram_hash_torch, "fused_weight": _fused_weight_torch})
TILE_KERNELS.update({"engram_hash": _engram_hash_tk, "fused_weight": _fused_weight_tk})
SHAPES.update({
    "engram_hash": [{"num_tokens": n, "max_ngram_size": 3, "num_ngram_layers": 2, "num_embed_table_per_ngram": 8}
                    for n in (4096, 8192, 65536)],
    "fused_weight": [{"hc_mult": 4, "hidden_size": h} for h in (7168, 4096)],
})


# -- cast_back (FP8 / FP4 dequantisation; float32 row-major, column-major and packed UE8M0 scales) ------------

def _cast_back_torch(col_major):
    def make(shape):
        from tkjit_kernels.quant.cast_back import reference, reference_colmajor

        ref = reference_colmajor if col_major else reference
        return lambda x, sf: ref(shape, x, sf)  # plain torch eager: decode, expand the scales, multiply

    return make


# -- per_channel_cast, per_channel_cast_and_transpose -------------------------------------------------
# The specs' x is the (token_blocks, num_per_tokens, hidden) view of TileKernels' (num_tokens, hidden) x.

def _per_channel_torch(transposed):
    def make(shape):
        round_scale = shape["round_scale"]

        def f(x):
            xf = x.float()
            amax = xf.abs().amax(1, keepdim=True).clamp(min=1e-4)
            sf = amax / 448.0
            if round_scale:
                sf = torch.exp2(torch.ceil(torch.log2(sf)))
            q = (xf / sf).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(-1, x.shape[2])
            return (q.T.contiguous() if transposed else q), sf.squeeze(1)

        return f

    return make


def _cast_back_tk(col_major):
    def make(shape, inputs):
        if _tile_kernels() is None:
            return None
        from tile_kernels.quant import cast_back

        x, sf = inputs
        sf = sf.T if col_major else sf  # the column-major (num_sf_rows, ...) view TileKernels takes
        fmt = "bf16" if shape["out_dtype"] == "bfloat16" else "fp32"
        return lambda: cast_back((x, sf), fmt, (shape["block_tokens"], shape["block_channels"]))

    return make


# -- per_block_cast ----------------------------------------------------------------------------------

def _block_cast_torch(shape):
    from tkjit_kernels.quant.per_block_cast import reference

    return lambda x: reference(shape, x)  # plain torch on x's device: pad, block amax, scale, cast


def _block_cast_with_sf_torch(shape):
    from tkjit_kernels.quant.per_block_cast import _cast

    return lambda x, sf: _cast(shape, x, sf.reciprocal()[:, None, :, None])


def _block_cast_tk(col_major):
    def make(shape, inputs):
        if _tile_kernels() is None or shape["hidden"] % 64 or {shape["block_m"], shape["block_k"]} - {32, 128}:
            return None  # TileKernels' per_block_cast: blocks of 32 or 128, hidden a multiple of 64
        from tile_kernels.quant import per_block_cast

        (x,) = inputs
        block = (shape["block_m"], shape["block_k"])
        return lambda: per_block_cast(x, shape["fmt"], block, col_major, shape["round_scale"])

    return make


def _per_channel_tk(transposed):
    def make(shape, inputs):
        npt, h = shape["num_per_tokens"], shape["hidden"]
        (x,) = inputs
        tokens = x.shape[0] * npt
        if _tile_kernels() is None or tokens % 128 or h % 64:
            return None  # TileKernels takes multiples of 128 tokens and 64 channels only
        if transposed and shape["in_dtype"] != "bfloat16":
            return None  # its transposing cast takes bf16 only
        if not transposed and (npt != 128 or h % 128):
            return None  # its per_channel_cast: 128 tokens per scale (its kernel tiles 128 channels)
        from tile_kernels import quant

        fn = quant.per_channel_cast_and_transpose if transposed else quant.per_channel_cast
        x2 = x.view(tokens, h)
        return lambda: fn(x2, "e4m3", npt, shape["round_scale"])

    return make


TORCH.update({"cast_back": _cast_back_torch(False), "cast_back_colmajor": _cast_back_torch(True)})
TILE_KERNELS.update({"cast_back": _cast_back_tk(False), "cast_back_colmajor": _cast_back_tk(True)})
SHAPES.update({
    "cast_back": [
        {"num_tokens": n, "num_sf_rows": n, "hidden": 7168, "block_channels": 128} for n in (4096, 32768)
    ] + [
        {"num_tokens": 4096, "num_sf_rows": 32, "hidden": 7168, "block_tokens": 128, "block_channels": 128},
        {"num_tokens": 4096, "num_sf_rows": 4096, "hidden": 7168, "block_channels": 128, "out_dtype": "float32"},
        {"num_tokens": 4096, "num_sf_rows": 4096, "hidden": 7168, "block_channels": 32, "in_fmt": "e2m1"},
    ],
    "cast_back_colmajor": [
        {"num_tokens": 32768, "num_sf_rows": 32768, "hidden": 7168, "block_channels": 128},
        {"num_tokens": 32768, "num_sf_rows": 32768, "hidden": 7168, "block_channels": 32, "in_fmt": "e2m1",
         "sf_dtype": "int32"},
    ],
})


def _block_cast_with_sf_tk(shape, inputs):
    if _tile_kernels() is None or shape["hidden"] % 64 or {shape["block_m"], shape["block_k"]} - {32, 128}:
        return None
    from tile_kernels.quant import per_block_cast_with_precomputed_sf

    x, sf = inputs
    return lambda: per_block_cast_with_precomputed_sf(x, shape["fmt"], (shape["block_m"], shape["block_k"]), sf)


TORCH.update({"per_block_cast": _block_cast_torch, "per_block_cast_with_sf": _block_cast_with_sf_torch})
TILE_KERNELS.update({"per_block_cast": _block_cast_tk(False), "per_block_cast_colmajor": _block_cast_tk(True),
                     "per_block_cast_with_sf": _block_cast_with_sf_tk})
SHAPES.update({
    # DeepSeek-V3: 128 x 128 weight blocks (7168 x 2048 and 2048 x 7168 projections), activations
    # 4096 / 32768 tokens x 7168; 32 x 32 blocks (TileKernels' default block_size in its reference).
    "per_block_cast": [
        {"num_tokens": 4096, "hidden": 7168, "block_m": 128, "block_k": 128},
        {"num_tokens": 32768, "hidden": 7168, "block_m": 128, "block_k": 128},
        {"num_tokens": 7168, "hidden": 2048, "block_m": 128, "block_k": 128, "round_scale": True},
        {"num_tokens": 4096, "hidden": 7168, "block_m": 32, "block_k": 32},
        {"num_tokens": 32768, "hidden": 7168, "block_m": 128, "block_k": 128, "fmt": "e2m1"},
        {"num_tokens": 4096, "hidden": 7168, "block_m": 32, "block_k": 32, "fmt": "e2m1", "round_scale": True},
    ],
    "per_block_cast_colmajor": [
        {"num_tokens": 4096, "hidden": 7168, "block_m": 128, "block_k": 128, "round_scale": True},
        {"num_tokens": 4096, "hidden": 7168, "block_m": 32, "block_k": 32},
    ],
    "per_block_cast_with_sf": [
        {"num_tokens": 4096, "hidden": 7168, "block_m": 128, "block_k": 128},
        {"num_tokens": 32768, "hidden": 7168, "block_m": 128, "block_k": 128},
        {"num_tokens": 32768, "hidden": 7168, "block_m": 128, "block_k": 128, "fmt": "e2m1"},
    ],
})


TORCH.update({"per_channel_cast": _per_channel_torch(False),
              "per_channel_cast_and_transpose": _per_channel_torch(True)})
TILE_KERNELS.update({"per_channel_cast": _per_channel_tk(False),
                     "per_channel_cast_and_transpose": _per_channel_tk(True)})
SHAPES.update({  # TileKernels' benchmark: 4096 tokens (and 8064 = 8001 aligned), its hidden sizes, 32/128 per scale
    "per_channel_cast": [
        {"token_blocks": 32, "hidden": h, "num_per_tokens": 128} for h in (7168, 4096, 2048)
    ] + [{"token_blocks": 256, "hidden": 7168, "num_per_tokens": 128}],
    "per_channel_cast_and_transpose": [
        {"token_blocks": 4096 // npt, "hidden": h, "num_per_tokens": npt} for npt in (128, 32) for h in (7168, 2048)
    ] + [{"token_blocks": 63, "hidden": 7168, "num_per_tokens": 128},
         {"token_blocks": 1024, "hidden": 7168, "num_per_tokens": 32, "round_scale": True}],
})


# -- expand_to_mhc, pre_apply_mix (mHC residual streams) ---------------------------------------------

def _expand_mhc_torch(shape):
    m = shape["mhc_mult"]
    return lambda x: x.unsqueeze(-2).expand(x.shape[0], m, x.shape[-1]).contiguous()


def _expand_mhc_bwd_torch(shape):
    return lambda out_grad: out_grad.float().sum(1).bfloat16()


def _pre_apply_mix_torch(shape):
    return lambda x, mix: (x * mix[..., None]).sum(-2).bfloat16()  # TileKernels' mhc_pre_apply_mix_ref


def _pre_apply_mix_bwd_torch(shape):
    def f(grad_out, x, mix, x_grad=None):
        g = grad_out.float()
        xg = mix[..., None] * g[:, None, :]
        xg = (xg + x_grad.float() if x_grad is not None else xg).bfloat16()
        return xg, torch.einsum("ni,nmi->nm", g, x.float())

    return f


# -- mhc_post ----------------------------------------------------------------------------------------

def _mhc_post_fwd_torch(shape):
    # TileKernels' mhc_post_ref on the flattened tokens: float32 einsum, rounded to bf16.
    def f(x, residual, post_layer_mix, comb_res_mix):
        term2 = torch.einsum("tmn,tmc->tnc", comb_res_mix, residual.float())
        return (x.float().unsqueeze(-2) * post_layer_mix.unsqueeze(-1) + term2).bfloat16()

    return f


def _expand_mhc_tk(bwd):
    def factory(shape, inputs):
        if _tile_kernels() is None:
            return None
        from tile_kernels.mhc.expand_kernel import expand_to_mhc_bwd_tl, expand_to_mhc_fwd_tl

        (t,) = inputs
        n, m, h = shape["num_tokens"], shape["mhc_mult"], shape["hidden"]
        kernel = (expand_to_mhc_bwd_tl if bwd else expand_to_mhc_fwd_tl)(h, m)
        out = t.new_empty((n, h) if bwd else (n, m, h))
        return lambda: kernel(t, out)

    return factory


def _pre_apply_mix_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.mhc.pre_apply_mix_kernel import _mhc_pre_apply_mix_fwd

    x, mix = inputs
    kernel = _mhc_pre_apply_mix_fwd(shape["mhc_mult"], shape["hidden"])
    out = x.new_empty((shape["num_tokens"], shape["hidden"]))
    return lambda: kernel(x, mix, out)


def _pre_apply_mix_bwd_tk(acc):
    def factory(shape, inputs):
        if _tile_kernels() is None:
            return None
        from tile_kernels.mhc.pre_apply_mix_kernel import _mhc_pre_apply_mix_bwd

        kernel = _mhc_pre_apply_mix_bwd(shape["mhc_mult"], shape["hidden"])
        if acc:  # into the residual gradient, in place
            grad_out, x, mix, x_grad = inputs
            return lambda: kernel(grad_out, x, mix, x_grad)
        grad_out, x, mix = inputs  # its backward without a residual gradient: zeros_like(x), then the kernel
        return lambda: kernel(grad_out, x, mix, torch.zeros_like(x))

    return factory


TORCH.update({"expand_to_mhc": _expand_mhc_torch, "expand_to_mhc_bwd": _expand_mhc_bwd_torch,
              "pre_apply_mix": _pre_apply_mix_torch, "pre_apply_mix_bwd": _pre_apply_mix_bwd_torch,
              "pre_apply_mix_bwd_acc": _pre_apply_mix_bwd_torch})
TILE_KERNELS.update({"expand_to_mhc": _expand_mhc_tk(False), "expand_to_mhc_bwd": _expand_mhc_tk(True),
                     "pre_apply_mix": _pre_apply_mix_tk, "pre_apply_mix_bwd": _pre_apply_mix_bwd_tk(False),
                     "pre_apply_mix_bwd_acc": _pre_apply_mix_bwd_tk(True)})
# TileKernels' tests: n0 * n1 tokens (n0 1 or 2, n1 1024 to 8192), mhc_mult 4, hidden 1280 to 7680.
_MHC_SHAPES = [{"num_tokens": 4096, "mhc_mult": 4, "hidden": 7168}, {"num_tokens": 8192, "mhc_mult": 4, "hidden": 7168},
               {"num_tokens": 8192, "mhc_mult": 4, "hidden": 2560}, {"num_tokens": 2048, "mhc_mult": 4, "hidden": 1280}]
SHAPES.update({name: list(_MHC_SHAPES) for name in ("expand_to_mhc", "expand_to_mhc_bwd", "pre_apply_mix",
                                                    "pre_apply_mix_bwd", "pre_apply_mix_bwd_acc")})


def _mhc_post_fwd_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.mhc.post_kernel import _mhc_post_fwd

    x, residual, post_layer_mix, comb_res_mix = inputs
    kernel = _mhc_post_fwd(shape["mhc"], shape["hidden"])  # its shipped block: 128 threads, 1024 channels
    out = torch.empty_like(residual)
    return lambda: kernel(comb_res_mix, residual, post_layer_mix, x, out)


def _mhc_post_bwd_torch(shape):
    def f(grad_out, x, residual, post_layer_mix, comb_res_mix):
        g = grad_out.float()
        return (torch.einsum("tn,tnh->th", post_layer_mix, g).bfloat16(),
                torch.einsum("tmn,tnh->tmh", comb_res_mix, g).bfloat16(),
                torch.einsum("th,tnh->tn", x.float(), g), torch.einsum("tmh,tnh->tmn", residual.float(), g))

    return f


def _mhc_post_bwd_tk(shape, inputs):
    if _tile_kernels() is None or shape["mhc"] != 4:
        return None  # TileKernels' backward kernel takes mhc 4 only
    from tile_kernels.mhc.post_kernel import _mhc_post_bwd

    grad_out, x, residual, post_layer_mix, comb_res_mix = inputs
    kernel = _mhc_post_bwd(shape["mhc"], shape["hidden"])  # allocates its four outputs per call
    return lambda: kernel(grad_out, comb_res_mix, residual, post_layer_mix, x)


TORCH.update({"mhc_post_fwd": _mhc_post_fwd_torch, "mhc_post_bwd": _mhc_post_bwd_torch})
TILE_KERNELS.update({"mhc_post_fwd": _mhc_post_fwd_tk, "mhc_post_bwd": _mhc_post_bwd_tk})
# TileKernels' test shapes: n0 * n1 = 4096 / 8192 tokens, mhc 4, hidden 1280 / 2560 / 7168; and mhc 8.
SHAPES.update({
    "mhc_post_fwd": [{"num_tokens": t, "mhc": 4, "hidden": h} for t, h in ((4096, 7168), (8192, 7168),
                                                                           (8192, 2560), (8192, 1280))]
    + [{"num_tokens": 4096, "mhc": 8, "hidden": 4096}],
    "mhc_post_bwd": [{"num_tokens": t, "mhc": 4, "hidden": h} for t, h in ((4096, 7168), (8192, 7168),
                                                                           (8192, 2560), (8192, 1280))],
})


# -- per_token_cast_e5m6 / cast_back_e5m6 (12-bit e5m6, one scale per token) ---------------------------------

def _e5m6_cast_torch(col_major):
    def make(shape):
        from tkjit_kernels.quant.per_token_cast_e5m6 import reference, reference_colmajor

        ref = reference_colmajor if col_major else reference
        return lambda x: ref(shape, x)  # plain torch: amax, scale, integer encode and pack

    return make


def _e5m6_cast_tk(col_major):
    def make(shape, inputs):
        if _tile_kernels() is None:
            return None
        from tile_kernels.quant import per_token_cast

        (x,) = inputs
        return lambda: per_token_cast(x, "e5m6", shape["hidden"], use_tma_aligned_col_major_sf=col_major,
                                      round_sf=shape["round_scale"])

    return make


def _e5m6_back_torch(col_major):
    def make(shape):
        from tkjit_kernels.quant.cast_back_e5m6 import reference, reference_colmajor

        ref = reference_colmajor if col_major else reference
        return lambda x, sf: ref(shape, x, sf)

    return make


def _e5m6_back_tk(col_major):
    def make(shape, inputs):
        if _tile_kernels() is None:
            return None
        from tile_kernels.quant import cast_back

        x, sf = inputs
        q = x.view(torch.uint8)  # TileKernels' form of the words
        sf = sf.T if col_major else sf  # the column-major (num_sf_rows, ...) view TileKernels takes
        fmt = "bf16" if shape["out_dtype"] == "bfloat16" else "fp32"
        return lambda: cast_back((q, sf), fmt, (shape["block_tokens"], shape["block_channels"]), "e5m6")

    return make


TORCH.update({"per_token_cast_e5m6": _e5m6_cast_torch(False), "per_token_cast_e5m6_colmajor": _e5m6_cast_torch(True),
              "cast_back_e5m6": _e5m6_back_torch(False), "cast_back_e5m6_colmajor": _e5m6_back_torch(True)})
TILE_KERNELS.update({"per_token_cast_e5m6": _e5m6_cast_tk(False), "per_token_cast_e5m6_colmajor": _e5m6_cast_tk(True),
                     "cast_back_e5m6": _e5m6_back_tk(False), "cast_back_e5m6_colmajor": _e5m6_back_tk(True)})
SHAPES.update({
    # TileKernels' benchmark sizes (4001 / 8001 tokens) at hidden 7168, 4096 and 576, and 32768 x 7168.
    "per_token_cast_e5m6": [
        {"num_tokens": n, "hidden": h} for n in (4001, 8001) for h in (7168, 4096, 576)
    ] + [{"num_tokens": 32768, "hidden": 7168}, {"num_tokens": 8001, "hidden": 7168, "round_scale": True}],
    "per_token_cast_e5m6_colmajor": [{"num_tokens": 8001, "hidden": 7168, "round_scale": True}],
    "cast_back_e5m6": [
        {"num_tokens": n, "num_sf_rows": n, "hidden": h, "block_channels": h} for n in (4001, 8001)
        for h in (7168, 4096, 576)
    ] + [{"num_tokens": 32768, "num_sf_rows": 32768, "hidden": 7168, "block_channels": 7168},
         {"num_tokens": 8001, "num_sf_rows": 8001, "hidden": 7168, "block_channels": 7168, "out_dtype": "float32"}],
    "cast_back_e5m6_colmajor": [
        {"num_tokens": 8001, "num_sf_rows": 8001, "hidden": 7168, "block_channels": 7168, "sf_dtype": "int32"},
    ],
})


# -- engram_gate -----------------------------------------------------------------------------------------
# TileKernels ships no benchmark for the gate: mHC rate 4 at the hidden sizes its kernels are tuned for
# (4096, 7168), prefill-sized token counts. k and v contiguous (the kernels read strided views as well).

def _engram_gate_fwd_torch(shape):
    def run(x, k, v, w):
        # TileKernels' engram_gate_ref maths in float32 (weight_fused in place of wh * we)
        xf, kf = x.float(), k.float()
        rx = torch.rsqrt(xf.pow(2).mean(-1) + shape["eps"])
        rk = torch.rsqrt(kf.pow(2).mean(-1) + shape["eps"])
        raw = (xf * w * kf).sum(-1)
        d = raw * rx * rk * shape["hidden_size"] ** -0.5
        g = torch.copysign(d.abs().clamp_min(shape["clamp_value"]).sqrt(), d).sigmoid()
        return (xf + g.unsqueeze(-1) * v.unsqueeze(-2)).bfloat16(), raw, g, rx, rk

    return run


def _engram_gate_fwd_tk(shape, inputs):
    if _tile_kernels() is None or shape["hidden_size"] % 256 or shape["hidden_size"] < 512:
        return None
    from tile_kernels.engram import engram_gate_fwd

    return lambda: engram_gate_fwd(*inputs, shape["eps"], shape["clamp_value"])


TORCH["engram_gate_fwd"] = _engram_gate_fwd_torch
TILE_KERNELS["engram_gate_fwd"] = _engram_gate_fwd_tk
SHAPES["engram_gate_fwd"] = [{"num_tokens": n, "hc_mult": 4, "hidden_size": h} for h in (7168, 4096)
                             for n in (4096, 16384)]


# -- per_channel_cast_fused ---------------------------------------------------------------------------
# Inputs: x (num_tokens, hidden), then x_sf (FP8 input) and pos_to_token (a map), as the spec's make_inputs gives
# them. Odd seeds (the benchmark's) put out-of-range map entries in, zero rows in tkjit, which TileKernels would
# read out of bounds (an illegal address on an H100): its baseline gets them as -1, zero rows in both.

def _pcc_fused_torch(shape):
    from tkjit_kernels.quant.per_channel_cast_fused import reference

    return lambda *inputs: reference(shape, *inputs)  # plain torch on x's device: gather, dequantise, cast


def _pcc_fused_tk(shape, inputs):
    m, h = shape["num_tokens_out"], shape["hidden"]
    if _tile_kernels() is None or shape["num_per_tokens"] != 128 or m % (16 if shape["has_pos"] else 128):
        return None  # TileKernels: 128 rows per scale, 16-aligned maps, 128-aligned rows without one
    if shape["has_x_sf"] and h == 128:
        return None  # its (num_tokens, 1) scales look column-major to it
    from tile_kernels.quant import per_channel_cast_fused

    x, *rest = inputs
    x_sf = rest.pop(0) if shape["has_x_sf"] else None
    pos = rest.pop(0) if shape["has_pos"] else None
    if pos is not None:
        pos = _readable_map(pos, x.shape[0])
    arg = (x, x_sf) if x_sf is not None else x
    npc = 128 if x_sf is not None else None
    return lambda: per_channel_cast_fused(arg, "e4m3", 128, shape["round_scale"], npc, pos)


TORCH["per_channel_cast_fused"] = _pcc_fused_torch
TILE_KERNELS["per_channel_cast_fused"] = _pcc_fused_tk
# TileKernels' benchmark: 4096 tokens without a map; MoE expansion at topk 6 from 4001 tokens per rank
# (~24K expanded rows from ~16-24K received tokens), hidden sizes 7168 and 4096, bf16 or FP8 (per_token_cast'ed).
SHAPES["per_channel_cast_fused"] = [
    {"num_tokens": 4096, "num_tokens_out": 4096, "hidden": h} for h in (7168, 4096)
] + [
    {"num_tokens": 4096, "num_tokens_out": 4096, "hidden": 7168, "in_dtype": "float8_e4m3fn", "has_x_sf": True},
] + [
    {"num_tokens": 16384, "num_tokens_out": 24576, "hidden": h, "has_pos": True, **fp8}
    for h in (7168, 4096) for fp8 in ({}, {"in_dtype": "float8_e4m3fn", "has_x_sf": True})
]


# -- mhc_head_compute_mix / mhc_pre_split_mixes ------------------------------------------------------
# The backward rows time the kernels alone (tkjit's and TileKernels' both leave per-block partials of the
# parameters' gradients, which their ops then sum with torch).

def _head_mix_torch(shape):
    eps = shape.get("mhc_pre_eps", 1e-2)
    return lambda x, scale, base: torch.sigmoid(x * scale + base) + eps


def _head_mix_bwd_torch(shape):
    def f(go, x, scale, base):
        s = torch.sigmoid(x * scale + base)
        g = go * s * (1 - s)
        return g * scale, (g * x).sum().view(1), g.sum(0)

    return f


def _split_mix_torch(shape):
    m, mult, eps = shape["mhc_mult"], shape.get("mhc_post_mult_value", 2.0), shape.get("mhc_pre_eps", 1e-2)

    def f(x, scale, base):
        s = torch.cat([scale[0].expand(m), scale[1].expand(m), scale[2].expand(m * m)])
        z = x * s + base
        return z[:, :m].sigmoid() + eps, z[:, m:2 * m].sigmoid() * mult, z[:, 2 * m:]

    return f


def _split_mix_bwd_torch(shape):
    m, mult = shape["mhc_mult"], shape.get("mhc_post_mult_value", 2.0)

    def f(gp, gq, gc, x, scale, base):
        s = torch.cat([scale[0].expand(m), scale[1].expand(m), scale[2].expand(m * m)])
        sg = torch.sigmoid(x[:, :2 * m] * s[:2 * m] + base[:2 * m])
        g = torch.cat([gp * sg[:, :m] * (1 - sg[:, :m]), gq * mult * sg[:, m:] * (1 - sg[:, m:]), gc], -1)
        gx = g * x
        return g * s, torch.stack([gx[:, :m].sum(), gx[:, m:2 * m].sum(), gx[:, 2 * m:].sum()]), g.sum(0)

    return f


def _head_mix_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.mhc.head_compute_mix_kernel import _mhc_head_compute_mix_fwd

    x, scale, base = inputs
    kernel = _mhc_head_compute_mix_fwd(shape["mhc_mult"], shape.get("mhc_pre_eps", 1e-2), token_block_size=32)
    out = torch.empty_like(x)
    return lambda: kernel(x, scale, base, out)


def _head_mix_bwd_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.config import get_num_sms
    from tile_kernels.mhc.head_compute_mix_kernel import _mhc_head_compute_mix_bwd

    go, x, scale, base = inputs
    sms = get_num_sms()
    kernel = _mhc_head_compute_mix_bwd(shape["mhc_mult"], token_block_size=32, num_sms=sms)
    gx, sp, bp = torch.empty_like(x), x.new_empty(sms, 1), x.new_empty(sms, shape["mhc_mult"])
    return lambda: kernel(go, x, scale, base, gx, sp, bp)


def _split_mix_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.mhc.pre_split_mixes_kernel import _mhc_pre_split_mixes_fwd

    x, scale, base = inputs
    m, n = shape["mhc_mult"], x.shape[0]
    kernel = _mhc_pre_split_mixes_fwd(m, shape.get("mhc_post_mult_value", 2.0), shape.get("mhc_pre_eps", 1e-2),
                                      token_block_size=32)
    outs = (x.new_empty(n, m), x.new_empty(n, m), x.new_empty(n, m * m))
    return lambda: kernel(x, scale, base, *outs)


def _split_mix_bwd_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.config import get_num_sms
    from tile_kernels.mhc.pre_split_mixes_kernel import _mhc_pre_split_mixes_bwd

    gp, gq, gc, x, scale, base = inputs
    m, mult, sms = shape["mhc_mult"], shape.get("mhc_post_mult_value", 2.0), get_num_sms()
    kernel = _mhc_pre_split_mixes_bwd(m, mult, token_block_size=32, num_sms=sms)
    z = x * torch.cat([scale[0].expand(m), scale[1].expand(m), scale[2].expand(m * m)]) + base
    post = z[:, m:2 * m].sigmoid().mul(mult).contiguous()  # its saved forward output
    outs = (torch.empty_like(x), x.new_empty(sms, 3), x.new_empty(sms, x.shape[1]))
    return lambda: kernel(gp, gq, gc, x, post, scale, base, *outs)


TORCH.update({"mhc_head_compute_mix": _head_mix_torch, "mhc_head_compute_mix_bwd": _head_mix_bwd_torch,
              "mhc_pre_split_mixes": _split_mix_torch, "mhc_pre_split_mixes_bwd": _split_mix_bwd_torch})
TILE_KERNELS.update({"mhc_head_compute_mix": _head_mix_tk, "mhc_head_compute_mix_bwd": _head_mix_bwd_tk,
                     "mhc_pre_split_mixes": _split_mix_tk, "mhc_pre_split_mixes_bwd": _split_mix_bwd_tk})
# TileKernels' tests: n0 * n1 = 1024 .. 8192 tokens, mhc_mult 4 (and 2, 8 in tkjit's GPU tests).
_MIXES_SHAPES = [{"num_tokens": t, "mhc_mult": 4} for t in (1024, 2048, 4096, 8192)] + [
    {"num_tokens": 4096, "mhc_mult": 8}]
SHAPES.update({name: list(_MIXES_SHAPES) for name in ("mhc_head_compute_mix", "mhc_head_compute_mix_bwd",
                                                      "mhc_pre_split_mixes", "mhc_pre_split_mixes_bwd")})


# -- swiglu_forward_and_per_token_cast ------------------------------------------------------------------
# Inputs as the spec's make_inputs gives them: x (num_tokens, 2 * hidden), then pos_to_token_topk and the flat
# topk_weights (has_weights), pos_to_expert (has_expert), clamped_count. Odd seeds put out-of-range map entries
# in, which TileKernels would read out of bounds: its baseline gets them as -1 (padding, weight 0 in both).

def _swiglu_cast_torch(shape):
    from tkjit_kernels.quant.swiglu_forward_and_per_token_cast import reference

    return lambda *inputs: reference(shape, *inputs)  # plain torch: SwiGLU in float32, then per_token_cast's cast


def _swiglu_cast_tk(shape, inputs):
    if _tile_kernels() is None or shape["hidden"] % 128 or shape["group"] not in (128, shape["hidden"]):
        return None
    from tile_kernels.quant import swiglu_forward_and_per_token_cast

    x, *rest = inputs
    pos, wts = (rest.pop(0), rest.pop(0).view(-1, 1)) if shape["has_weights"] else (None, None)
    if pos is not None:  # odd seeds' out-of-range positions weigh 0 in tkjit; TileKernels would read past the table
        pos = _readable_map(pos, wts.shape[0])
    pe = rest.pop(0) if shape["has_expert"] else None
    counter = rest.pop(0) if shape["count_clamp"] else None
    clamp = shape["swiglu_clamp_value"] or None
    return lambda: swiglu_forward_and_per_token_cast(
        x, "e4m3", shape["group"], pos, wts, pe, round_sf=shape["round_scale"], swiglu_clamp_value=clamp,
        clamped_count=counter, sf_clamp_min=shape["sf_clamp_min"])


TORCH["swiglu_forward_and_per_token_cast"] = _swiglu_cast_torch
TILE_KERNELS["swiglu_forward_and_per_token_cast"] = _swiglu_cast_tk
# MoE expert activations: 4096 / 32768 dense tokens, and the routed layout (8192 tokens at topk 8 plus 256 experts'
# alignment padding) with weights, pos_to_expert and the counted clamp; intermediate sizes 2048 and 4096.
SHAPES["swiglu_forward_and_per_token_cast"] = [
    {"num_tokens": n, "num_weights": 1, "hidden": h} for n in (4096, 32768) for h in (2048, 4096)
] + [
    {"num_tokens": 4096, "num_weights": 1, "hidden": 2048, "group": 2048},
    {"num_tokens": 8192 * 8 + 256 * 16, "num_weights": 8192 * 8, "hidden": 2048, "has_weights": True,
     "has_expert": True, "swiglu_clamp_value": 10.0, "count_clamp": True, "round_scale": True},
]


# -- swiglu_backward_and_per_token_cast ---------------------------------------------------------------
# Inputs as the spec's make_inputs gives them: x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos,
# then the clamp value (used with use_clamp).

def _swiglu_bwd_torch(shape):
    from tkjit_kernels.quant.swiglu_backward_and_per_token_cast import reference

    return lambda *inputs: reference(shape, *inputs)  # plain torch: dequantise, SwiGLU backward, per-token cast


def _swiglu_bwd_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.quant import swiglu_backward_and_per_token_cast

    x, x_sf, grad_out, weight, pos, t2p, clamp = inputs
    cv = clamp if shape["use_clamp"] else None
    return lambda: swiglu_backward_and_per_token_cast((x, x_sf), grad_out, weight, pos, t2p,
                                                      shape["num_per_channels"], shape["round_scale"], cv)


TORCH["swiglu_backward_and_per_token_cast"] = _swiglu_bwd_torch
TILE_KERNELS["swiglu_backward_and_per_token_cast"] = _swiglu_bwd_tk
# TileKernels' benchmark: 4001 tokens per rank at topk 2 / 6 / 8 / 9 (expanded rows ~ tokens * topk), its hidden
# sizes, round_sf on, clamp None or 0.5; here topk 6 and 8 at 7168 / 4096 / 2048.
SHAPES["swiglu_backward_and_per_token_cast"] = [
    {"num_expand_tokens": 4001 * k, "num_tokens": 4001, "num_topk": k, "hidden": h, "num_per_channels": npc,
     "round_scale": True, "use_clamp": clamp}
    for k, h in ((6, 7168), (8, 4096), (8, 2048)) for npc in (128, 32) for clamp in (False, True)
]


# -- swiglu_forward_and_per_channel_cast(_and_transpose) ---------------------------------------------
# The specs' x is the (token_blocks, num_per_tokens, 2 * hidden) view of TileKernels' [gate | up] x.

def _swiglu_channel_torch(transposed):
    def make(shape):
        h, clamp = shape["hidden"], shape["clamp_value"] if shape["use_clamp"] else None
        cast = _per_channel_torch(transposed)(shape)

        def f(x):
            g, u = x[..., :h].float(), x[..., h:].float()
            if clamp is not None:
                g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
            return cast((torch.nn.functional.silu(g) * u).to(x.dtype))

        return f

    return make


def _swiglu_channel_tk(transposed):
    def make(shape, inputs):
        npt, h = shape["num_per_tokens"], shape["hidden"]
        (x,) = inputs
        tokens = x.shape[0] * npt
        if _tile_kernels() is None or tokens % 128 or h % 64 or shape["in_dtype"] != "bfloat16":
            return None  # TileKernels takes bf16, multiples of 128 tokens and of 128 columns of x
        from tile_kernels.quant import swiglu_forward_and_per_channel_cast_and_transpose as fn

        x2 = x.view(tokens, 2 * h)
        clamp = shape["clamp_value"] if shape["use_clamp"] else None
        return lambda: fn(x2, "e4m3", npt, shape["round_scale"], not transposed, clamp)

    return make


TORCH.update({"swiglu_forward_and_per_channel_cast_and_transpose": _swiglu_channel_torch(True),
              "swiglu_forward_and_per_channel_cast": _swiglu_channel_torch(False)})
TILE_KERNELS.update({"swiglu_forward_and_per_channel_cast_and_transpose": _swiglu_channel_tk(True),
                     "swiglu_forward_and_per_channel_cast": _swiglu_channel_tk(False)})
# TileKernels' test sizes: 4096 (and 8064) tokens, its hidden sizes as the activations' width, 32/128 per scale;
# MoE expert FFNs of DeepSeek-V3 (2048) and a dense FFN width (7168 here), a clamp of 10 (swiglu_limit).
_SWIGLU_CHANNEL_SHAPES = [
    {"token_blocks": 4096 // npt, "hidden": h, "num_per_tokens": npt} for npt in (128, 32) for h in (2048, 7168)
] + [{"token_blocks": 63, "hidden": 2048, "num_per_tokens": 128, "use_clamp": True, "clamp_value": 10.0},
     {"token_blocks": 256, "hidden": 2048, "num_per_tokens": 128, "use_clamp": True, "clamp_value": 10.0,
      "round_scale": True}]
SHAPES.update({"swiglu_forward_and_per_channel_cast_and_transpose": list(_SWIGLU_CHANNEL_SHAPES),
               "swiglu_forward_and_per_channel_cast": list(_SWIGLU_CHANNEL_SHAPES)})


# -- engram_gate_bwd / grad_w_reduce ---------------------------------------------------------------------
# TileKernels ships no benchmark for the gate's backward: the forward's shapes (mHC rate 4, hidden 7168 /
# 4096, prefill-sized token counts), its num_sms (132 on the H200) partial rows.

def _engram_gate_bwd_torch(shape):
    def run(go, x, k, v, w, dot, gate, rx, rk):
        # TileKernels' closed forms in float32 torch (what its backward kernel computes)
        h, c = shape["hidden_size"], shape["hidden_size"] ** -0.5
        gof, xf, kf = go.float(), x.float(), k.float()
        dldg = (gof * v.float().unsqueeze(1)).sum(-1)
        dr = dldg * gate * (1 - gate) * 0.5 * torch.sqrt(c * rx * rk / dot.abs())
        dr = torch.where(dot.abs() * c * rx * rk < shape["clamp_value"], 0.0, dr).unsqueeze(-1)
        d = dot.unsqueeze(-1)
        gx = gof + dr * (kf * w - xf * (d * rx.unsqueeze(-1) ** 2 / h))
        gk = dr * (xf * w - kf * (d * rk.unsqueeze(-1) ** 2 / h))
        gv = (gof * gate.unsqueeze(-1)).sum(1)
        return gx.bfloat16(), gk.bfloat16(), gv.bfloat16(), (dr * xf * kf).sum(0)

    return run


def _engram_gate_bwd_tk(shape, inputs):
    h = shape["hidden_size"]
    if _tile_kernels() is None or shape["hc_mult"] != 4 or h % 512 or h < 1024:
        return None
    from tile_kernels.engram import engram_gate_bwd

    return lambda: engram_gate_bwd(*inputs, shape["clamp_value"])


def _grad_w_reduce_torch(shape):
    def run(partial, wh, we, gh, ge):
        g = partial.sum(0)
        gh.add_(g * we.float())
        ge.add_(g * wh.float())

    return run


def _grad_w_reduce_tk(shape, inputs):
    if _tile_kernels() is None or shape["hidden_size"] % 512 or shape.get("num_partials", 132) % 4:
        return None
    from tile_kernels.engram import grad_w_reduce

    return lambda: grad_w_reduce(*inputs)


TORCH.update({"engram_gate_bwd": _engram_gate_bwd_torch, "grad_w_reduce": _grad_w_reduce_torch})
TILE_KERNELS.update({"engram_gate_bwd": _engram_gate_bwd_tk, "grad_w_reduce": _grad_w_reduce_tk})
SHAPES["engram_gate_bwd"] = [{"num_tokens": n, "hc_mult": 4, "hidden_size": h} for h in (7168, 4096)
                             for n in (4096, 16384)]
SHAPES["grad_w_reduce"] = [{"hc_mult": 4, "hidden_size": h} for h in (7168, 4096)]


# -- mhc_pre_norm_fn -----------------------------------------------------------------------------------
# Inputs as the specs' make_inputs give them: x (num_tokens, K) bf16 and fn (M, K) float32 (the forward); the
# backward's mul_grad, sqrsum_grad, x, fn, x_grad. TileKernels' forward row runs its op (two kernels: the TF32
# GEMM, then the norm; fn's TF32 rounding in torch) on x viewed as (num_tokens, mhc_mult, hidden); its backward
# row is its GEMM kernel alone (_norm_fn_bwd_tk), as tkjit's.

def _norm_fn_torch(shape):
    eps, k = shape.get("norm_eps", 1e-6), shape["mhc_hidden"]

    def f(x, fn):
        xf = x.float()
        out_mul = xf @ fn.T
        sqrsum = xf.square().sum(-1)
        return out_mul * torch.rsqrt(sqrsum / k + eps).unsqueeze(-1), out_mul, sqrsum

    return f


def _norm_fn_bwd_torch(shape):
    def f(mul_grad, sqrsum_grad, x, fn, x_grad):
        xf = x.float()
        x_grad.copy_((x_grad.float() + mul_grad @ fn + 2 * xf * sqrsum_grad.unsqueeze(-1)).to(x_grad.dtype))
        return x_grad, mul_grad.T @ xf

    return f


def _norm_fn_tk(shape, inputs):
    m3 = shape["mhc_mult3"]
    m = next((m for m in range(1, 9) if m * (m + 2) == m3), None)
    if _tile_kernels() is None or m != 4:
        return None
    from tile_kernels.modeling.mhc.ops import mhc_pre_norm_fn

    x, fn = inputs
    residual = x.view(x.shape[0], m, x.shape[1] // m)
    eps = shape.get("norm_eps", 1e-6)

    def run():
        with torch.no_grad():
            return mhc_pre_norm_fn(residual, fn, None, eps, fuse_grad_acc=False)

    return run


def _norm_fn_bwd_tk(shape, inputs):
    """TileKernels' backward GEMM kernel, the one its MHCPreNormFn.backward launches after the norm kernel, on the
    same five tensors: it writes fn's whole gradient where tkjit's kernel writes num_partials partial sums (which
    the op then adds: 16 x 24 x 28672 floats, 44 MB, at hidden 7168), and takes 128-token blocks (its own op
    pads nothing either)."""
    m3, k, n = shape["mhc_mult3"], shape["mhc_hidden"], shape["num_tokens"]
    if _tile_kernels() is None or m3 > 32 or k % 128 or n % 128:
        return None
    from tile_kernels.mhc.norm_fn_kernel import _mhc_pre_norm_fn_bwd_mul

    mul_grad, sqrsum_grad, x, fn, x_grad = inputs
    kernel = _mhc_pre_norm_fn_bwd_mul(m3, 1, k)
    fn_grad = torch.empty_like(fn)
    g, s = mul_grad.view(-1, 1, m3), sqrsum_grad.view(-1, 1)

    def run():
        kernel(g, s, x, fn, x_grad, fn_grad)
        return x_grad, fn_grad

    return run


TORCH.update({"mhc_pre_norm_fn": _norm_fn_torch, "mhc_pre_norm_fn_bwd": _norm_fn_bwd_torch})
TILE_KERNELS.update({"mhc_pre_norm_fn": _norm_fn_tk, "mhc_pre_norm_fn_bwd": _norm_fn_bwd_tk})
# mhc_mult 4 (M = 24), hidden 4096 and 7168 (K = 16384, 28672), 1K to 8K tokens; mhc_mult 8 (M = 80) once.
_NORM_FN_SHAPES = [{"num_tokens": t, "mhc_mult3": 24, "mhc_hidden": k} for k in (16384, 28672)
                   for t in (1024, 4096, 8192)] + [{"num_tokens": 4096, "mhc_mult3": 80, "mhc_hidden": 32768}]
SHAPES["mhc_pre_norm_fn"] = list(_NORM_FN_SHAPES)
# the backward with the op's token ranges for each token count (4 at 1024 tokens, 16 from 4096)
SHAPES["mhc_pre_norm_fn_bwd"] = [{**s, "num_partials": pre_norm_fn_partials(s["num_tokens"])} for s in _NORM_FN_SHAPES]
# the split forward where the forward's 32-token tiles leave SMs idle (its inputs are the forward's: the same
# baselines, which also compute out from the sums)
SHAPES["mhc_pre_norm_fn_split"] = [{"num_tokens": 1024, "mhc_mult3": 24, "mhc_hidden": k, "k_splits": s}
                                   for k in (16384, 28672) for s in (4, 8)] + \
    [{"num_tokens": 4096, "mhc_mult3": 24, "mhc_hidden": 28672, "k_splits": 2}]
TORCH["mhc_pre_norm_fn_split"], TILE_KERNELS["mhc_pre_norm_fn_split"] = _norm_fn_torch, _norm_fn_tk


# -- per_token_cast_e2m1 (FP4, two codes per int8, float32 scales amax / 6) ------------------------------------

def _e2m1_cast_torch(col_major):
    def make(shape):
        from tkjit_kernels.quant.per_token_cast_e2m1 import reference, reference_colmajor

        ref = reference_colmajor if col_major else reference
        return lambda x: ref(shape, x)  # plain torch: group amax, scale, integer encode and pack

    return make


def _e2m1_cast_tk(col_major):
    def make(shape, inputs):
        if _tile_kernels() is None:
            return None
        from tile_kernels.quant import per_token_cast

        (x,) = inputs
        return lambda: per_token_cast(x, "e2m1", shape["group"], use_tma_aligned_col_major_sf=col_major,
                                      round_sf=shape["round_scale"])

    return make


TORCH.update({"per_token_cast_e2m1": _e2m1_cast_torch(False), "per_token_cast_e2m1_colmajor": _e2m1_cast_torch(True)})
TILE_KERNELS.update({"per_token_cast_e2m1": _e2m1_cast_tk(False),
                     "per_token_cast_e2m1_colmajor": _e2m1_cast_tk(True)})
SHAPES.update({
    # TileKernels' test sizes (4001 / 8001 tokens) at hidden 7168, 4096 and 576, groups 32 (MXFP4) and 16, and
    # 32768 x 7168; the column-major, power-of-two scales DeepGEMM's FP4 path reads.
    "per_token_cast_e2m1": [
        {"num_tokens": n, "hidden": h, "group": 32} for n in (4001, 8001) for h in (7168, 4096, 576)
    ] + [{"num_tokens": 8001, "hidden": 7168, "group": 16}, {"num_tokens": 32768, "hidden": 7168, "group": 32}],
    "per_token_cast_e2m1_colmajor": [{"num_tokens": 8001, "hidden": 7168, "group": 32, "round_scale": True}],
})


# -- mhc_multilayer_recompute --------------------------------------------------------------------------

def _mhc_multilayer_recompute_torch(shape):
    # TileKernels' torch references chained per layer (mhc_pre_apply_mix_ref, mhc_post_ref) on the stacked layers.
    def f(initial_residual, pre_mix, layer_output, post_mix, comb_mix):
        res, inputs, residuals = initial_residual, [], []
        for i in range(pre_mix.shape[0]):
            inputs.append((res * pre_mix[i].unsqueeze(-1)).sum(-2).bfloat16())
            if i < layer_output.shape[0]:
                term2 = torch.einsum("tmn,tmc->tnc", comb_mix[i], res.float())
                res = (layer_output[i].float().unsqueeze(-2) * post_mix[i].unsqueeze(-1) + term2).bfloat16()
                residuals.append(res)
        return inputs, residuals

    return f


def _mhc_multilayer_recompute_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.mhc.multilayer_recompute_kernel import _make_ptr_tables_batched, _mhc_multilayer_recompute_kernel

    initial_residual, pre_mix, layer_output, post_mix, comb_mix = inputs
    n, m, h, L, P = (shape[k] for k in ("num_tokens", "mhc_mult", "hidden", "num_layers", "num_post"))
    layer_input = torch.empty(L, n, h, dtype=torch.bfloat16, device="cuda")
    residual = torch.empty(P, n, m, h, dtype=torch.bfloat16, device="cuda")
    # its per-layer pointer tables, built once (its public entry point builds them on every call, on the host)
    pre, inp, res, out, post, comb = _make_ptr_tables_batched(
        [list(t.unbind(0)) for t in (pre_mix, layer_input, residual, layer_output, post_mix, comb_mix)],
        device=initial_residual.device)
    kernel = _mhc_multilayer_recompute_kernel(m, h, L, P)
    return lambda: kernel(initial_residual, pre, out, post, comb, inp, res)


TORCH["mhc_multilayer_recompute"] = _mhc_multilayer_recompute_torch
TILE_KERNELS["mhc_multilayer_recompute"] = _mhc_multilayer_recompute_tk
# TileKernels' benchmark: 10 layers, 9 or 10 of them with a post, 1 x 8192 tokens, mhc 4, hidden 2560 .. 8192.
SHAPES["mhc_multilayer_recompute"] = [
    {"num_tokens": 8192, "mhc_mult": 4, "hidden": h, "num_layers": 10, "num_post": p}
    for h in (2560, 4096, 7168, 8192) for p in (9, 10)
]


# -- per_block_cast_lossless --------------------------------------------------------------------------

def _lossless_torch(col_major):
    def make(shape):
        from tkjit_kernels.quant.per_block_cast_lossless import reference, reference_colmajor

        ref = reference_colmajor if col_major else reference
        return lambda x, sf: ref(shape, x, sf)[:2]  # plain torch (its lossy check reads the scales on the host)

    return make


def _lossless_tk(col_major):
    def make(shape, inputs):
        if _tile_kernels() is None:
            return None
        from tile_kernels.quant import per_block_cast_lossless

        x, sf = inputs
        bi, bo = (shape["in_block_m"], shape["in_block_k"]), (shape["out_block_m"], shape["out_block_k"])
        return lambda: per_block_cast_lossless((x, sf), "e4m3", bi, bo, col_major)

    return make


TORCH.update({"per_block_cast_lossless": _lossless_torch(False),
              "per_block_cast_lossless_colmajor": _lossless_torch(True)})
TILE_KERNELS.update({"per_block_cast_lossless": _lossless_tk(False),
                     "per_block_cast_lossless_colmajor": _lossless_tk(True)})
SHAPES.update({  # MXFP4 weights / activations (1 x 32 blocks) to DeepGEMM's 128 x 128 and 1 x 128 FP8 blocks
    "per_block_cast_lossless": [
        {"num_tokens": 4096, "hidden": 7168, "in_block_m": 1, "in_block_k": 32, "out_block_m": 128,
         "out_block_k": 128},
        {"num_tokens": 7168, "hidden": 2048, "in_block_m": 1, "in_block_k": 32, "out_block_m": 128,
         "out_block_k": 128},
        {"num_tokens": 32768, "hidden": 7168, "in_block_m": 1, "in_block_k": 32, "out_block_m": 1,
         "out_block_k": 128},
    ],
    "per_block_cast_lossless_colmajor": [
        {"num_tokens": 4096, "hidden": 7168, "in_block_m": 1, "in_block_k": 32, "out_block_m": 128,
         "out_block_k": 128},
    ],
})


# -- mhc_pre_big_fuse ----------------------------------------------------------------------------------
# Inputs as the spec's make_inputs gives them: the GEMM outputs out_mul (num_tokens, M) and sqrsum (num_tokens,)
# float32, mhc_scale (3,), mhc_base (M,) float32, residual (num_tokens, mhc_mult, hidden) bf16. TileKernels' row
# runs its `_mhc_pre_big_fuse` kernel on them (its op's second kernel; the GEMM is mhc_pre_norm_fn's row).

def _big_fuse_torch(shape):
    m, h = shape["mhc_mult"], shape["hidden"]
    rms_eps, pre_eps, sk_eps = shape["rms_eps"], shape["mhc_pre_eps"], shape["mhc_sinkhorn_eps"]
    post_mult, repeat = shape["mhc_post_mult_value"], shape["sinkhorn_repeat"]

    def f(out_mul, sqrsum, scale, base, residual):
        mixes = out_mul * torch.rsqrt(sqrsum / (m * h) + rms_eps).unsqueeze(-1)
        s = torch.cat([scale[0].expand(m), scale[1].expand(m), scale[2].expand(m * m)])
        z = mixes * s + base
        pre = z[:, :m].sigmoid() + pre_eps
        post = z[:, m:2 * m].sigmoid() * post_mult
        comb = z[:, 2 * m:].view(-1, m, m).softmax(-1) + sk_eps
        comb = comb / (comb.sum(-2, keepdim=True) + sk_eps)
        for _ in range(repeat - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + sk_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + sk_eps)
        return post, comb, (residual * pre.unsqueeze(-1)).sum(-2).bfloat16()

    return f


def _big_fuse_tk(shape, inputs):
    if _tile_kernels() is None:
        return None
    from tile_kernels.mhc.pre_big_fuse_kernel import _mhc_pre_big_fuse

    m, h = shape["mhc_mult"], shape["hidden"]
    out_mul, sqrsum, scale, base, residual = inputs
    n = residual.shape[0]
    kernel = _mhc_pre_big_fuse(h, shape["rms_eps"], shape["mhc_pre_eps"], shape["mhc_sinkhorn_eps"],
                               shape["mhc_post_mult_value"], shape["sinkhorn_repeat"], n_splits=1, mhc_mult=m)
    post = torch.empty(n, m, dtype=torch.float32, device=residual.device)
    comb = torch.empty(n, m * m, dtype=torch.float32, device=residual.device)
    layer_input = torch.empty(n, h, dtype=torch.bfloat16, device=residual.device)
    mul, sq = out_mul.view(1, n, -1), sqrsum.view(1, n)
    return lambda: kernel(mul, sq, scale, base, residual, post, comb, layer_input)


TORCH.update({"mhc_pre_big_fuse": _big_fuse_torch})
TILE_KERNELS.update({"mhc_pre_big_fuse": _big_fuse_tk})
# mhc_mult 4, TileKernels' hidden sizes 1280 to 7168, 1K to 8K tokens.
SHAPES.update({"mhc_pre_big_fuse": [{"num_tokens": t, "mhc_mult": 4, "hidden": h} for h in (1280, 4096, 7168)
                                    for t in (1024, 4096, 8192)]})
