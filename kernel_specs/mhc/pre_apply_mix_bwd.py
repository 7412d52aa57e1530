"""pre_apply_mix_bwd / pre_apply_mix_bwd_acc: the gradients of pre_apply_mix.

grad_out (num_tokens, hidden) bf16, x (num_tokens, mhc_mult, hidden) bf16, mix (num_tokens, mhc_mult)
float32 ->
  x_grad[t, m]   = bf16(fma(mix[t, m], grad_out[t], base))   bf16 (num_tokens, mhc_mult, hidden)
  mix_grad[t, m] = sum_i grad_out[t, i] * x[t, m, i]         float32 (num_tokens, mhc_mult)
TileKernels' `MHCPreApplyMix.backward` kernel reads x_grad and adds to it in place: into the residual
gradient mhc_post's backward left on x's storage (`grad_from_mhc_post`), else into zeros. The two
specs are those two cases:
  pre_apply_mix_bwd_acc  x_grad an in-place input (base: its bf16 value in float32), as TileKernels;
  pre_apply_mix_bwd      x_grad a fresh output (base +0.0), the same bits as TileKernels' add into
                         zeros (fma(w, g, +0.0) turns a -0 product into +0, as it does) without
                         reading the zeros: a third less traffic.
Each element of x_grad is one fused multiply-add rounded once (then to bf16), bit-exact. mix_grad is a
float32 sum over hidden in an order of this kernel's (each lane's products in turn, a butterfly over the
token's lanes, then its warps in order), so it is compared with a tolerance (rtol 1e-5 in L2; products
of two bf16 values are exact in float32, only the additions round).

Layout `_streams`, but a block owns whole tokens: its lanes walk every chunk of the row (the grid has
no second axis) and reduce their partial sums at the end, by warp shuffles and, when a token has more
than one warp of lanes, through shared memory. Tail tokens of the last block compute on the last
valid token and store nothing (every lane reaches the shuffles).
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, TensorArg, Tolerance
from tkjit_kernels.mhc._streams import COMMON, fma32, geometry, random_streams, stream_bytes
from tkjit_kernels.mhc.pre_apply_mix import random_mix

WARP = 32


def builder(accumulate):
    def build(shape, c):
        from tilelang import language as T

        M, H = shape["mhc_mult"], shape["hidden"]
        vec, hv, lanes, chunk, _, guard = geometry(shape, c)
        R, U, threads = c["rows"], c["unroll"], c["threads"]
        steps = -(-hv // chunk)  # chunks of a row, walked in turn by the token's lanes
        loop = T.unroll if steps <= 2 else T.serial
        shuffles = min(lanes, WARP).bit_length() - 1  # butterfly steps inside a warp: log2(lanes or 32)
        wpr = max(1, lanes // WARP)  # warps per token
        num_tokens = T.dynamic("num_tokens")
        bf16, f32 = T.bfloat16, T.float32

        @T.macro
        def body(grad_out, x, mix, x_grad, mix_grad):
            with T.Kernel(T.ceildiv(num_tokens, R), threads=threads) as bx:
                tx = T.get_thread_binding()
                part = T.alloc_local((M,), f32)
                w = T.alloc_local((M,), f32)
                gs = T.alloc_local((vec,), bf16)
                xs = T.alloc_local((vec,), bf16)
                xg = T.alloc_local((vec,), bf16)
                tot = T.alloc_local((1,), f32)
                red = T.alloc_shared((threads // WARP, M), f32) if wpr > 1 else None
                lane = tx % lanes
                row = bx * R + tx // lanes
                tc = T.cast(T.min(row, num_tokens - 1), "int64")  # tail tokens: a valid row, nothing stored
                for m in T.unroll(M):
                    part[m] = T.float32(0)
                    w[m] = mix[tc, m]
                for s in loop(steps):
                    for u in T.unroll(U):
                        j = s * chunk + u * lanes + lane  # the vector this lane moves
                        if (not guard) or j < hv:
                            for v in T.vectorized(vec):
                                gs[v] = grad_out[tc, j * vec + v]
                            for m in T.unroll(M):
                                for v in T.vectorized(vec):
                                    xs[v] = x[tc, m, j * vec + v]
                                if accumulate:
                                    for v in T.vectorized(vec):
                                        xg[v] = x_grad[tc, m, j * vec + v]
                                for v in T.unroll(vec):
                                    part[m] = part[m] + T.cast(gs[v], f32) * T.cast(xs[v], f32)
                                    if accumulate:
                                        xg[v] = T.cast(T.call_extern("float32", "__fmaf_rn", w[m], T.cast(gs[v], f32),
                                                                     T.cast(xg[v], f32)), bf16)
                                    else:
                                        xg[v] = T.cast(T.call_extern("float32", "__fmaf_rn", w[m], T.cast(gs[v], f32),
                                                                     T.float32(0)), bf16)
                                if row < num_tokens:
                                    for v in T.vectorized(vec):
                                        x_grad[tc, m, j * vec + v] = xg[v]
                # The token's partial sums: a butterfly over its lanes of one warp (all lanes take part).
                for k in T.unroll(shuffles):
                    for m in T.unroll(M):
                        part[m] = part[m] + T.shfl_xor(part[m], (min(lanes, WARP) // 2) >> k)
                if wpr == 1:
                    if (lane == 0) & (row < num_tokens):
                        for m in T.unroll(M):
                            mix_grad[tc, m] = part[m]
                else:
                    if tx % WARP == 0:
                        for m in T.unroll(M):
                            red[tx // WARP, m] = part[m]
                    T.sync_threads()
                    if (lane < M) & (row < num_tokens):
                        tot[0] = T.float32(0)
                        for k in T.unroll(wpr):
                            tot[0] = tot[0] + red[(tx // lanes) * wpr + k, lane]
                        mix_grad[tc, lane] = tot[0]

        if accumulate:
            @T.prim_func
            def pre_apply_mix_bwd_acc(
                grad_out: T.Tensor[(num_tokens, H), bf16],
                x: T.Tensor[(num_tokens, M, H), bf16],
                mix: T.Tensor[(num_tokens, M), f32],
                x_grad: T.Tensor[(num_tokens, M, H), bf16],
                mix_grad: T.Tensor[(num_tokens, M), f32],
            ):
                body(grad_out, x, mix, x_grad, mix_grad)

            return pre_apply_mix_bwd_acc

        @T.prim_func
        def pre_apply_mix_bwd(
            grad_out: T.Tensor[(num_tokens, H), bf16],
            x: T.Tensor[(num_tokens, M, H), bf16],
            mix: T.Tensor[(num_tokens, M), f32],
            x_grad: T.Tensor[(num_tokens, M, H), bf16],
            mix_grad: T.Tensor[(num_tokens, M), f32],
        ):
            body(grad_out, x, mix, x_grad, mix_grad)

        return pre_apply_mix_bwd

    return build


def make_inputs_for(accumulate):
    def make_inputs(shape, device="cpu", seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        grad_out = random_streams(g, shape, 1, seed)[:, 0].contiguous()
        x = random_streams(g, shape, shape["mhc_mult"], seed + 1)  # signed zeros in one of the two
        mix = random_mix(g, shape, seed)
        ins = (grad_out, x, mix)
        if accumulate:
            ins += (random_streams(g, shape, shape["mhc_mult"], seed),)  # the residual gradient so far
        return tuple(t.to(device) for t in ins)

    return make_inputs


def grads(grad_out, x, mix, x_grad=None):
    """(x_grad, mix_grad): x_grad's fma (exact), mix_grad in float64 rounded once to float32."""
    g = grad_out.float().cpu()
    n, m, h = x.shape
    w = mix.float().cpu()[:, :, None].expand(n, m, h)
    base = torch.zeros(n, m, h) if x_grad is None else x_grad.float().cpu()
    xg = fma32(w, g[:, None, :].expand(n, m, h), base).to(torch.bfloat16)
    mg = torch.einsum("ni,nmi->nm", g.double(), x.double().cpu()).float()
    return xg.to(x.device), mg.to(x.device)


