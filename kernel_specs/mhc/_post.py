"""What mhc_post_fwd and mhc_post_bwd share: shapes, tensors, target rule, inputs, the float64 maths.

mHC's post step (TileKernels' `mhc_post`) mixes a layer's output x back into the mhc residual streams:

    out[t, n, h] = post_layer_mix[t, n] * x[t, h] + sum_m comb_res_mix[t, m, n] * residual[t, m, h]

x (num_tokens, hidden) and residual (num_tokens, mhc, hidden) bfloat16, post_layer_mix (num_tokens, mhc)
and comb_res_mix (num_tokens, mhc, mhc) float32; out (num_tokens, mhc, hidden) bfloat16. The kernels take
the tokens flattened (TileKernels' (num_seqs, seq_len, ...) tensors are views of these; its
post_layer_mix has a trailing axis of 1). Each token's mixes are mhc + mhc**2 floats, its rows 2 *
mhc * hidden bytes: the kernels stream the rows in `vec`-channel chunks (vec * 2-byte vector loads and
stores), and are memory-bound.

  PARAMS, COMMON        shape params and KernelSpec fields both kernels have
  x_arg, rows_arg, ...  the tensor arguments (vector-aligned bf16 rows, float32 mixes)
  random_inputs         make_inputs: TileKernels' test data (standard normal), odd seeds spread in scale
  forward               the forward in float64 (reference, and what the backward's reference differentiates)
  forward_fma32         the forward in the kernels' float32 order, exactly (mhc_multilayer_recompute's reference)
  widest_vec            the widest chunk (8 channels: 16 bytes) that divides hidden
"""

from __future__ import annotations

import torch

from tkjit.spec import Runtime, Static, TensorArg, Tolerance, ieee_plain_threads

MAX_MHC = 16
VECS = (1, 2, 4, 8)  # channels per chunk: 2..16-byte bf16 vectors
NUM_SMS = 132  # H200

PARAMS = (
    Runtime("num_tokens", hi=1 << 24, doc="tokens (num_seqs * seq_len); runtime size, tuned per power-of-two bucket"),
    Static("mhc", lo=1, hi=MAX_MHC, default=4, doc="mHC expansion rate: residual streams per token"),
    Static("hidden", lo=1, hi=1 << 16, default=7168, doc="channels per stream"),
)


def arch_constraint(arch, c, shape):
    if arch == "cpu":
        return "reads and writes bfloat16 and uses the thread index, which TileLang's C target does not lower"
    return None


# IEEE float32 maths (TileKernels' kernels do not use fast math either).
pass_configs = ieee_plain_threads


COMMON = dict(
    family="mhc",
    params=PARAMS,
    arch_constraint=arch_constraint,
    pass_configs=pass_configs,
    # bf16 outputs: the kernels accumulate in float32 and round once, the reference rounds the float64
    # value once; they differ by one bf16 ulp where float32's error crosses a rounding boundary (~1e-4 of
    # the elements, relative L2 ~1e-5). 1e-3 still fails any systematic error (truncation: ~2e-3).
    tolerance=Tolerance(rtol=1e-3),
)


def _align(shape, c):
    return 2 * c["vec"]


def x_arg(name):
    """A (num_tokens, hidden) bf16 tensor, read or written in vec-channel vectors."""
    return TensorArg(name, "bfloat16", ("num_tokens", "hidden"), align=_align)


def rows_arg(name):
    """A (num_tokens, mhc, hidden) bf16 tensor, read or written in vec-channel vectors."""
    return TensorArg(name, "bfloat16", ("num_tokens", "mhc", "hidden"), align=_align)


def post_arg(name):
    """A (num_tokens, mhc) float32 tensor (TileKernels' (..., mhc, 1) post_layer_mix, flattened)."""
    return TensorArg(name, "float32", ("num_tokens", "mhc"), align=4)


def comb_arg(name):
    """A (num_tokens, mhc, mhc) float32 tensor: comb_res_mix[t, m, n] mixes stream m into stream n."""
    return TensorArg(name, "float32", ("num_tokens", "mhc", "mhc"), align=4)


UNROLL_STEPS = 8  # more chunks per thread than this run as a loop


def row_threads(chunks: int) -> int:
    """Threads of a block that reduces one token's row of `chunks` vector chunks: the fewest that keep each
    thread within UNROLL_STEPS chunks (at most 512), then halved while half of them would idle."""
    threads = next((t for t in (64, 128, 256) if chunks <= t * UNROLL_STEPS), 512)
    while threads > 32 and chunks < threads // 2:
        threads //= 2
    return threads


