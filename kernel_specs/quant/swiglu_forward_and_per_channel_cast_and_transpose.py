"""swiglu_forward_and_per_channel_cast_and_transpose / swiglu_forward_and_per_channel_cast: SwiGLU of
x = [gate | up] (num_tokens, 2 * hidden) bf16/f32, then per_channel_cast's FP8 e4m3 cast of the activations,
values transposed (hidden, num_tokens) or not (num_tokens, hidden) (TileKernels' without_transpose=True), one
float32 scale per channel and block of num_per_tokens tokens, scales (num_tokens / num_per_tokens, hidden).

The activation, in float32 and in the order of TileKernels' torch reference (`torch/swiglu.py`):
    g = float32(x[t, c]), u = float32(x[t, hidden + c])
    use_clamp: g = min(g, clamp_value), u = min(max(u, -clamp_value), clamp_value)
    act = g / (1 + exp(-g)) * u                  (IEEE division, expf: fast math off)
then rounded to x's dtype: TileKernels' kernel stages the activations in bf16 (its only input dtype) before the
cast, so its output is `cast(swiglu_forward(x).bfloat16(), 'e4m3', (num_per_tokens, 1), round_sf)`, which is
what this reference computes (then `_per_channel.reference_blocks`). The exponential is the one difference a
host reference cannot reproduce: the kernel's expf (CUDA's, as torch's CUDA exp) and the CPU's may differ in
the last bit, which after the bf16 rounding moves an FP8 value by one step a few times in a million; hence
rtol, not bit-exactness, against this (CPU) reference; the GPU tests compare bit for bit with the same
reference computed on the GPU and with TileKernels' kernel.

The kernels are per_channel_cast's (register tile) and per_channel_cast_and_transpose's (shared-memory
transpose), their spaces, constraints and defaults, with a `_per_channel.Prologue`: x is seen as
(token_blocks, num_per_tokens, 2 * hidden) and each vector of channels is made from its gate and up vectors
(two vector loads, hidden apart) instead of loaded. hidden is a multiple of 16 (TileKernels: x's width a
multiple of 128), num_tokens of num_per_tokens (TileKernels: of 128).
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Static, TensorArg, Tolerance
from tkjit_kernels.quant import per_channel_cast as cast
from tkjit_kernels.quant import per_channel_cast_and_transpose as transpose
from tkjit_kernels.quant._per_channel import (
    COMMON,
    PARAMS,
    SCALES,
    Prologue,
    elem_bytes,
    num_tokens,
    reference_blocks,
)
from tkjit_kernels.quant._per_channel import pass_configs as cast_pass_configs

CLAMP_MAX = 3.0e38  # finite float32

SWIGLU_PARAMS = (
    *PARAMS,
    Static("use_clamp", type=bool, default=False, doc="clamp gate and up before the activation (swiglu_clamp_value)"),
    Static("clamp_value", type=float, lo=0.0, hi=CLAMP_MAX, default=0.0,
           doc="gate <= clamp_value, |up| <= clamp_value (use_clamp; else 0)"),
)


def check_clamp(shape) -> str | None:
    if not shape["use_clamp"] and shape["clamp_value"] != 0.0:
        return f"clamp_value={shape['clamp_value']} is read only with use_clamp=True (leave it 0)"
    return None


def pass_configs(c):
    return {**cast_pass_configs(c), "tl.enable_fast_math": False}  # expf and IEEE maths, as torch's CUDA ops


def swiglu_prologue(shape) -> Prologue:
    """The prologue of both kernels: vectors of channels col .. col + n - 1 of the activations."""
    from tilelang import language as T

    H, in_dtype = shape["hidden"], shape["in_dtype"]
    use_clamp, clamp = shape["use_clamp"], shape["clamp_value"]
    f32 = T.float32

    def act(g, u):
        g = T.cast(g, f32)
        u = T.cast(u, f32)
        if use_clamp:
            g = T.min(g, f32(clamp))
            u = T.min(T.max(u, f32(-clamp)), f32(clamp))
        return T.ieee_fdiv(g, f32(1.0) + T.exp(-g)) * u

    def loader(n):
        @T.macro
        def load(dst, off, x, b, row, col):
            gate = T.alloc_local((n,), in_dtype)
            up = T.alloc_local((n,), in_dtype)
            for v in T.vectorized(n):
                gate[v] = x[b, row, col + v]
            for v in T.vectorized(n):
                up[v] = x[b, row, H + col + v]
            acts = T.alloc_local((n,), f32)
            for v in T.unroll(n):
                acts[v] = act(gate[v], up[v])
            for v in T.vectorized(n):  # a vector cast: one paired conversion (round to nearest) two channels
                dst[off + v] = T.cast(acts[v], in_dtype)

        return load

    return Prologue(x_cols=lambda h: 2 * h, loader=loader)


def swiglu(shape, x):
    """The activations (..., hidden) in x's dtype, of x (..., 2 * hidden)."""
    h = shape["hidden"]
    xf = x.float()
    g, u = xf[..., :h], xf[..., h:]
    if shape["use_clamp"]:
        c = shape["clamp_value"]
        g = torch.clamp(g, max=c)
        u = torch.clamp(u, min=-c, max=c)
    return (g / (1.0 + torch.exp(-g)) * u).to(x.dtype)


def reference_cast(shape, x):
    return reference_blocks(shape, swiglu(shape, x))


def reference_transpose(shape, x):
    return transpose.reference(shape, swiglu(shape, x))