def reference(shape, grad_out, x, mix):
    return grads(grad_out, x, mix)


def reference_acc(shape, grad_out, x, mix, x_grad):
    return grads(grad_out, x, mix, x_grad)  # the in-place x_grad after the call, then mix_grad


def bytes_moved_for(accumulate):
    # grad_out and x read, x_grad written (and read when accumulating), mix read and mix_grad written
    return lambda s: stream_bytes(s, 1 + (2 + accumulate) * s["mhc_mult"]) + 2 * s["num_tokens"] * s["mhc_mult"] * 4


def _vec_align(s, c):
    return c["vec_bytes"]


STREAMS = ("num_tokens", "mhc_mult", "hidden")
INPUTS = (
    TensorArg("grad_out", "bfloat16", ("num_tokens", "hidden"), align=_vec_align),
    TensorArg("x", "bfloat16", STREAMS, align=_vec_align),
    TensorArg("mix", "float32", ("num_tokens", "mhc_mult"), align=4),
)
MIX_GRAD = TensorArg("mix_grad", "float32", ("num_tokens", "mhc_mult"), align=4)
EXAMPLES = (
    {"num_tokens": 4096, "mhc_mult": 4, "hidden": 7168},
    {"num_tokens": 8192, "mhc_mult": 4, "hidden": 2560},
    {"num_tokens": 1024, "mhc_mult": 8, "hidden": 1280},
)
BWD = dict(COMMON, tolerance=Tolerance(rtol=1e-5), examples=EXAMPLES,
           flops=lambda s: 4 * s["num_tokens"] * s["mhc_mult"] * s["hidden"])

SPEC = register(
    KernelSpec(
        name="pre_apply_mix_bwd",
        doc="gradients of pre_apply_mix: x_grad = mix * grad_out (fma into +0.0) and mix_grad = <grad_out, x>",
        build=builder(False),
        inputs=INPUTS,
        outputs=(TensorArg("x_grad", "bfloat16", STREAMS, align=_vec_align), MIX_GRAD),
        make_inputs=make_inputs_for(False),
        reference=reference,
        bytes_moved=bytes_moved_for(False),
        **BWD,
    )
)

SPEC_ACC = register(
    KernelSpec(
        name="pre_apply_mix_bwd_acc",
        doc="gradients of pre_apply_mix, x_grad accumulated in place (fma into the residual gradient), and mix_grad",
        build=builder(True),
        inputs=(*INPUTS, TensorArg("x_grad", "bfloat16", STREAMS, align=_vec_align, inout=True)),
        outputs=(MIX_GRAD,),
        make_inputs=make_inputs_for(True),
        reference=reference_acc,
        bytes_moved=bytes_moved_for(True),
        **BWD,
    )
)