def idle_threads_problem(chunks: int, threads: int) -> str | None:
    """The constraint row_threads keeps: no more than twice as many threads as a row has chunks."""
    if threads > 32 and chunks < threads // 2:
        return "fewer chunks per row than half the block's threads: use fewer threads"
    return None


def widest_vec(hidden: int, most: int = 8) -> int:
    return next(v for v in sorted(VECS, reverse=True) if v <= most and hidden % v == 0)


def vec_constraint(shape, c):
    if shape["hidden"] % c["vec"]:
        return f"vec={c['vec']} chunks need hidden={shape['hidden']} to be a multiple of {c['vec']}"
    return None


def random_inputs(shape, device="cpu", seed=0, grad=False):
    """(grad_out if grad,) x, residual, post_layer_mix, comb_res_mix: standard normal as TileKernels' test
    draws them. Odd seeds scale each token's x and residual rows by 2^k, k in [-8, 8], and zero some
    mixes, so that the tokens differ in magnitude (one token's error must not hide in another's)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    t, m, h = shape["num_tokens"], shape["mhc"], shape["hidden"]
    go = torch.randn(t, m, h, generator=g) if grad else None
    x = torch.randn(t, h, generator=g)
    res = torch.randn(t, m, h, generator=g)
    post = torch.randn(t, m, generator=g)
    comb = torch.randn(t, m, m, generator=g)
    if seed % 2:
        x = x * torch.exp2(torch.randint(-8, 9, (t, 1), generator=g).float())
        res = res * torch.exp2(torch.randint(-8, 9, (t, m, 1), generator=g).float())
        post[::3, 0] = 0.0
        comb[1::4, :, -1] = 0.0
    bf = [x.bfloat16(), res.bfloat16()]
    out = ([go.bfloat16()] if grad else []) + bf + [post, comb]
    return tuple(a.to(device) for a in out)


def forward(x, residual, post_layer_mix, comb_res_mix, dtype=torch.float64):
    """out before rounding, in `dtype`: TileKernels' mhc_post_ref (x * post + einsum('mn,mc->nc')).
    Works on the flattened (num_tokens, ...) tensors and on TileKernels' (n0, n1, ...) ones (post
    (..., mhc) or (..., mhc, 1))."""
    post = post_layer_mix.to(dtype)
    if post.dim() == residual.dim():  # (..., mhc, 1)
        post = post.squeeze(-1)
    term2 = torch.einsum("...mn,...mc->...nc", comb_res_mix.to(dtype), residual.to(dtype))
    return x.to(dtype).unsqueeze(-2) * post.unsqueeze(-1) + term2


def row_bytes(s) -> int:
    """Bytes of one (num_tokens, mhc, hidden) bf16 tensor."""
    return s["num_tokens"] * s["mhc"] * s["hidden"] * 2


def mix_bytes(s) -> int:
    """Bytes of post_layer_mix and comb_res_mix together."""
    return s["num_tokens"] * (s["mhc"] + s["mhc"] ** 2) * 4


def forward_fma32(x, residual, post_layer_mix, comb_res_mix):
    """out before rounding, float32, in the order nvcc gives mhc_post_fwd's (and TileKernels') loop
    `acc = post * x; acc += comb[0] * res[0]; acc += comb[1] * res[1] ...`: it contracts the first add
    with the post product, acc = fma(post, x, comb[0] * res[0]) (that product rounded), then one fused
    multiply-add per stream m = 1, 2, ... (sm_90a PTX: mul.f32 then fma.rn.f32 chains). Flattened tokens:
    x (t, hidden), residual (t, mhc, hidden), post_layer_mix (t, mhc), comb_res_mix (t, mhc, mhc); on the CPU."""
    from tkjit_kernels.mhc._streams import fma32

    xf, r = x.float().cpu(), residual.float().cpu()
    post, comb = post_layer_mix.float().cpu(), comb_res_mix.float().cpu()
    shape = r.shape  # (t, n, hidden): output stream n
    acc = comb[:, 0, :, None] * r[:, :1, :]  # float32 product, rounded once
    acc = fma32(post[:, :, None].expand(shape), xf[:, None, :].expand(shape), acc)
    for m in range(1, r.shape[1]):
        acc = fma32(comb[:, m, :, None].expand(shape), r[:, m : m + 1, :].expand(shape), acc)
    return acc