def default_cast(shape):
    """bf16: the config every study of the cast tuned to on an H100 (TileKernels' benchmark shapes, 128 tokens a
    scale: 32 and 256 x 128 tokens x hidden 2048 and 7168): 8 channels a thread, 2 token rows a thread, 512
    threads, staged through shared memory, the occupancy hint of 4 blocks an SM, and the per-channel fold
    (`factors="channel"`: one thread a channel folds the partial maxima and divides, TileKernels' way). It ran
    59.7-62.1 us at 32 x 128 x 7168 against TileKernels' 61.6-61.9 and the previous default's 66.8-67.5 (4 channels
    and 8 rows a thread, 256 threads, each thread folding its own factors), 22.4-23.6 against 25.0-25.8 at 32 x 128
    x 2048. Each element's SwiGLU (expf, an IEEE division) costs more than its bytes, so the warps an SM holds
    matter more than the loads a thread keeps in flight. At 32 tokens a scale the same 2 rows a thread take 32
    threads along a row of 256 channels (not measured yet). Where that does not fit, the previous default, then
    per_channel_cast's."""
    if shape["in_dtype"] == "bfloat16":
        npt = shape["num_per_tokens"]
        for vec, threads, rows, hint, factors in ((8, 512, 2, 2048, "channel"), (4, 256, 8, 2048, "thread")):
            cfg = {"vec": vec, "ch_threads": threads * rows // npt, "threads": threads, "stage": "smem",
                   "min_threads_per_sm": hint, "factors": factors}
            if cfg["ch_threads"] in cast.SPACE["ch_threads"] and cast.constraint(shape, cfg) is None:
                return cfg
    return cast.default(shape)


def make_inputs(shape, device="cpu", seed=0):
    """x (token_blocks, num_per_tokens, 2 * hidden): gates around 0 (both signs of the SiLU; a few past +-20,
    where exp(-g) over- or underflows), some beyond the clamp; ups of many magnitudes per channel, some under
    the amax clamp, one channel all zero; one token block scaled far up."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nb, npt, h = shape["token_blocks"], shape["num_per_tokens"], shape["hidden"]
    gate = 3 * torch.randn(nb, npt, h, generator=g)
    gate[:, ::7, ::5] *= 10.0
    up = torch.randn(nb, npt, h, generator=g) * torch.exp(2 * torch.randn(1, 1, h, generator=g))
    up[:, :, 3::17] *= 1e-7
    if h > 5:
        up[:, :, 5] = 0
    if nb > 1:
        up[1] *= 64.0
    x = torch.cat([gate, up], dim=2)
    return (x.to(getattr(torch, shape["in_dtype"])).to(device),)


def bytes_moved(s) -> int:
    """x (both halves) read once, the FP8 values written once, the scales written once."""
    n, h = num_tokens(s), s["hidden"]
    return n * h * (2 * elem_bytes(s) + 1) + s["token_blocks"] * h * 4


def flops(s) -> int:
    return num_tokens(s) * s["hidden"] * 8  # exp, add, divide, multiply, amax, scale, clamp, convert


def _check_shape(check):
    def check_shape(shape):
        return check_clamp(shape) or check(shape)

    return check_shape


X = TensorArg("x", lambda s: s["in_dtype"], ("token_blocks", "num_per_tokens", lambda s: 2 * s["hidden"]))

EXAMPLES = (
    {"token_blocks": 32, "hidden": 2048},  # 4096 tokens of a 2048-wide expert FFN
    {"token_blocks": 256, "hidden": 2048, "use_clamp": True, "clamp_value": 10.0},
    {"token_blocks": 128, "hidden": 4096, "num_per_tokens": 32, "round_scale": True},
    {"token_blocks": 63, "hidden": 576, "in_dtype": "float32", "use_clamp": True, "clamp_value": 7.0},
)

SWIGLU = dict(
    COMMON,
    params=SWIGLU_PARAMS,
    pass_configs=pass_configs,
    inputs=(X,),
    make_inputs=make_inputs,
    bytes_moved=bytes_moved,
    flops=flops,
    tolerance=Tolerance(rtol=1e-3),
    examples=EXAMPLES,
)

SPEC_TRANSPOSE = register(
    KernelSpec(
        name="swiglu_forward_and_per_channel_cast_and_transpose",
        doc="SwiGLU of [gate | up] then per-channel FP8 e4m3 cast, values transposed (hidden, num_tokens), one "
        "float32 scale per channel and num_per_tokens tokens",
        space=transpose.SPACE,
        default=transpose.default,
        constraint=transpose.constraint,
        check_shape=_check_shape(transpose.check_shape),
        build=lambda shape, c: transpose.build(shape, c, swiglu_prologue(shape)),
        outputs=(TensorArg("out", "float8_e4m3fn", ("hidden", "token_blocks", "num_per_tokens")), SCALES),
        reference=reference_transpose,
        **SWIGLU,
    )
)

SPEC_CAST = register(
    KernelSpec(
        name="swiglu_forward_and_per_channel_cast",
        doc="SwiGLU of [gate | up] then per-channel FP8 e4m3 cast (num_tokens, hidden), one float32 scale per "
        "channel and num_per_tokens tokens (TileKernels' without_transpose=True)",
        space=cast.SPACE,
        default=default_cast,
        constraint=cast.constraint,
        check_shape=_check_shape(cast.check_shape),
        build=lambda shape, c: cast.build(shape, c, swiglu_prologue(shape)),
        outputs=(TensorArg("out", "float8_e4m3fn", ("token_blocks", "num_per_tokens", "hidden")), SCALES),
        reference=reference_cast,
        **SWIGLU,
    )
)
